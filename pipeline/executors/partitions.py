"""Cutting a cache build into partitions: contiguous, chunk-aligned sample ranges of one split.

Chunk alignment is what lets many processes write one zarr entry with no coordination:
every chunk file belongs to exactly one partition and is written whole, once, by it.

Batch alignment is what keeps the bytes equal to a local build's. torch's CPU
convolutions may round differently for a different batch composition (a sample can get
other float32 bits in a batch of another size), so a worker must form exactly the batches
a local build forms: it opens the stream at the batch boundary before its partition and
drops the lead-in samples.
Partitions that start on a batch boundary need no lead-in, so automatic partitioning
prefers them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..ops.cache_write import stream_batch_period

if TYPE_CHECKING:
    from ..recipe import Recipe

# Partitions per worker thread when the recipe does not say: enough that a slow or killed
# worker leaves little behind and the last few partitions balance, few enough that the
# per-partition cost (re-opening the upstream stream) stays small.
PARTITIONS_PER_THREAD = 4


@dataclass(frozen=True)
class Partition:
    """Chunks ``[first_chunk, stop_chunk)`` of ``split``: samples ``[start, stop)``."""

    split: str
    first_chunk: int
    stop_chunk: int
    chunk_samples: int
    split_samples: int

    @property
    def start(self) -> int:
        return self.first_chunk * self.chunk_samples

    @property
    def stop(self) -> int:
        return min(self.stop_chunk * self.chunk_samples, self.split_samples)

    @property
    def num_samples(self) -> int:
        return self.stop - self.start

    @property
    def num_chunks(self) -> int:
        return self.stop_chunk - self.first_chunk

    def describe(self) -> str:
        return f"{self.split}[{self.start}:{self.stop}] (chunks {self.first_chunk}..{self.stop_chunk - 1})"


def num_chunks(samples: int, chunk_samples: int) -> int:
    return -(-samples // chunk_samples)


def per_split(value: int | Mapping[str, int], split: str) -> int:
    """``value`` itself, or its entry for ``split`` when it is a mapping split -> int."""
    return int(value[split]) if isinstance(value, Mapping) else int(value)


def auto_partition_chunks(
    counts: Mapping[str, int], chunk_samples: int | Mapping[str, int], threads: int
) -> dict[str, int]:
    """Chunks per partition of each split, so the build makes about ``PARTITIONS_PER_THREAD`` x
    ``threads`` tasks of about the same number of samples (a build's work is per sample, and
    splits' chunks can differ several-fold in samples)."""
    target = sum(counts.values()) / (PARTITIONS_PER_THREAD * max(1, threads))
    return {split: max(1, math.ceil(target / per_split(chunk_samples, split))) for split in counts}


def plan_partitions(
    counts: Mapping[str, int],
    chunk_samples: int | Mapping[str, int],
    partition_chunks: int | Mapping[str, int],
) -> list[Partition]:
    """Every split (in ``counts`` order) cut into runs of ``partition_chunks`` chunks (none if empty).

    Either argument may be one value for every split or a mapping split -> value.
    """
    out = []
    for split, samples in counts.items():
        chunk, run = per_split(chunk_samples, split), per_split(partition_chunks, split)
        if chunk < 1 or run < 1:
            raise ValueError(f"chunk_samples and partition_chunks must be >= 1, got {chunk} and {run}")
        chunks = num_chunks(samples, chunk)
        for first in range(0, chunks, run):
            out.append(Partition(split, first, min(first + run, chunks), chunk, samples))
    return out


def batch_period(recipe: Recipe, input_name: str) -> int:
    """Samples after which the stream feeding the cache is back on a batch boundary
    (see :func:`pipeline.ops.cache_write.stream_batch_period`)."""
    return stream_batch_period(recipe.stages, input_name)


def align_partition_chunks(partition_chunks: int, chunk_samples: int, period: int) -> int:
    """``partition_chunks`` rounded up so that every partition starts on a batch boundary.

    Only when that at most doubles it; otherwise it is returned unchanged, and each
    partition then recomputes up to ``period - 1`` lead-in samples.
    """
    run = period // math.gcd(chunk_samples, period)  # chunks from one aligned start to the next
    if run > partition_chunks:
        return partition_chunks
    return -(-partition_chunks // run) * run
