"""Batching and re-chunking: change batch size mid-stream, never losing or duplicating a sample."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Batch = dict[str, torch.Tensor]


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


def rechunk(batches: Iterable[Batch], size: int, *, drop_last: bool = False) -> Iterator[Batch]:
    """Re-emit ``batches`` as batches of exactly ``size`` samples (the last may be short).

    Memory is bounded by about two input batches plus one output batch: pending
    pieces are only concatenated when they add up to at least one output batch.
    """
    if size < 1:
        raise ValueError(f"rechunk size must be >= 1, got {size}")
    pending: list[Batch] = []
    count = 0
    for batch in batches:
        n = batch_size_of(batch)
        if n == 0:
            continue
        if not pending and n == size:  # common fast path: nothing to copy
            yield batch
            continue
        pending.append(batch)
        count += n
        if count < size:
            continue
        merged = concat(pending)
        start = 0
        while count - start >= size:
            yield split_batch(merged, start, start + size)
            start += size
        pending = [split_batch(merged, start, count)] if start < count else []
        count -= start
    if count and not drop_last:
        yield concat(pending)
