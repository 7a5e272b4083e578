"""The stream a grown cache entry is written from: stored rows of the samples it keeps, computed rows of
the new ones, in the new dataset's order.

Which rows are copied and which computed is decided before (:mod:`pipeline.growth`): per split, for
every position of the new split, the stored row holding that sample's content, or -1. The stored
entry is read chunk by chunk in its own order; kept samples keep their relative order when a dataset
grows (splits order samples by a draw from their content key, :mod:`pipeline.data.splits`), so the
reader only moves forward. A stored row's fields are copied as they are, except ``y`` and ``id``: the
label comes from the new dataset (a sample moved to another class folder keeps its features and takes
its new label) and the id is the sample's position in the new split, as a full build gives them.
The result is what a full build over the new dataset streams, sample for sample, so the cache
writes the same bytes (same layout, chunks and codec: those follow the new spec).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stores.entry import EntryReader, open_reader

from ..errors import StageError
from ..lazy import lazy_module
from ..spec import Spec
from ..stream import Stream, StreamStats
from .batching import Batch

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

# Fields a full build takes from the dataset, not from the sample's content.
FROM_DATASET = ("y", "id")
# Samples per batch handed to the cache writer (its chunking is its own, from the spec).
BATCH = 256


@dataclass(frozen=True)
class SplitDelta:
    """One split of a grown dataset against the stored entry: ``source[p]`` is the stored row that holds
    the sample at position ``p`` of the new split, or -1 where the sample is new; ``removed`` stored
    rows are not kept; ``relabelled`` kept samples have another label than the stored one."""

    source: np.ndarray
    removed: int
    relabelled: int = 0

    @property
    def new(self) -> int:
        return int((self.source < 0).sum())

    @property
    def reused(self) -> int:
        return len(self.source) - self.new


class ExtendedStream(Stream):
    """The new dataset's stream for the cache, from the entry at ``base`` and ``computed`` (the stages
    upstream run over the new samples only, in order). ``labels``: each split's labels in the new order.
    ``extends``: the stored entry's fingerprint, for logs and the cache stage (which builds it here,
    never on Dask workers: only the new samples are computed)."""

    def __init__(self, spec: Spec, base: Path, extends: str, deltas: Mapping[str, SplitDelta],
                 labels: Mapping[str, np.ndarray], computed: Stream) -> None:
        self.spec = spec
        self.base = base
        self.extends = extends
        self.deltas = dict(deltas)
        self.labels = dict(labels)
        self.computed = computed
        self.stats = StreamStats()

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        if shuffle:
            raise StageError("an extended entry's stream is written in order; it cannot be shuffled")
        delta = self.deltas[split]
        source, n = delta.source, len(delta.source)
        fields = self.spec.splits[split].fields
        copied = [name for name in fields if name not in FROM_DATASET]
        computed_rows = _Rows(self.computed, split, int((source[:start] < 0).sum()), copied)
        reader = open_reader(self.base) if (source >= 0).any() else None
        stored = _StoredRows(reader, split, copied) if reader is not None else None
        try:
            for a in range(start, n, BATCH):
                t0 = time.perf_counter()
                rows = source[a:a + BATCH]
                out = {name: np.empty((len(rows), *fields[name].shape), fields[name].dtype)
                       for name in copied}
                kept = rows >= 0
                if kept.any():
                    assert stored is not None  # a kept row exists, so the reader was opened
                    stored.fill(out, np.flatnonzero(kept), rows[kept])
                if not kept.all():
                    computed_rows.fill(out, np.flatnonzero(~kept))
                out["y"] = self.labels[split][a:a + len(rows)].astype(np.int64)
                out["id"] = np.arange(a, a + len(rows), dtype=np.int64)
                self.stats.add(time.perf_counter() - t0, len(rows))
                yield {name: torch.from_numpy(np.ascontiguousarray(out[name])) for name in fields}
        finally:
            computed_rows.close()
            if reader is not None:
                reader.close()

    def stored_bytes(self) -> int:
        return self.computed.stored_bytes()

    def close(self) -> None:
        self.computed.close()


class _StoredRows:
    """Rows of one split of a stored entry, read chunk by chunk as the positions move forward."""

    def __init__(self, reader: EntryReader, split: str, names: list[str]) -> None:
        self.reader, self.split, self.names = reader, split, names
        self.per_chunk = reader.chunk_samples(split)
        self.chunks: dict[int, dict[str, np.ndarray]] = {}

    def fill(self, out: dict[str, np.ndarray], at: np.ndarray, rows: np.ndarray) -> None:
        chunk_of = rows // self.per_chunk
        for index in np.unique(chunk_of):
            chunk = self._chunk(int(index))
            mine = chunk_of == index
            for name in self.names:
                out[name][at[mine]] = chunk[name][rows[mine] % self.per_chunk]

    def _chunk(self, index: int) -> dict[str, np.ndarray]:
        if index not in self.chunks:
            for old in [i for i in self.chunks if i < index]:  # kept rows only move forward
                del self.chunks[old]
            self.chunks[index] = self.reader.read_chunk(self.split, index)
        return self.chunks[index]


class _Rows:
    """The computed stream's rows of one split, taken in order as they are needed."""

    def __init__(self, stream: Stream, split: str, start: int, names: list[str]) -> None:
        self.stream, self.split, self.start, self.names = stream, split, start, names
        self.batches: Iterator[Batch] | None = None
        self.pending: dict[str, np.ndarray] = {}

    def fill(self, out: dict[str, np.ndarray], at: np.ndarray) -> None:
        need, done = len(at), 0
        while done < need:
            if not self.pending or len(next(iter(self.pending.values()))) == 0:
                self.pending = self._next()
            have = len(next(iter(self.pending.values())))
            take = min(have, need - done)
            for name in self.names:
                out[name][at[done:done + take]] = self.pending[name][:take]
            self.pending = {name: value[take:] for name, value in self.pending.items()}
            done += take

    def _next(self) -> dict[str, np.ndarray]:
        if self.batches is None:
            self.batches = self.stream.open(self.split, start=self.start)
        batch = next(self.batches, None)
        if batch is None:
            raise StageError(f"the stages upstream ended split {self.split!r} before every new sample was "
                             "computed (the stored entry and the dataset disagree on what is new)")
        return {name: _host(batch[name]) for name in self.names}

    def close(self) -> None:
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()


def _host(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
