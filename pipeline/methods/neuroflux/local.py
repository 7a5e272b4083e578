"""Local learning of one block: each layer steps on its own auxiliary loss.

For every batch, the block's layers run in order; layer ``i`` gets the *detached* output
of layer ``i-1``, computes its auxiliary head's cross-entropy, and takes an optimizer step.
No gradient crosses a layer boundary, so only one layer's autograd graph exists at a time
(what makes a block's memory ``statics + one layer's activations``). Classic local learning
is the same loop over all layers as one block.

Runs where the layers are (batches are moved there, from pinned memory on CUDA), at
``train.precision``: each layer's forward and loss under autocast, its step through its own
gradient scaler for fp16 (``pipeline.methods.amp``). On a CPU under ``run.deterministic`` the
batch is computed in micro-batches (``pipeline.methods.microbatch``): every layer's forward runs on
the weights before any step (as above), so the layers' losses are summed into one backward whose
gradients land on disjoint parameters, and then each layer steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import DataError, ModelError
from ...threads import compute_threads
from ..amp import AmpPolicy, module_device, to_device
from ..microbatch import DEFAULT_MICRO_BATCH, MicroBatches
from ..trainer import TrainConfig, make_optimizer, thread_invariant
from .aux import LocalLayer

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class BlockState:
    """Where a block's training is: resumable from ``state_dict``/``load_state_dict``."""

    layers: Sequence[LocalLayer]
    optimizers: list[torch.optim.Optimizer]
    epoch: int = 0  # epochs completed
    history: list[dict[str, Any]] = field(default_factory=list)
    amps: list[AmpPolicy] = field(default_factory=list)  # one per layer: each steps on its own loss

    @classmethod
    def create(cls, layers: Sequence[LocalLayer], cfg: TrainConfig) -> BlockState:
        device = module_device(layers[0]) if layers else torch.device("cpu")
        return cls(layers, [make_optimizer(list(m.parameters()), cfg) for m in layers],
                   amps=[AmpPolicy(cfg.precision, device) for _ in layers])

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "history": self.history,
            "layers": [m.state_dict() for m in self.layers],
            "optimizers": [o.state_dict() for o in self.optimizers],
            "amps": [a.state_dict() for a in self.amps],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for m, s in zip(self.layers, state["layers"], strict=True):
            m.load_state_dict(s)
        for o, s in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(s)
        for a, s in zip(self.amps, state.get("amps", []), strict=False):  # older checkpoints: fp32
            a.load_state_dict(s)
        self.epoch, self.history = int(state["epoch"]), list(state["history"])


def local_step(
    layers: Sequence[LocalLayer],
    optimizers: Sequence[torch.optim.Optimizer],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: nn.Module,
    amps: Sequence[AmpPolicy] | None = None,
) -> tuple[list[float], list[int]]:
    """One batch through the block: per layer (loss, correct predictions)."""
    losses, correct = [], []
    h = x
    amps = amps or [AmpPolicy("fp32", x.device) for _ in layers]
    for m, opt, amp in zip(layers, optimizers, amps, strict=True):
        with amp.autocast():
            out = m.layer(h)
            logits = m.head(out)
            loss = loss_fn(logits, y)
        opt.zero_grad(set_to_none=True)
        amp.step(loss, opt, list(m.parameters()), None)
        losses.append(loss.detach().item())
        correct.append(int((logits.detach().argmax(1) == y).sum()))
        h = out.detach()  # the next layer learns from this output; no gradient flows back
    return losses, correct


