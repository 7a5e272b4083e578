"""A generic epoch loop, indifferent to where batches come from.

Single-stage (images through a frozen bottom) and two-stage (cached features)
training must differ only in their batch source to compare them fairly, so both
run through this loop with the same optimizer, schedule, metrics and checkpoints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, model_validator

from ..errors import DataError, ModelError
from ..lazy import lazy_module
from ..models.weights import save_weights
from ..ops.prefetch import EpochPrefetch
from ..threads import StepPacer, step_pacer

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")

Batches = Iterable[tuple["torch.Tensor", "torch.Tensor"]]


class TrainConfig(BaseModel, frozen=True, extra="forbid"):
    epochs: int = Field(10, ge=1)
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd only")
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_epochs: float = Field(0, ge=0, description="linear warmup from ~0 to lr, in epochs")
    label_smoothing: float = Field(0.0, ge=0, le=1)
    grad_clip: float | None = Field(None, gt=0, description="max global gradient L2 norm")
    seed: int = 0

    @model_validator(mode="after")
    def _warmup_fits(self) -> TrainConfig:
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"warmup_epochs ({self.warmup_epochs}) must be less than epochs ({self.epochs})")
        return self

    def lr_at(self, position: float) -> float:
        """Learning rate at ``position`` epochs into training (fractional: per-step schedules)."""
        w = self.warmup_epochs
        if position < w:
            return self.lr * min(1.0, (position + 1e-3) / w)
        if self.schedule == "constant":
            return self.lr
        progress = (position - w) / (self.epochs - w)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class TrainResult:
    history: list[dict[str, Any]] = field(default_factory=list)
    best_val_acc: float | None = None  # None when trained without evaluation batches
    best_epoch: int | None = None
    last_val_acc: float | None = None
    total_seconds: float = 0.0


# Devices torch has fused optimizer kernels for (CPU since torch 2.4).
FUSED_DEVICES = ("cpu", "cuda")


def make_optimizer(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names, fused (one kernel per step for all parameters) where torch has one.

    Why fused on a CPU: the for-loop Adam/AdamW takes the square root of the second moment with
    ``torch.sqrt``, which on x86 is far slower on zeros than on other values, and zeros are what a
    weight whose gradient is zero holds (a classifier on features that are mostly zero). The fused
    kernel takes the same time either way, with the same result for float32 (AdamW bit for bit,
    Adam to rounding). Older torch builds without a fused CPU kernel refuse ``fused=True`` at
    construction; then the for-loop one is used.
    """
    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    if cfg.optimizer == "sgd":
        cls, kwargs = torch.optim.SGD, {"momentum": cfg.momentum}
    else:
        cls, kwargs = (torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW), {}
    kwargs.update(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in params):
        try:
            return cls(params, fused=True, **kwargs)
        except RuntimeError:  # torch < 2.4 on a CPU: "fused=True requires ... supported devices"
            pass
    return cls(params, **kwargs)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def evaluate(model: nn.Module, batches: Batches) -> tuple[float, float, int]:
    """(mean cross-entropy, accuracy, samples) in eval mode; no label smoothing, so runs compare."""
    model.eval()
    device = _device(model)
    loss_sum, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(device), y.to(device).long()
            logits = model(x)
            loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
            n += len(y)
    if n == 0:
        raise DataError("evaluation batches yielded no samples (is the evaluation split empty?)")
    return loss_sum / n, correct / n, n


def _steps_hint(batches: Any) -> int | None:
    try:
        return len(batches)
    except TypeError:
        return None


@dataclass
class _Epoch:
    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0
    steps: int = 0
    lr: float = 0.0


def _train_epoch(model: nn.Module, batches: Batches, opt: torch.optim.Optimizer, params: list[nn.Parameter],
                 cfg: TrainConfig, epoch: int, steps_per_epoch: int | None,
                 progress: Callable[[dict[str, Any]], None] | None, pace: StepPacer | None = None) -> _Epoch:
    device = _device(model)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    ep = _Epoch(lr=cfg.lr)
    pace = pace or StepPacer(None)
    pace.start()
    for step, (x, y) in enumerate(batches):
        frac = step / steps_per_epoch if steps_per_epoch else 0.5
        ep.lr = cfg.lr_at(epoch + min(frac, 1.0))
        for group in opt.param_groups:
            group["lr"] = ep.lr
        x, y = x.to(device), y.to(device).long()
        # Before the forward, not just before backward: the last step's gradients are freed before
        # this step's activations are allocated, which reuses memory that is still in cache.
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = loss_fn(logits, y)
        value = loss.detach().item()
        if not math.isfinite(value):
            raise ModelError(
                f"training diverged: loss is {value} at epoch {epoch}, step {step} "
                f"(lr {ep.lr:.3g}); lower train.lr, set train.grad_clip, or check the inputs for NaN/inf"
            )
        loss.backward()
        if cfg.grad_clip is not None:
            nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        ep.loss_sum += value * len(y)
        ep.correct += int((logits.detach().argmax(1) == y).sum())
        ep.samples += len(y)
        ep.steps = step + 1
        pace.step(len(y))  # run.threads: auto adapts the thread count here, between steps
        if progress is not None:
            progress({"epoch": epoch, "step": step, "samples": ep.samples, "loss": value, "lr": ep.lr})
    if ep.samples == 0:
        raise DataError(f"train_batches({epoch}) yielded no batches (is the train split empty?)")
    return ep


