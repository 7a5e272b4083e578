"""A generic epoch loop, indifferent to where batches come from.

Single-stage (images through a frozen bottom) and two-stage (cached features)
training must differ only in their batch source to compare them fairly, so both
run through this loop with the same optimizer, schedule, metrics and checkpoints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from ..device import out_of_memory
from ..errors import DataError, ModelError
from ..lazy import lazy_module
from ..models.weights import save_weights
from ..ops.prefetch import EpochPrefetch
from ..progress import Progress
from ..recipe_model import RecipeModel
from ..threads import StepPacer, compute_threads, deterministic, step_pacer
from .amp import AmpPolicy, module_device, pinned, to_device
from .checkpoint import CHECKPOINT_FILE, load_checkpoint, restore_rng, rng_state, save_checkpoint
from .graphed import StepGraph, graph_refusal, portable_optimizer_state, set_lr
from .microbatch import DEFAULT_MICRO_BATCH, MicroBatches

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")

Batches = Iterable[tuple["torch.Tensor", "torch.Tensor"]]
#: A training loss: (logits, labels, the inputs the logits came from) -> a scalar. The inputs are for
#: terms that compare with another network's view of the same batch (distillation, warm_start.Distillation).
LossFn = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


class TrainConfig(RecipeModel):
    epochs: int = Field(10, ge=1)
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd only")
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_epochs: float = Field(0, ge=0, description="linear warmup from ~0 to lr, in epochs")
    label_smoothing: float = Field(0.0, ge=0, le=1)
    grad_clip: float | None = Field(None, gt=0, description="max global gradient L2 norm")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="fp32; bf16 autocast (CPU, CUDA); fp16 autocast + gradient scaler (CUDA)")
    cuda_graph: Literal["auto", "on", "off"] = Field(
        "auto", description="capture the training step as a CUDA graph (pipeline.methods.graphed): auto "
        "where it can (CUDA, fp32/bf16, adamw/adam/sgd), on (refused where it cannot), off (eager)")
    memory_format: Literal["contiguous", "channels_last"] = Field(
        "contiguous", description="the layout of the trained network's 4-D weights and of its input "
        "batches: channels_last (NHWC) makes depthwise-heavy tops (MobileNetV2 blocks at 7x7 and 14x14) "
        "faster on a CPU and slows 1x1-only ones (benchmarks/README.md has the figures); it changes the "
        "kernels and so the last bits of the weights, which is why it is a setting of the recipe")
    micro_batch: int = Field(
        DEFAULT_MICRO_BATCH, ge=1, description="run.deterministic on a CPU: samples per micro-batch, each "
        "computed on one thread and summed in a fixed order (pipeline.methods.microbatch); batch norm "
        "layers normalise over a micro-batch")
    seed: int = 0

    @field_validator("cuda_graph", mode="before")
    @classmethod
    def _cuda_graph_words(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare on/off as true/false: `cuda_graph: off` means "off".
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

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
    resumed_from: int | None = None  # epochs already done by an interrupted run this one continued
    cuda_graph: bool = False  # the steps of full batches were replays of one captured CUDA graph


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


def thread_invariant(device: torch.device) -> bool:
    """Whether loops on ``device`` compute in micro-batches (``run.deterministic``, on a CPU)."""
    return device.type == "cpu" and deterministic()


def evaluate(model: nn.Module, batches: Batches, *, precision: str = "fp32",
             micro: MicroBatches | None = None) -> tuple[float, float, int]:
    """(mean cross-entropy, accuracy, samples) in eval mode; no label smoothing, so runs compare.

    Runs where the model's parameters are, at ``precision`` (autocast, as it was trained); the
    loss is summed in fp32 either way. On a CPU under ``run.deterministic``, in micro-batches
    (``micro``, or new ones of the default size), so the figures do not depend on the thread count.
    """
    model.eval()
    device = module_device(model)
    if micro is None and thread_invariant(device):
        with MicroBatches(model, DEFAULT_MICRO_BATCH, compute_threads()) as own:
            return evaluate(model, batches, precision=precision, micro=own)
    amp = AmpPolicy(precision, device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    n = 0
    with torch.no_grad():
        for x, y in to_device(batches, device):
            if micro is not None:
                logits = micro.forward(x, amp.autocast)
            else:
                with amp.autocast():
                    logits = model(x)
            logits = logits.float()
            # Accumulated on the device: one synchronization at the end, not two per batch.
            loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").double()
            correct += (logits.argmax(1) == y).sum()
            n += len(y)
    if n == 0:
        raise DataError("evaluation batches yielded no samples (is the evaluation split empty?)")
    return float(loss_sum) / n, int(correct) / n, n


def _steps_hint(batches: Any) -> int | None:
    try:
        return len(batches)
    except TypeError:
        return None


def cross_entropy(cfg: TrainConfig) -> LossFn:
    """The default training loss: cross-entropy with ``cfg.label_smoothing``."""
    ce = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    return lambda logits, y, _x: ce(logits, y)


@dataclass
class _Epoch:
    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0
    steps: int = 0
    lr: float = 0.0


@dataclass
class _Loop:
    """What one training loop's steps share: the model, the optimizer, the precision, where to report."""

    model: nn.Module
    opt: torch.optim.Optimizer
    params: list[nn.Parameter]
    cfg: TrainConfig
    amp: AmpPolicy
    device: torch.device
    loss: LossFn
    progress: Callable[[dict[str, Any]], None] | None = None
    pace: StepPacer | None = None
    graph: StepGraph | None = None  # the step as a CUDA graph (train.cuda_graph), else the eager step
    micro: MicroBatches | None = None  # the step in micro-batches (run.deterministic on a CPU)
    layout: _Layout | None = None  # train.memory_format, applied to each batch


