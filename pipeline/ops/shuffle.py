"""Window shuffle: randomness with bounded memory and sequential reads.

Samples are gathered into windows of ``window`` samples (e.g. a few storage chunks
read in shuffled chunk order) and emitted in a random permutation of each window.
Each sample is emitted exactly once per pass. A larger window is closer to a full
shuffle and costs more memory: that is the randomness-vs-sequentiality knob.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from ..lazy import lazy_module
from .batching import Batch, batch_size_of, concat, split_batch

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


def window_shuffle(batches: Iterable[Batch], window: int, *, seed: int, out_size: int) -> Iterator[Batch]:
    gen = torch.Generator().manual_seed(seed)
    pending: list[Batch] = []
    count = 0

    def flush() -> Iterator[Batch]:
        merged = concat(pending)
        order = torch.randperm(count, generator=gen)
        # index_select copies whole rows; v[order] indexes element by element, far slower on the
        # wide packed rows, and this runs at every epoch's first step.
        # Chunks held on a GPU (StoredStream's keep_on_device) are permuted there.
        on = {str(v.device) for v in merged.values()}
        orders = {d: order if d == "cpu" else order.to(d, non_blocking=True) for d in on}
        merged = {k: torch.index_select(v, 0, orders[str(v.device)]) for k, v in merged.items()}
        for start in range(0, count, out_size):
            yield split_batch(merged, start, min(start + out_size, count))

    for batch in batches:
        n = batch_size_of(batch)
        if n == 0:
            continue
        pending.append(batch)
        count += n
        if count >= window:
            yield from flush()
            pending, count = [], 0
    if count:
        yield from flush()