def train(model: nn.Module, parameters: Iterable[nn.Parameter],
          train_batches: Callable[[int], Batches], eval_batches: Callable[[], Batches] | None,
          cfg: TrainConfig, *, checkpoint_dir: Path | None,
          on_epoch: Callable[[dict[str, Any]], None] | None = None,
          progress: Callable[[dict[str, Any]], None] | None = None,
          train_mode: Callable[[nn.Module], None] | None = None,
          steps_per_epoch: int | None = None, read_ahead: int = 0) -> TrainResult:
    """Train ``parameters`` (those with requires_grad) of ``model`` for ``cfg.epochs`` epochs.

    ``train_mode(model)`` is called before each training pass (default ``model.train()``)
    so a caller can keep frozen parts in eval mode. The lr follows the schedule per step;
    when the steps per epoch are unknown (``steps_per_epoch`` not given and the batches
    have no len) the first epoch uses its midpoint lr and later epochs the first epoch's
    step count. RNG state is forked: dropout is reproducible by ``cfg.seed`` and the
    caller's RNG is untouched. ``progress`` gets ``{epoch, step, samples, loss, lr}`` per step.
    ``read_ahead`` > 0 prepares that many training batches on a background thread, running on
    into the next epoch while this one ends and is evaluated (:class:`EpochPrefetch`); then
    ``train_batches`` must not depend on the model's state, and sees its epochs in order.
    Records have val_* keys only when ``eval_batches`` is given. ``best.pt`` (highest val
    acc; the last epoch without eval) and ``last.pt`` hold the model's state_dict in
    ``save_weights`` format.
    """
    params = [p for p in parameters if p.requires_grad]
    if not params:
        raise ModelError(f"no trainable parameters given to train {type(model).__name__} "
                         "(all have requires_grad=False)")
    if checkpoint_dir is not None:
        checkpoint_dir = Path(checkpoint_dir)
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    opt = make_optimizer(params, cfg)
    pace = step_pacer()  # one per loop: step times of different models do not compare
    result = TrainResult()
    t_start = time.perf_counter()
    ahead = EpochPrefetch(train_batches, cfg.epochs, read_ahead, name="train-batches") if read_ahead else None
    with torch.random.fork_rng(devices=[]), (closing(ahead) if ahead is not None else nullcontext()):
        torch.manual_seed(cfg.seed)
        for epoch in range(cfg.epochs):
            if train_mode is None:
                model.train()
            else:
                train_mode(model)
            t0 = time.perf_counter()
            batches = ahead.epoch(epoch) if ahead is not None else train_batches(epoch)
            ep = _train_epoch(model, batches, opt, params, cfg, epoch,
                              steps_per_epoch or _steps_hint(batches), progress, pace)
            steps_per_epoch = steps_per_epoch or ep.steps
            record: dict[str, Any] = {
                "epoch": epoch, "train_loss": ep.loss_sum / ep.samples, "train_acc": ep.correct / ep.samples,
                "epoch_seconds": time.perf_counter() - t0, "lr": ep.lr, "samples": ep.samples,
                "steps": ep.steps, "eval_seconds": 0.0,
            }
            improved = True
            if eval_batches is not None:
                t1 = time.perf_counter()
                val_loss, val_acc, val_n = evaluate(model, eval_batches())
                record.update(val_loss=val_loss, val_acc=val_acc, val_samples=val_n,
                              eval_seconds=time.perf_counter() - t1)
                improved = result.best_val_acc is None or val_acc > result.best_val_acc
                result.last_val_acc = val_acc
                if improved:
                    result.best_val_acc = val_acc
            if improved:
                result.best_epoch = epoch
            if checkpoint_dir is not None:
                meta = {k: v for k, v in record.items() if k in ("epoch", "val_acc", "train_loss")}
                save_weights(model, checkpoint_dir / "last.pt", meta)
                if improved:
                    save_weights(model, checkpoint_dir / "best.pt", meta)
            result.history.append(record)
            if on_epoch is not None:
                on_epoch(record)
    result.total_seconds = time.perf_counter() - t_start
    return result
