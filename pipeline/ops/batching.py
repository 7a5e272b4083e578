"""Batching and re-chunking: change batch size mid-stream, never losing or duplicating a sample."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from ..lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


Batch = dict[str, "torch.Tensor"]


def batch_size_of(batch: Batch) -> int:
    sizes = {name: len(v) for name, v in batch.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch fields disagree on the number of samples: {sizes}")
    return next(iter(sizes.values()), 0)


def concat(batches: list[Batch]) -> Batch:
    if len(batches) == 1:
        return batches[0]
    keys = batches[0].keys()
    return {k: torch.cat([b[k] for b in batches]) for k in keys}


def split_batch(batch: Batch, start: int, stop: int) -> Batch:
    return {k: v[start:stop] for k, v in batch.items()}


def every_kth(batches: Iterable[Batch], k: int) -> Iterator[Batch]:
    """The samples at positions 0, k, 2k, ... of the stream: a subset spread over all of it, whatever
    order it keeps (class-sorted folders included), the same one every time it is read."""
    seen = 0
    for b in batches:
        n = batch_size_of(b)
        first, seen = (-seen) % k, seen + n
        if first < n:
            keep = torch.arange(first, n, k)
            yield {name: value[keep] for name, value in b.items()}


def rechunk(batches: Iterable[Batch], size: int, *, drop_last: bool = False) -> Iterator[Batch]:
    """Re-emit ``batches`` as batches of exactly ``size`` samples (the last may be short).

    Only an output batch that straddles two input batches is copied (one ``torch.cat``
    of exactly ``size`` samples); every other output is a slice view of its input
    batch. So when input sizes are multiples of ``size`` nothing is copied, and
    otherwise at most one output batch per input batch is: re-chunking runs on the
    trainer's critical path, where copying whole input batches (and the page faults
    of allocating them) is measurable.

    Memory: the pending remainder (fewer than ``size`` samples) holds views, so it
    keeps its input batches alive until it is emitted, but never more than ``size``
    of them.
    """
    if size < 1:
        raise ValueError(f"rechunk size must be >= 1, got {size}")
    pending: list[Batch] = []  # views, oldest first, together fewer than ``size`` samples
    count = 0
    for batch in batches:
        n = batch_size_of(batch)
        if n == 0:
            continue
        start = 0
        if pending:
            need = size - count
            if n < need:
                pending.append(batch)
                count += n
                continue
            yield concat([*pending, split_batch(batch, 0, need)])
            pending, count, start = [], 0, need
        while n - start >= size:
            yield batch if (start == 0 and n == size) else split_batch(batch, start, start + size)
            start += size
        if start < n:
            pending, count = [split_batch(batch, start, n)], n - start
    if count and not drop_last:
        yield concat(pending)


def xy(batches: Iterable[Batch]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) pairs from batches of fields: what the trainers consume."""
    for batch in batches:
        yield batch["x"], batch["y"]
