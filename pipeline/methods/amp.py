"""Training on a device: the precision policy (autocast, gradient scaling) and batches from the host.

Every trainer (the epoch loop, NeuroFlux's local learning, the memory meter) takes these from
here, so CPU and CUDA share one code path that differs only where the hardware does:

- **precision**: ``fp32``; ``bf16`` autocast (CPU and CUDA: matmuls and convolutions in bf16,
  reductions and the loss in fp32, fp32 master weights and optimizer state); ``fp16`` autocast
  with a ``torch.amp.GradScaler`` (CUDA only: fp16's 5-bit exponent underflows small gradients
  unless the loss is scaled, and CPU autocast has no fast fp16 kernels to pay for that).
- **batches from the host** go to a CUDA device from pinned (page-locked) memory with
  ``non_blocking=True``, so the copy overlaps the previous step's kernels; pinning happens on the
  producer's thread when there is one (``pinned``), or just before the copy.

Running out of memory becomes :func:`pipeline.device.out_of_memory`'s error, shared with the cache build.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

from ..device import pin
from ..errors import StageError
from ..lazy import lazy_module
from ..ops.device_feed import to_device as feed_to_device

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
Pair = tuple["torch.Tensor", "torch.Tensor"]
# (inputs, labels) where the inputs may be a dict of tensors a step decodes itself (graphed steps)
AnyPair = tuple[Any, "torch.Tensor"]


def check_precision(precision: str, device: torch.device | str, *, where: str = "train.precision") -> None:
    """Raise a StageError when ``precision`` cannot run on ``device`` (checked before any work)."""
    device = torch.device(device)
    if precision not in PRECISIONS:
        raise StageError(f"{where}: {precision!r} is not a precision; expected one of "
                         f"{', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type != "cuda":
        raise StageError(
            f"{where}: fp16 needs a CUDA device (autocast with a gradient scaler), but run.device is "
            f"{device}; use bf16 on a CPU (same memory per value, fp32's exponent range) or fp32"
        )


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


class AmpPolicy:
    """How one training loop runs its forward and its optimizer step at a precision on a device.

    ``autocast()`` wraps the forward and the loss of one step (entered per step, so autocast's
    cache of low-precision weight copies never outlives an optimizer step); ``step()`` does the
    backward, optional gradient clipping and the optimizer step, through the gradient scaler for
    fp16. The scaler's state is part of a resumable checkpoint (``state_dict``).
    """

    def __init__(self, precision: str, device: torch.device | str) -> None:
        self.device = torch.device(device)
        check_precision(precision, self.device)
        self.precision = precision
        self.dtype = autocast_dtype(precision)
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        )

    def autocast(self, *, cache: bool = True) -> AbstractContextManager[Any]:
        """Autocast at the precision; ``cache=False`` for a step captured as a CUDA graph, where a cached
        low-precision copy of a weight would be captured stale."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=cache)

    def step(self, loss: torch.Tensor, opt: torch.optim.Optimizer, params: list[nn.Parameter],
             grad_clip: float | None) -> None:
        if self.scaler is None:
            loss.backward()
            if grad_clip is not None:
                nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            return
        self.scaler.scale(loss).backward()
        if grad_clip is not None:
            self.scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(params, grad_clip)
        self.scaler.step(opt)  # skipped (and the scale lowered) when a gradient overflowed
        self.scaler.update()

    def apply(self, opt: torch.optim.Optimizer, params: list[nn.Parameter], grad_clip: float | None) -> None:
        """The optimizer step for gradients already in ``.grad`` (computed elsewhere: micro-batches)."""
        if self.scaler is not None:
            raise StageError("fp16's gradient scaler scales the loss before the backward; a step from "
                             "gradients computed elsewhere cannot use it (use bf16 or fp32)")
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "scaler": self.scaler.state_dict() if self.scaler else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("precision") != self.precision:
            raise ValueError(f"checkpoint trained at {state.get('precision')}, this run at {self.precision}")
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


# ---------------------------------------------------------------------------------------- batches
def pinned(batches: Iterable[AnyPair], device: torch.device | str) -> Iterator[AnyPair]:
    """``batches`` with host tensors page-locked when they are bound for CUDA (run it on the producer
    thread: pinning copies the batch once, off the training loop). Unchanged for a CPU device.
    ``x`` may be a dict of tensors (stored codes a step decodes itself): each is pinned."""
    if torch.device(device).type != "cuda":
        yield from batches
        return
    for x, y in batches:
        yield ({k: pin(v) for k, v in x.items()} if isinstance(x, dict) else pin(x)), pin(y)


def to_device(batches: Iterable[AnyPair], device: torch.device | str) -> Iterator[AnyPair]:
    """``(x, y)`` on ``device``, labels as int64. To a GPU through
    :func:`pipeline.ops.device_feed.to_device`: copied from pinned memory on a side stream a couple of
    batches ahead of the step. ``x`` may be a dict of tensors, each moved alike."""
    device = torch.device(device)
    if device.type != "cuda":
        for x, y in batches:
            if isinstance(x, dict):
                yield {k: v.to(device) for k, v in x.items()}, y.to(device).long()
            else:
                yield x.to(device), y.to(device).long()
        return
    pairs = iter(batches)
    head = next(pairs, None)
    if head is None:
        return
    if all(t.device == device or (device.index is None and t.is_cuda) for t in _tensors_of(head)):
        # Already on the device (a stream that feeds its batches there, e.g. resident stored codes):
        # no copy stream, no events.
        for x, y in itertools.chain([head], pairs):
            yield x, y.long()
        return
    def flat(pair: AnyPair) -> dict[str, Any]:
        x, y = pair
        parts = {f"x.{k}": v for k, v in x.items()} if isinstance(x, dict) else {"x": x}
        return {**parts, "y": y}

    keys = list(flat(head))  # the fields to move, named before the feed starts (it reads them once)
    source = (flat(pair) for pair in itertools.chain([head], pairs))
    for batch in feed_to_device(source, device, keys):
        y = batch.pop("y").long()
        if "x" in batch:
            yield batch["x"], y
        else:
            yield {k[2:]: v for k, v in batch.items() if k.startswith("x.")}, y


def _tensors_of(pair: AnyPair) -> list[torch.Tensor]:
    x, y = pair
    return [*(x.values() if isinstance(x, dict) else [x]), y]


def module_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
