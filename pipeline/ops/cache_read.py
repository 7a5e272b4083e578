"""The cache operator's read path: a committed entry read back as a stream, prefetched and shuffled.

Reading yields whole chunks (large, sequential reads for slow storage), prefetched in the
background; for training, the chunk order is shuffled each epoch and samples are shuffled
within a window of chunks. The entry's backend is found by :func:`stores.entry.open_reader`,
and only the :class:`stores.entry.EntryReader` protocol is used here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stores.entry import EntryReader, open_reader

from ..lazy import lazy_module
from ..spec import spec_from_json
from ..stream import Stream, StreamStats
from .batching import Batch
from .cache_write import SPEC_ATTR
from .device_feed import move_batch, pinned
from .prefetch import StartedPrefetch, prefetch
from .shuffle import window_shuffle

if TYPE_CHECKING:
    import torch

    from stores.throttle import ThrottleDevice
else:
    torch = lazy_module("torch")

# Bytes an encoded chunk may exceed its decoded size by (frame headers, crc32c), per chunk.
_ENCODED_SLACK = 4096


def open_entry_reader(entry_dir: Path, *, throttle: str | None = None) -> EntryReader:
    """The reader for a committed cache entry, whichever backend wrote it (``stores.entry.open_reader``)."""
    return open_reader(entry_dir, throttle=throttle)


class _Held(int):
    """A chunk index whose decoded chunk is held in memory: passed on by the fetch stage, not read."""


def _fetch_chunks(
    reader: EntryReader, split: str, order: np.ndarray, held: dict[int, Batch] | None = None
) -> Iterator[tuple[Any, float]]:
    """The encoded bytes of each chunk of ``split`` in ``order``, with the seconds each read took
    (a chunk in ``held`` is not read: its index is passed on as a :class:`_Held`)."""
    for index in order:
        if held is not None and int(index) in held:
            yield _Held(index), 0.0
            continue
        t0 = time.perf_counter()
        raw = reader.fetch_chunk(split, int(index))
        yield raw, time.perf_counter() - t0


def _decode_chunks(
    reader: EntryReader,
    stats: StreamStats,
    fetched: Iterator[tuple[Any, float]],
    held: dict[int, Batch] | None = None,
) -> Iterator[Batch]:
    """Fetched chunks checked, decompressed and turned into tensors (held ones taken from ``held``)."""
    try:
        for raw, fetch_s in fetched:
            t0 = time.perf_counter()
            if isinstance(raw, _Held):
                batch = held[raw]  # type: ignore[index]
            else:
                arrays = reader.decode_chunk(raw)
                del raw  # the encoded bytes are not held while this batch waits in the queue
                batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
            stats.add(fetch_s + time.perf_counter() - t0, len(next(iter(batch.values()))))
            yield batch
    finally:
        # Stop the fetch thread now: a decode error's traceback (kept by the caller) would
        # otherwise keep the fetch stage alive, blocked on its full queue.
        close = getattr(fetched, "close", None)
        if close is not None:
            close()


def _keeping(chunks: Iterator[Batch], order: np.ndarray, held: dict[int, Batch],
             device: torch.device | None = None) -> Iterator[Batch]:
    """``chunks`` (read in ``order``), each also put in ``held`` under its chunk index as it passes;
    with a ``device``, moved there first (all but the sample ids) and held there."""
    try:
        for index, batch in zip(order, chunks, strict=True):
            if device is not None:
                keys = [k for k in batch if k != "id"]
                # On the reader's thread: pinned, then copied on the device's default stream, which
                # orders it before any kernel the consumer queues on that batch.
                batch = move_batch(pinned(batch, keys), device, keys)
            held[int(index)] = batch
            yield batch
    finally:
        chunks.close()  # type: ignore[attr-defined]  # stops the fetch thread with this generator


class StoredStream(Stream):
    """A committed cache entry read as a stream.

    Reads are whole chunks (large and sequential, what SD cards and eMMC do well), run
    ahead of the consumer in two stages on two threads, so storage, decompression and
    compute overlap and an epoch takes about max(I/O, decode, compute), not their sum:

    - **fetch**: the encoded bytes of the next chunk of every array (the only stage that
      touches storage, so a slow card is kept busy back to back);
    - **decode**: crc32c check, decompression, bytes -> tensors.

    Each stage hands over through a bounded queue. ``prefetch_depth`` (capped by
    ``prefetch_max_bytes``) is the number of chunks queued across both stages: half of
    it (rounded down) for fetched chunks, the rest for decoded ones; with a depth of 1,
    or for HDF5 entries (h5py reads and decodes a chunk in one call), one thread does
    both. Memory held by the reader is bounded by :meth:`memory_bound`: the queued
    chunks, one chunk in flight in each thread and in the consumer, plus the shuffle
    window of ``window_chunks`` chunks on training passes. ``prefetch_max_bytes`` counts
    every queued chunk, fetched or decoded, at its decoded size: zstd/blosc store
    incompressible blocks raw, so an encoded chunk is at most frame headers and a
    checksum larger (``_ENCODED_SLACK``, which :meth:`memory_bound` adds).

    A shuffled (training) pass that is read to its end **reads on into the next epoch**:
    once its last chunk is read, the next epoch's reading starts, so that epoch's first
    chunks are read while this one's last batches train and the model is evaluated,
    instead of after the trainer asks for its first batch (on slow storage, the wait for
    a shuffle window to fill). Only one reader runs at a time (this epoch's has finished),
    so the bound above holds. The next ``open`` of that split takes it over if it asks for
    that epoch with that seed; any other open of the split, :meth:`close` or dropping the
    stream stops it (a wrong guess costs at most the read-ahead's few chunks).

    **Small splits stay in memory.** A split whose decoded chunks fit in ``keep_in_memory_bytes``
    (still quantized and bit-packed: a 2-bit cache is 16x smaller than its float32 features) keeps
    each chunk once it has been read, checked and decompressed, so no chunk of it is read twice;
    when every chunk a pass needs is held, the pass starts no thread either. Re-reading them every
    epoch costs CPU time, not just I/O (the file is in the page cache after the first epoch, but
    each chunk is still crc32c-checked and zstd-decompressed again, on the cores training runs
    on). Splits are admitted train first,
    then val, then the rest, each if it fits in what the others left of the budget; 0 keeps
    nothing. The held batches are shared by every later pass, so consumers must not modify a batch
    in place (no stage of the toolkit does: each makes new tensors).

    **On a GPU, splits stay in device memory.** With a CUDA ``device``, splits whose stored chunks
    fit in ``keep_on_device_bytes`` (admitted as above: train, then val) are copied to the device as
    their chunks are first read, and held there instead of in host memory: from the second epoch on,
    their passes read, decompress and copy nothing, and the window shuffle permutes them on the
    device. Sample ids stay on the host (seeded feature augmentation reads them there).
    """

    def __init__(
        self,
        path: Path,
        *,
        size_bytes: int = 0,
        prefetch_depth: int = 2,
        window_chunks: int = 4,
        throttle: str | None = None,
        hold: Any = None,
        prefetch_max_bytes: int | None = None,
        keep_in_memory_bytes: int = 0,
        device: torch.device | None = None,
        keep_on_device_bytes: int = 0,
    ) -> None:
        self.path = Path(path)
        self.prefetch_max_bytes = prefetch_max_bytes
        self.reader = open_entry_reader(self.path, throttle=throttle)
        # A catalog "in use" handle: while this stream exists the entry cannot be evicted.
        self.hold = hold
        self.spec = spec_from_json(self.reader.attrs[SPEC_ATTR])
        self.size_bytes = size_bytes
        self.prefetch_depth = prefetch_depth
        self.window_chunks = window_chunks
        self.stats = StreamStats()
        # split -> (seed, epoch, its chunks already being read): see "reads on" above.
        self._read_on: dict[str, tuple[int, int, StartedPrefetch[Batch]]] = {}
        self._read_on_lock = threading.Lock()
        self.keep_in_memory_bytes = keep_in_memory_bytes
        self.device = device if device is not None and device.type == "cuda" else None
        if self.device is not None and self.device.index is None:  # the current CUDA device, by index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.keep_on_device_bytes = keep_on_device_bytes if self.device is not None else 0
        # Splits held in GPU memory (filled as they are read); the others may be held in host memory.
        self._on_device = set(self._splits_kept(self.keep_on_device_bytes))
        kept = self._on_device | set(self._splits_kept(self.keep_in_memory_bytes, skip=self._on_device))
        # split -> chunk index -> decoded chunk, for the splits kept in memory (filled as they are read)
        self._held: dict[str, dict[int, Batch]] = {split: {} for split in kept}

    def split_bytes(self, split: str) -> int:
        """Decoded bytes of all of ``split``: what keeping it in memory holds."""
        s = self.spec.splits[split]
        return s.num_samples * s.sample_bytes()

    def _splits_kept(
        self, budget: int | None = None, skip: set[str] | frozenset[str] = frozenset()
    ) -> list[str]:
        """The splits a memory budget (default ``keep_in_memory_bytes``) keeps: train, then val, then the
        rest, each if it still fits."""
        kept, room = [], self.keep_in_memory_bytes if budget is None else budget
        for split in sorted(self.spec.splits, key=lambda name: (name != "train", name != "val")):
            if split in skip:
                continue
            size = self.split_bytes(split)
            if 0 < size <= room:
                kept.append(split)
                room -= size
        return kept

    def in_memory(self, split: str) -> bool:
        """True once every chunk of ``split`` is held in memory: its passes read nothing."""
        held = self._held.get(split)
        return held is not None and len(held) == self.reader.num_chunks(split)

    def on_device(self, split: str) -> bool:
        """True when ``split`` is held in GPU memory (once read) rather than host memory."""
        return split in self._on_device

    def held_bytes(self) -> int:
        """Host bytes the splits kept in memory hold once read (0 when ``keep_in_memory_bytes`` admits
        none; splits held on a GPU are not counted)."""
        return sum(self.split_bytes(split) for split in self._held if split not in self._on_device)

    def device_bytes(self) -> int:
        """GPU bytes the splits kept on the device hold once read."""
        return sum(self.split_bytes(split) for split in self._on_device)

    def stored_bytes(self) -> int:
        return self.size_bytes

    @property
    def throttle_device(self) -> ThrottleDevice | None:
        """The simulated device reads go through (its ``stats()``), or None when not throttled."""
        return self.reader.device

    def chunk_bytes(self, split: str) -> int:
        """Decoded bytes of one chunk of ``split``: the unit of read-ahead memory."""
        return self.reader.chunk_samples(split) * self.spec.splits[split].sample_bytes()

    def read_ahead(self, split: str) -> int:
        """Chunks queued ahead of the consumer: the depth, capped by the byte budget (at least 1)."""
        if self.prefetch_max_bytes is None or self.prefetch_depth == 0:
            return self.prefetch_depth
        return max(1, min(self.prefetch_depth, self.prefetch_max_bytes // max(1, self.chunk_bytes(split))))

    def stage_depths(self, split: str) -> tuple[int, int]:
        """(fetched, decoded): queue lengths of the two read-ahead stages; fetched 0 = one stage."""
        total = self.read_ahead(split)
        if total <= 1 or not self.reader.separate_decode:
            return 0, total
        return total // 2, total - total // 2

    def memory_bound(self, split: str, *, shuffle: bool = True) -> int:
        """Bytes of chunk data the reader holds at most while reading ``split`` (see the class docstring).

        Queued chunks plus one in flight per thread (fetch: one encoded; decode: one encoded
        and one decoded; single stage: one decoded) plus one held by the consumer, plus the
        shuffle window on shuffled passes, plus the splits kept in memory (:meth:`held_bytes`).
        Python/torch object overheads are the small constant on top that the benchmark reports.
        """
        per = self.chunk_bytes(split) + _ENCODED_SLACK
        fetched, decoded = self.stage_depths(split)
        in_flight = (3 if fetched else 1 if decoded else 0) + 1
        window = self.window_chunks * self.chunk_bytes(split) if shuffle else 0
        return (fetched + decoded + in_flight) * per + window + self.held_bytes()

    def _chunks(self, split: str, order: np.ndarray, *, start_now: bool = False) -> Iterator[Batch]:
        """Decoded chunks in ``order``, read ahead by the fetch and decode threads (started now if asked);
        straight from memory when the split is held there."""
        held = self._held.get(split)
        # Module-level generators: the reader threads hold the reader, never this stream, so a
        # stream nobody uses any more is collected and its __del__ stops a pending read-on.
        raw: Iterator[tuple[Any, float]] = _fetch_chunks(self.reader, split, order, held)
        if held is not None and all(int(index) in held for index in order):
            return _decode_chunks(self.reader, self.stats, raw, held)  # nothing to read: no thread
        fetched, decoded = self.stage_depths(split)
        if fetched:
            raw = prefetch(raw, fetched, name=f"fetch-{split}")
        chunks = _decode_chunks(self.reader, self.stats, raw, held)
        if held is not None:
            chunks = _keeping(chunks, order, held, self.device if split in self._on_device else None)
        if start_now:
            return StartedPrefetch(chunks, decoded, name=f"decode-{split}")
        return prefetch(chunks, decoded, name=f"decode-{split}")

    def _shuffled_order(self, split: str, seed: int, epoch: int) -> np.ndarray:
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        return torch.randperm(self.reader.num_chunks(split), generator=gen).numpy()

    def _take_read_on(
        self, split: str, seed: int | None = None, epoch: int | None = None
    ) -> StartedPrefetch[Batch] | None:
        """The read-on of ``split`` if it reads ``epoch`` with ``seed`` (else None); any other is stopped."""
        with self._read_on_lock:
            ahead = self._read_on.pop(split, None)
        if ahead is None:
            return None
        if ahead[:2] == (seed, epoch):
            return ahead[2]
        ahead[2].close()
        return None

    def _epoch_chunks(self, split: str, seed: int, epoch: int) -> Iterator[Batch]:
        """A shuffled epoch's chunks (taken over from the read-on when it is this epoch's); read
        to the end, they start the next epoch's reading."""
        ahead = self._take_read_on(split, seed, epoch)
        chunks: Iterator[Batch] = (
            ahead if ahead is not None else self._chunks(split, self._shuffled_order(split, seed, epoch))
        )
        try:
            yield from chunks
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        # Only reached when the epoch was read to its end (an abandoned one raised GeneratorExit above).
        if self.read_ahead(split) > 0 and not self.in_memory(split):
            following = self._chunks(split, self._shuffled_order(split, seed, epoch + 1), start_now=True)
            with self._read_on_lock:
                stale = self._read_on.pop(split, None)
                self._read_on[split] = (seed, epoch + 1, following)  # type: ignore[assignment]
            if stale is not None:
                stale[2].close()

    def close(self) -> None:
        """Stop any reading on into a next epoch (the epoch may never be asked for)."""
        with self._read_on_lock:
            pending = list(self._read_on.values())
            self._read_on.clear()
        for *_, chunks in pending:
            chunks.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the daemon threads go with the process
            pass

    def open(
        self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0, start: int = 0
    ) -> Iterator[Batch]:
        self.spec.split(split, stage=str(self.path))
        n_chunks = self.reader.num_chunks(split)
        if shuffle:
            if start:
                raise ValueError("start (resume) is only defined for the unshuffled order")
            chunks = self._epoch_chunks(split, seed, epoch)
        else:
            self._take_read_on(split)  # an unshuffled pass of the split: not the epoch read ahead
            per = self.reader.chunk_samples(split)
            chunks = self._chunks(split, np.arange(start // per, n_chunks))
        if not shuffle:
            skip = start % self.reader.chunk_samples(split)
            for batch in chunks:
                if skip:
                    batch = {k: v[skip:] for k, v in batch.items()}
                    skip = 0
                yield batch
            return
        per_chunk = max(1, self.spec.splits[split].num_samples // max(1, n_chunks))
        yield from window_shuffle(
            chunks, self.window_chunks * per_chunk, seed=seed * 7919 + epoch, out_size=per_chunk
        )