def _train_epoch(loop: _Loop, batches: Batches, epoch: int, steps_per_epoch: int | None,
                 bar: Any = None) -> _Epoch:
    model, opt, cfg, loss_fn = loop.model, loop.opt, loop.cfg, loop.loss
    ep = _Epoch(lr=cfg.lr)
    pace = loop.pace or StepPacer(None)
    correct = torch.zeros((), dtype=torch.int64, device=loop.device)
    pace.start()
    for step, (x, y) in enumerate(to_device(batches, loop.device)):
        if loop.layout is not None:
            x = loop.layout.batch(x)
        frac = step / steps_per_epoch if steps_per_epoch else 0.5
        ep.lr = cfg.lr_at(epoch + min(frac, 1.0))
        for group in opt.param_groups:
            group["lr"] = ep.lr
        # Before the forward, not just before backward: the last step's gradients are freed before
        # this step's activations are allocated, which reuses memory that is still in cache.
        opt.zero_grad(set_to_none=True)
        if loop.micro is not None:
            def loss_of(xi: torch.Tensor, yi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                out = model(xi)
                return loss_fn(out, yi, xi), out

            value, logits = loop.micro.gradients(x, y, loop.params, loss_of, loop.amp.autocast)
        else:
            with loop.amp.autocast():
                logits = model(x)
                loss = loss_fn(logits, y, x)
            value = loss.detach().item()
        if not math.isfinite(value):
            raise ModelError(
                f"training diverged: loss is {value} at epoch {epoch}, step {step} "
                f"(lr {ep.lr:.3g}); lower train.lr, set train.grad_clip, or check the inputs for NaN/inf"
            )
        if loop.micro is not None:
            loop.amp.apply(opt, loop.params, cfg.grad_clip)
        else:
            loop.amp.step(loss, opt, loop.params, cfg.grad_clip)
        ep.loss_sum += value * len(y)
        # Counted on the device: the loss's .item() above is this step's only wait for the device.
        correct = correct + (logits.detach().argmax(1) == y).sum()
        ep.samples += len(y)
        ep.steps = step + 1
        pace.step(len(y))  # run.threads: auto adapts the thread count here, between steps
        if bar is not None:
            bar.update(1)
        if loop.progress is not None:
            loop.progress({"epoch": epoch, "step": step, "samples": ep.samples, "loss": value, "lr": ep.lr})
    if ep.samples == 0:
        raise DataError(f"train_batches({epoch}) yielded no batches (is the train split empty?)")
    ep.correct = int(correct)
    return ep


def _train_epoch_graphed(loop: _Loop, graph: StepGraph, batches: Batches, epoch: int,
                         steps_per_epoch: int | None, bar: Any = None) -> _Epoch:
    """:func:`_train_epoch` with each step a replay of ``graph``: the loss is summed on the device and
    read once, at the end of the epoch (a per-step read would make the host wait for every step)."""
    cfg = loop.cfg
    ep = _Epoch(lr=cfg.lr)
    graph.reset_sums()
    for step, (x, y) in enumerate(to_device(batches, loop.device)):
        frac = step / steps_per_epoch if steps_per_epoch else 0.5
        ep.lr = cfg.lr_at(epoch + min(frac, 1.0))
        set_lr(loop.opt, ep.lr)
        loss = graph.step(x, y)
        ep.samples += len(y)
        ep.steps = step + 1
        if bar is not None:
            bar.update(1)
        if loop.progress is not None:
            loop.progress({"epoch": epoch, "step": step, "samples": ep.samples, "loss": float(loss),
                           "lr": ep.lr})
    if ep.samples == 0:
        raise DataError(f"train_batches({epoch}) yielded no batches (is the train split empty?)")
    ep.loss_sum, ep.correct = graph.sums()
    if not math.isfinite(ep.loss_sum):
        raise ModelError(
            f"training diverged: the loss summed over epoch {epoch} is {ep.loss_sum} (lr up to "
            f"{cfg.lr:.3g}); lower train.lr, set train.grad_clip, or check the inputs for NaN/inf "
            "(train.cuda_graph: off checks every step and names the first bad one)"
        )
    return ep


def _cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    # contiguous: a channels_last network's checkpoint holds the same bytes as any other's
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}


