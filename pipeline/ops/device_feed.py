"""Batches moved to the compute device a few batches ahead of the consumer.

On a GPU the data path is the bottleneck: a top's training step can take 2 ms, so a batch must
already be on the device when the step asks for it. :func:`to_device` issues each batch's
host-to-device copies on a side CUDA stream ``depth`` batches before the consumer takes it, from
page-locked (pinned) host memory with ``non_blocking=True``, so the copies run on the copy engine
while the consumer's kernels of earlier batches run on the compute stream. The consumer's stream
waits on the copy's event before it touches the batch (a wait on the GPU, not on the host), and
each tensor is marked as used on the consumer's stream so its memory is not reused while queued
kernels still read it.

Only the named ``keys`` move (features, codes, labels); the rest (sample ids, which seeded
augmentation reads on the host) stay where they are. On the CPU this is a pass-through.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ..device import pin
from ..lazy import lazy_module
from .batching import Batch

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


def pinned(batch: Batch, keys: Iterable[str] | None = None) -> Batch:
    """``batch`` with its CPU tensors (those in ``keys``, default all) in page-locked memory, so a
    ``non_blocking`` copy to a GPU is asynchronous. A no-op when no GPU is usable (pinning needs one)."""
    wanted = None if keys is None else set(keys)
    return {key: pin(value) if wanted is None or key in wanted else value for key, value in batch.items()}


def move_batch(batch: Batch, device: torch.device, keys: Iterable[str]) -> Batch:
    """``batch`` with the tensors named in ``keys`` on ``device`` (asynchronously from pinned memory)."""
    out = dict(batch)
    for key in keys:
        value = batch.get(key)
        if value is not None and value.device != device:
            out[key] = value.to(device, non_blocking=True)
    return out


def to_device(batches: Iterable[Batch], device: torch.device, keys: Iterable[str], *,
              depth: int = 2) -> Iterator[Batch]:
    """``batches`` with the tensors named in ``keys`` on ``device``, copied ``depth`` batches ahead.

    CPU device: the batches as they are. CUDA: each batch is pinned (unless already pinned, e.g.
    by a decode thread), copied on a side stream, and yielded once the consumer is ``depth``
    batches behind; the consumer's current stream is made to wait for that copy.
    """
    keys = tuple(keys)
    source = iter(batches)
    if device.type != "cuda":
        yield from source
        return
    if device.index is None:  # "cuda": the current CUDA device, named so tensors' devices compare equal
        device = torch.device("cuda", torch.cuda.current_device())
    copy_stream = torch.cuda.Stream(device)
    queued: deque[tuple[Batch, Any]] = deque()

    def issue(batch: Batch) -> None:
        host = pinned(batch, keys)  # host memory: nothing queued on the GPU writes it, no wait needed
        with torch.cuda.stream(copy_stream):
            moved = move_batch(host, device, keys)
            done = torch.cuda.Event()
            done.record(copy_stream)
        queued.append((moved, done))

    def take() -> Batch:
        moved, done = queued.popleft()
        consumer = torch.cuda.current_stream(device)
        consumer.wait_event(done)
        for key in keys:
            value = moved.get(key)
            if value is not None and value.is_cuda:
                value.record_stream(consumer)  # allocated on the copy stream, used on this one
        return moved

    try:
        for batch in source:
            issue(batch)
            if len(queued) > max(0, depth):
                yield take()
        while queued:
            yield take()
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