def _heads(layers: Sequence[LocalLayer], x: torch.Tensor, y: torch.Tensor | None,
           loss_fn: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's head logits, stacked (samples, layers, classes), and the sum of their losses
    (each layer fed the detached output of the one before)."""
    h, total, logits = x, None, []
    for m in layers:
        out = m.layer(h)
        logits.append(m.head(out))
        if loss_fn is not None:
            loss = loss_fn(logits[-1], y)
            total = loss if total is None else total + loss
        h = out.detach()
    return (total if total is not None else torch.zeros(())), torch.stack(logits, 1)


def micro_local_step(micro: MicroBatches, layers: Sequence[LocalLayer],
                     optimizers: Sequence[torch.optim.Optimizer], x: torch.Tensor, y: torch.Tensor,
                     loss_fn: nn.Module, amp: AmpPolicy) -> tuple[list[float], list[int]]:
    """:func:`local_step` in micro-batches, thread-invariant; per layer (loss, correct predictions)."""
    params = [p for m in layers for p in m.parameters()]
    _, logits = micro.gradients(x, y, params, lambda xi, yi: _heads(layers, xi, yi, loss_fn),
                                amp.autocast)
    losses, correct = [], []
    for i, opt in enumerate(optimizers):
        amp.apply(opt, list(layers[i].parameters()), None)
        with torch.no_grad():
            losses.append(float(loss_fn(logits[:, i].float(), y)))
        correct.append(int((logits[:, i].argmax(1) == y).sum()))
    return losses, correct


def evaluate_heads(layers: Sequence[LocalLayer], batches: Batches) -> list[float]:
    """Accuracy of every layer's auxiliary head (the exit after that layer)."""
    for m in layers:
        m.eval()
    correct, n = [0] * len(layers), 0
    device = module_device(layers[0]) if layers else torch.device("cpu")
    if thread_invariant(device) and layers:
        with MicroBatches(nn.ModuleList(layers), DEFAULT_MICRO_BATCH, compute_threads()) as micro:
            for x, y in to_device(batches, device):
                logits = micro.forward(x, AmpPolicy("fp32", device).autocast,
                                       lambda xi: _heads(layers, xi, None, None)[1])
                for i in range(len(layers)):
                    correct[i] += int((logits[:, i].argmax(1) == y).sum())
                n += len(y)
    else:
        with torch.no_grad():
            for x, y in to_device(batches, device):
                h = x
                for i, m in enumerate(layers):
                    h = m.layer(h)
                    correct[i] += int((m.head(h).argmax(1) == y).sum())
                n += len(y)
    if n == 0:
        raise DataError("evaluation batches yielded no samples (is the validation split empty?)")
    return [c / n for c in correct]


def train_block(
    state: BlockState,
    train_batches: Callable[[int], Batches],
    eval_batches: Callable[[], Batches] | None,
    cfg: TrainConfig,
    *,
    steps_per_epoch: int,
    layer_names: Sequence[str],
    on_epoch: Callable[[BlockState, dict[str, Any]], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> BlockState:
    """Train the block from ``state.epoch`` to ``cfg.epochs``; ``on_epoch`` can checkpoint ``state``."""
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    device = module_device(state.layers[0]) if state.layers else torch.device("cpu")
    if not state.amps:
        state.amps = [AmpPolicy(cfg.precision, device) for _ in state.layers]
    micro = None
    if thread_invariant(device) and state.layers:
        micro = MicroBatches(nn.ModuleList(state.layers), cfg.micro_batch, compute_threads())
    with micro if micro is not None else nullcontext():
        _train_epochs(state, micro, train_batches, eval_batches, cfg, loss_fn, device,
                      steps_per_epoch=steps_per_epoch, layer_names=layer_names, on_epoch=on_epoch,
                      progress=progress)
    return state


def _train_epochs(state: BlockState, micro: MicroBatches | None, train_batches: Callable[[int], Batches],
                  eval_batches: Callable[[], Batches] | None, cfg: TrainConfig, loss_fn: nn.Module,
                  device: torch.device, *, steps_per_epoch: int, layer_names: Sequence[str],
                  on_epoch: Callable[[BlockState, dict[str, Any]], None] | None,
                  progress: Callable[[int], None] | None) -> None:
    while state.epoch < cfg.epochs:
        epoch = state.epoch
        for m in state.layers:
            m.train()
        t0 = time.perf_counter()
        loss_sum = [0.0] * len(state.layers)
        correct = [0] * len(state.layers)
        samples = 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed * 1_000_003 + epoch)
            for step, (x, y) in enumerate(to_device(train_batches(epoch), device)):
                lr = cfg.lr_at(epoch + min(step / max(1, steps_per_epoch), 1.0))
                for opt in state.optimizers:
                    for group in opt.param_groups:
                        group["lr"] = lr
                if micro is not None:
                    losses, hits = micro_local_step(micro, state.layers, state.optimizers, x, y, loss_fn,
                                                    state.amps[0])
                else:
                    losses, hits = local_step(state.layers, state.optimizers, x, y, loss_fn, state.amps)
                for i, (loss, hit) in enumerate(zip(losses, hits, strict=True)):
                    if not math.isfinite(loss):
                        raise ModelError(
                            f"local training of {layer_names[i]} diverged: loss {loss} at epoch "
                            f"{epoch}, step {step} (lr {lr:.3g}); lower train.lr"
                        )
                    loss_sum[i] += loss * len(y)
                    correct[i] += hit
                samples += len(y)
                if progress is not None:
                    progress(len(y))
        if samples == 0:
            raise DataError(f"the training split yielded no batches at epoch {epoch}")
        record: dict[str, Any] = {
            "epoch": epoch,
            "epoch_seconds": time.perf_counter() - t0,
            "samples": samples,
            "train_loss": [s / samples for s in loss_sum],
            "train_acc": [c / samples for c in correct],
        }
        if eval_batches is not None:
            t1 = time.perf_counter()
            record["val_acc"] = evaluate_heads(state.layers, eval_batches())
            record["eval_seconds"] = time.perf_counter() - t1
        state.epoch += 1
        state.history.append(record)
        if on_epoch is not None:
            on_epoch(state, record)
