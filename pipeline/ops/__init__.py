"""Generic stream operators every stage and method uses.

A stream is an iterator of batches: ``dict[str, torch.Tensor]`` whose values share
their first (sample) axis. Each operator keeps every sample exactly once, in order,
unless its job is to reorder (``shuffle``).
"""

from .batching import Batch, batch_size_of, concat, rechunk, split_batch
from .prefetch import EpochPrefetch, prefetch
from .shuffle import window_shuffle

__all__ = [
    "Batch",
    "EpochPrefetch",
    "batch_size_of",
    "concat",
    "rechunk",
    "split_batch",
    "prefetch",
    "window_shuffle",
]
