"""Streams: the re-iterable values flowing between stream stages.

A stream is opened per split and epoch; what order it yields samples in is its own
business (random access sources permute indices, stored streams shuffle chunk order
plus a window). Stream stages are lazy: building the graph does no work, pulling
batches does. Each stream times its own work, so a run can say where time went.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .ops.batching import Batch, batch_size_of
from .spec import Spec


@dataclass
class StreamStats:
    seconds: float = 0.0
    samples: int = 0
    batches: int = 0
    # Several opens of one stream can run at once on reader threads (a training epoch read
    # ahead while the validation split is evaluated): their updates must not be lost.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, seconds: float, samples: int = 0, batches: int = 1) -> None:
        with self._lock:
            self.seconds += seconds
            self.samples += samples
            self.batches += batches


class Stream:
    spec: Spec
    stats: StreamStats

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        """Batches of ``split``; ``start`` skips the first samples of the unshuffled order.

        ``start`` is how an interrupted cache build resumes (and a repair recomputes one
        chunk) without redoing upstream work for samples already stored: every stream
        passes it to its parent, and the stream that owns the samples skips them.
        """
        raise NotImplementedError

    def stored_bytes(self) -> int:
        """Bytes of stored entries this stream reads from (0 when computed on the fly)."""
        return 0

    def close(self) -> None:
        """Stop work this stream started ahead of being asked (a run calls it when done with it)."""

    def report(self) -> dict[str, Any]:
        """What the run's stage report records about this stream beyond its time (empty: nothing)."""
        return {}


def samples_from(stream: Stream, split: str, start: int, batch_period: int = 1) -> Iterator[Batch]:
    """Samples ``start`` on of ``split`` (unshuffled), batched as a pass from sample 0 batches them.

    How a resumed build, a Dask partition and a chunk repair pick up mid-split. ``batch_period``
    is the number of samples after which the stream's batches realign
    (``executors.partitions.batch_period``): the stream is opened at the batch boundary at or
    before ``start`` and the lead-in samples are computed again and dropped, because a frozen
    forward's last bits can depend on its batch's shape. Closing the iterator closes the stream's.
    """
    if batch_period < 1:
        raise ValueError(f"batch_period must be >= 1, got {batch_period}")
    return _trimmed(stream, split, start, start - start % batch_period)


def _trimmed(stream: Stream, split: str, start: int, opened_at: int) -> Iterator[Batch]:
    batches = stream.open(split, epoch=0, shuffle=False, start=opened_at)
    position = opened_at
    try:
        for batch in batches:
            n = batch_size_of(batch)
            skip = min(n, max(0, start - position))  # lead-in samples before ``start``
            position += n
            if skip < n:
                yield {k: v[skip:] for k, v in batch.items()} if skip else batch
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


BatchFn = Callable[[Batch, str, int, int], Batch]


class MapStream(Stream):
    """Applies ``fn(batch, split, epoch, seed)`` to every batch of ``parent`` (of the given splits)."""

    def __init__(
        self, parent: Stream, fn: BatchFn, spec: Spec, splits: tuple[str, ...] | None = None
    ) -> None:
        self.parent = parent
        self.fn = fn
        self.spec = spec
        self.splits = splits
        self.stats = StreamStats()

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        batches = self.parent.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start)
        if self.splits is not None and split not in self.splits:
            yield from batches
            return
        for batch in batches:
            t0 = time.perf_counter()
            out = self.fn(batch, split, epoch, seed)
            self.stats.add(time.perf_counter() - t0, batch_size_of(out))
            yield out

    def stored_bytes(self) -> int:
        return self.parent.stored_bytes()