class _Layout:
    """``train.memory_format`` applied: the network's weights and each input batch in that layout for
    training, the network back in the default layout when training ends (what is saved, exported and
    loaded elsewhere never depends on the setting's layout)."""

    def __init__(self, model: nn.Module, memory_format: str) -> None:
        self.model = model
        self.format = torch.channels_last if memory_format == "channels_last" else None

    def __enter__(self) -> _Layout:
        if self.format is not None:
            self.model.to(memory_format=self.format)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.format is not None:
            self.model.to(memory_format=torch.contiguous_format)

    def batch(self, x: torch.Tensor) -> torch.Tensor:
        if self.format is None or not isinstance(x, torch.Tensor) or x.dim() != 4:
            return x
        return x.contiguous(memory_format=self.format)


def train(model: nn.Module, parameters: Iterable[nn.Parameter],
          train_batches: Callable[[int], Batches], eval_batches: Callable[[], Batches] | None,
          cfg: TrainConfig, *, checkpoint_dir: Path | None,
          on_epoch: Callable[[dict[str, Any]], None] | None = None,
          progress: Callable[[dict[str, Any]], None] | None = None,
          train_mode: Callable[[nn.Module], None] | None = None,
          steps_per_epoch: int | None = None, read_ahead: int = 0,
          resume_key: str | None = None, bars: Progress | None = None, label: str = "train",
          batch_size: int | None = None, batch_setting: str | None = None,
          log: Callable[[str], None] | None = None,
          prepare: Callable[[Any], torch.Tensor] | None = None,
          loss: LossFn | None = None) -> TrainResult:
    """Train ``parameters`` (those with requires_grad) of ``model`` for ``cfg.epochs`` epochs.

    Runs where ``model``'s parameters are (move it to the device first), at ``cfg.precision``
    (``pipeline.methods.amp``); host batches are moved there from pinned memory.
    ``train_mode(model)`` is called before each training pass (default ``model.train()``)
    so a caller can keep frozen parts in eval mode. The lr follows the schedule per step;
    when the steps per epoch are unknown (``steps_per_epoch`` not given and the batches
    have no len) the first epoch uses its midpoint lr and later epochs the first epoch's
    step count. RNG state is forked: dropout is reproducible by ``cfg.seed`` and the
    caller's RNG is untouched. ``progress`` gets ``{epoch, step, samples, loss, lr}`` per step;
    ``bars`` shows a progress bar per epoch, described by ``label``.
    ``read_ahead`` > 0 prepares that many training batches on a background thread, running on
    into the next epoch while this one ends and is evaluated (:class:`EpochPrefetch`); then
    ``train_batches`` must not depend on the model's state, and sees its epochs in order.
    Records have val_* keys only when ``eval_batches`` is given. ``best.pt`` (highest val
    acc; the last epoch without eval) holds the model's state_dict in ``save_weights`` format;
    ``last.pt`` the whole training state after the last finished epoch (``pipeline.methods.
    checkpoint``). With ``resume_key`` (the stage's fingerprint), a ``last.pt`` written under the
    same key is continued from: the result and the weights are those of an uninterrupted run.
    Out of memory raises :class:`DeviceMemoryError` naming ``label``, ``batch_size`` and
    ``batch_setting`` (the recipe field to lower).
    On a GPU, ``cfg.cuda_graph`` (auto/on) captures the step as a CUDA graph
    (:mod:`pipeline.methods.graphed`); ``prepare``, given, turns each training batch's ``x`` (then
    a dict of stored tensors, e.g. coded feature maps) into the model's input inside the step, so
    the decoding is captured with it. ``loss`` replaces the default cross-entropy
    (:func:`cross_entropy`); it gets the model's inputs too.
    """
    params = [p for p in parameters if p.requires_grad]
    if not params:
        raise ModelError(f"no trainable parameters given to train {type(model).__name__} "
                         "(all have requires_grad=False)")
    if checkpoint_dir is not None:
        checkpoint_dir = Path(checkpoint_dir)
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    device = module_device(model)
    amp = AmpPolicy(cfg.precision, device)
    opt = make_optimizer(params, cfg)
    micro = None
    if thread_invariant(device):
        micro = MicroBatches(model, cfg.micro_batch, compute_threads(), log)
        top = -(-batch_size // cfg.micro_batch) if batch_size else None  # more threads than parts idle
        pace = step_pacer(micro.set_workers, micro.workers, top)
    else:
        pace = step_pacer()
    loss_fn = loss if loss is not None else cross_entropy(cfg)
    layout = _Layout(model, cfg.memory_format)
    loop = _Loop(model, opt, params, cfg, amp, device, loss_fn, progress, pace, micro=micro, layout=layout)
    result = TrainResult()
    start = 0
    saved = None
    last = checkpoint_dir / CHECKPOINT_FILE if checkpoint_dir is not None else None
    if last is not None and resume_key is not None:
        saved = load_checkpoint(last, resume_key)
    if saved is not None:
        model.load_state_dict(saved["state_dict"])
        opt.load_state_dict(saved["optimizer"])
        amp.load_state_dict(saved["amp"])
        start = int(saved["epoch"])
        steps_per_epoch = steps_per_epoch or saved["steps_per_epoch"]
        result.history = list(saved["history"])
        result.best_val_acc, result.best_epoch = saved["best_val_acc"], saved["best_epoch"]
        result.last_val_acc = saved["last_val_acc"]
        result.resumed_from = start
        if log is not None:
            log(f"resuming training after epoch {start - 1} (of 0-{cfg.epochs - 1}) from "
                f"{last}")
    refusal = graph_refusal(device, cfg.precision, cfg.optimizer)
    if cfg.cuda_graph == "on" and refusal is not None:
        raise ModelError(f"train.cuda_graph: on, but the step cannot be captured: {refusal}")
    if cfg.cuda_graph != "off" and refusal is None:
        loop.graph = StepGraph(model, opt, params, amp, loss_fn, cfg.grad_clip, device, prepare,
                               strict=cfg.cuda_graph == "on", log=log)
    elif prepare is not None:
        raise ModelError("train(prepare=...) decodes batches inside a CUDA-graph step; without one, "
                         "give train_batches the model's inputs")
    bars = bars or Progress(quiet=True)
    t_start = time.perf_counter()
    ahead = None
    if read_ahead and start < cfg.epochs:
        def open_epoch(i: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            return pinned(train_batches(start + i), device)  # pinned on the read-ahead thread
        ahead = EpochPrefetch(open_epoch, cfg.epochs - start, read_ahead, name="train-batches")
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), (closing(ahead) if ahead is not None else nullcontext()), \
            (micro if micro is not None else nullcontext()), layout:
        torch.manual_seed(cfg.seed)
        if saved is not None:
            restore_rng(saved["rng"], device)
        for epoch in range(start, cfg.epochs):
            if train_mode is None:
                model.train()
            else:
                train_mode(model)
            t0 = time.perf_counter()
            batches = ahead.epoch(epoch - start) if ahead is not None else train_batches(epoch)
            steps = steps_per_epoch or _steps_hint(batches)
            try:
                with bars.bar(steps, f"{label}: epoch {epoch + 1}/{cfg.epochs}", unit="batch") as bar:
                    if loop.graph is not None:
                        ep = _train_epoch_graphed(loop, loop.graph, batches, epoch, steps, bar)
                    else:
                        ep = _train_epoch(loop, batches, epoch, steps, bar)
                steps_per_epoch = steps_per_epoch or ep.steps
                record: dict[str, Any] = {
                    "epoch": epoch, "train_loss": ep.loss_sum / ep.samples,
                    "train_acc": ep.correct / ep.samples,
                    "epoch_seconds": time.perf_counter() - t0, "lr": ep.lr, "samples": ep.samples,
                    "steps": ep.steps, "eval_seconds": 0.0,
                }
                improved = True
                if eval_batches is not None:
                    t1 = time.perf_counter()
                    val_loss, val_acc, val_n = evaluate(model, eval_batches(), precision=cfg.precision,
                                                        micro=micro)
                    record.update(val_loss=val_loss, val_acc=val_acc, val_samples=val_n,
                                  eval_seconds=time.perf_counter() - t1)
                    improved = result.best_val_acc is None or val_acc > result.best_val_acc
                    result.last_val_acc = val_acc
                    if improved:
                        result.best_val_acc = val_acc
            except torch.OutOfMemoryError as exc:
                raise out_of_memory(exc, stage=label, batch_size=batch_size, setting=batch_setting,
                                    device=device, during=f"training, epoch {epoch}",
                                    resumes="A rerun continues from the last finished epoch") from None
            if improved:
                result.best_epoch = epoch
            result.history.append(record)
            if checkpoint_dir is not None:
                meta = {k: v for k, v in record.items() if k in ("epoch", "val_acc", "train_loss")}
                if improved:  # before last.pt: a crash in between retrains this epoch and rewrites it
                    save_weights(model, checkpoint_dir / "best.pt", meta)
                assert last is not None
                save_checkpoint(last, {
                    "fingerprint": resume_key or "", "epoch": epoch + 1, "state_dict": _cpu_state(model),
                    "meta": meta, "optimizer": portable_optimizer_state(opt.state_dict()),
                    "amp": amp.state_dict(),
                    "rng": rng_state(device), "steps_per_epoch": steps_per_epoch, "history": result.history,
                    "best_val_acc": result.best_val_acc, "best_epoch": result.best_epoch,
                    "last_val_acc": result.last_val_acc,
                })
            if on_epoch is not None:
                on_epoch(record)
    result.total_seconds = time.perf_counter() - t_start
    result.cuda_graph = loop.graph is not None and loop.graph.replays > 0
    return result
