"""The cache operator: write a stream through to a store entry, and read it back.

Writing pulls the upstream stream split by split in sample order and hands batches
to a background writer thread, so compression and disk writes overlap the frozen
forward. Reading yields whole chunks (large, sequential reads for slow storage),
prefetched in the background; for training, the chunk order is shuffled each epoch
and samples are shuffled within a window of chunks.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stores.layout import ArraySpec

from ..lazy import lazy_module
from ..spec import Spec, spec_from_json, spec_to_json
from ..stream import Stream, StreamStats, samples_from
from .batching import Batch
from .prefetch import StartedPrefetch, prefetch
from .shuffle import window_shuffle

if TYPE_CHECKING:
    import torch

    from stores import h5_entry, zarr_entry
    from stores import throttle as throttling
else:
    torch = lazy_module("torch")
    h5_entry = lazy_module("stores.h5_entry")
    throttling = lazy_module("stores.throttle")
    zarr_entry = lazy_module("stores.zarr_entry")

SPEC_ATTR = "pipeline_spec"
# Bytes an encoded chunk may exceed its decoded size by (frame headers, crc32c), per chunk.
_ENCODED_SLACK = 4096


def chunk_samples_for(spec: Spec, chunk_bytes: int) -> int:
    """Samples per chunk so the largest split's chunks are about ``chunk_bytes`` (one length for all).

    The HDF5 layout (one chunk length per file); zarr entries use :func:`chunk_samples_per_split`.
    """
    per_sample = max(s.sample_bytes() for s in spec.splits.values()) or 1
    most = max(s.num_samples for s in spec.splits.values()) or 1
    return int(max(1, min(most, chunk_bytes // per_sample)))


def chunk_samples_per_split(spec: Spec, chunk_bytes: int) -> dict[str, int]:
    """Samples per chunk of each split, so each split's chunks are about ``chunk_bytes`` of its own samples.

    A 2-bit train split next to float16 eval splits has ~6x smaller samples: sized by the
    largest split, its chunks would be ~1/6 of ``chunk_bytes`` and an epoch would pay the
    per-chunk costs (one file per array, a crc32c, a decompressor call, a queue hand-over)
    ~6x as often. Capped by the split's own sample count (at least 1).
    """
    return {
        name: int(max(1, min(s.num_samples or 1, chunk_bytes // (s.sample_bytes() or 1))))
        for name, s in spec.splits.items()
    }


class _BackgroundWriter:
    """Runs ``writer.write`` on a thread with a bounded queue; errors surface on the caller.

    The writer comes from ``open_writer``, called on that thread first: creating a fresh
    entry's files then overlaps computing its first batch. ``writer`` is valid after
    :meth:`finish` returned without an error.
    """

    def __init__(self, open_writer: Callable[[], Any], depth: int = 4) -> None:
        self.open_writer = open_writer
        self.writer: Any = None
        self.q: queue.Queue[tuple[str, int, dict[str, np.ndarray]] | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._work, name="cache-writer", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            self.writer = self.open_writer()
        except BaseException as exc:  # reported by put()/finish(); the queue is still drained
            self.error = exc
        while (item := self.q.get()) is not None:
            if self.error is None:
                group, start, arrays = item
                try:
                    if hasattr(self.writer, "write_at"):
                        self.writer.write_at(group, start, arrays)
                    else:
                        self.writer.write(group, arrays)
                except BaseException as exc:  # reported by put()/finish()
                    self.error = exc

    def put(self, group: str, start: int, arrays: dict[str, np.ndarray]) -> None:
        if self.error is not None:
            raise self.error
        self.q.put((group, start, arrays))

    def finish(self) -> None:
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


ZARR_DIR, H5_FILE = "data.zarr", "entry.h5"


def write_stream(
    stream: Stream,
    entry_dir: Path,
    *,
    chunk_bytes: int,
    compressor: str,
    level: int,
    attrs: dict[str, Any],
    fmt: str = "zarr",
    progress: Any = None,
    log: Any = None,
    batch_period: int = 1,
) -> dict[str, Any]:
    """Write every split of ``stream`` into ``entry_dir`` (zarr v3 ``data.zarr`` or HDF5 ``entry.h5``).

    Both backends resume: chunks a killed or interrupted build already wrote (and that
    still verify) are kept, and the stream is reopened near the first missing sample, so
    upstream work (decode, frozen forward) is not redone for them. The result is
    bit-identical to an uninterrupted build because chunks are a pure function of the
    samples and the codec, written in one canonical order (for HDF5 the kept chunks are
    copied, still compressed, into a fresh file: see :mod:`stores.h5_entry`), and because
    the stream is reopened on a batch boundary (``batch_period``, see
    :func:`pipeline.stream.samples_from`), so a resume forms the batches an uninterrupted
    build formed.
    """
    spec = stream.spec
    # zarr: each split's chunks sized for its own samples; HDF5: one chunk length (H5Writer's layout).
    chunk: int | dict[str, int] = (
        chunk_samples_for(spec, chunk_bytes) if fmt == "hdf5" else chunk_samples_per_split(spec, chunk_bytes)
    )
    arrays = {
        f"{split}/{name}": ArraySpec(tuple(f.shape), f.dtype)
        for split, s in spec.splits.items()
        for name, f in s.fields.items()
    }
    counts = {split: s.num_samples for split, s in spec.splits.items()}
    attrs = {**attrs, SPEC_ATTR: spec_to_json(spec)}

    def open_writer() -> Any:
        if fmt == "hdf5":
            # Resumes from the rows its progress log records and that still match their crc32
            # (see stores.h5_entry); anything else is discarded with a message.
            h5 = h5_entry.H5Writer(
                entry_dir / H5_FILE, arrays, counts, chunk, attrs, compressor=compressor, level=level,
                resume=True,
            )
            if h5.restart_reason is not None and log is not None:
                log(f"could not resume the interrupted HDF5 build ({h5.restart_reason}); starting over")
            return h5
        # "wipe": a leftover written with other chunking/codec settings is rebuilt, never mixed in.
        return zarr_entry.ZarrWriter(
            entry_dir / ZARR_DIR,
            arrays,
            counts,
            chunk,
            attrs,
            compressor=compressor,
            level=level,
            resume=True,
            on_mismatch="wipe",
        )

    if fmt != "hdf5" and not (entry_dir / ZARR_DIR).exists():
        # Nothing to resume: the writer creates the entry's files on its own thread (~15 ms of
        # metadata writes and fsyncs) while the first batch is decoded and forwarded.
        done = dict.fromkeys(spec.splits, 0)
        background = _BackgroundWriter(open_writer)
    else:
        writer = open_writer()
        done = {split: writer.resume_samples(split) for split in spec.splits}
        if any(done.values()) and log is not None:
            kept = ", ".join(f"{split} {n}/{counts[split]}" for split, n in done.items())
            log(f"resuming an interrupted build: kept verified chunks ({kept} samples)")
        background = _BackgroundWriter(lambda: writer)
    if progress is not None:
        progress.update(sum(done.values()))
    try:
        for split in spec.splits:
            if done[split] >= counts[split]:
                continue
            position = done[split]  # the first sample not stored yet
            for batch in samples_from(stream, split, position, batch_period):
                n = len(next(iter(batch.values())))
                background.put(split, position, {k: v.detach().cpu().numpy() for k, v in batch.items()})
                position += n
                if progress is not None:
                    progress.update(n)
    finally:
        background.finish()
    background.writer.close()
    return {
        "chunk_samples": chunk,
        "compressor": compressor,
        "level": level,
        "format": fmt,
        "resumed_samples": sum(done.values()),
    }


def open_entry_reader(entry_dir: Path, *, throttle: str | None = None) -> Any:
    """The reader for a committed cache entry, whichever backend wrote it.

    ``throttle`` names a slow-storage profile (``sdcard``, ``emmc``, ``ssd``) to read
    through the simulator: for benchmarks and tests of prefetching, never for real runs.
    """
    if (entry_dir / H5_FILE).is_file():
        return h5_entry.H5Reader(entry_dir / H5_FILE, throttle=throttle)
    store = None
    if throttle is not None:
        store = throttling.ThrottledZarrStore(entry_dir / ZARR_DIR, throttle, read_only=True)
    return zarr_entry.ZarrReader(entry_dir / ZARR_DIR, zarr_store=store)


class _Held(int):
    """A chunk index whose decoded chunk is held in memory: passed on by the fetch stage, not read."""


def _fetch_chunks(
    reader: Any, split: str, order: np.ndarray, held: dict[int, Batch] | None = None
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
    reader: Any,
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


def _keeping(chunks: Iterator[Batch], order: np.ndarray, held: dict[int, Batch]) -> Iterator[Batch]:
    """``chunks`` (read in ``order``), each also put in ``held`` under its chunk index as it passes."""
    try:
        for index, batch in zip(order, chunks, strict=True):
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
    each chunk is still crc32c-checked and zstd-decompressed again: 1.0 ms of CPU per chunk of 134
    samples of 2-bit 320x7x7 maps, on the cores training runs on). Splits are admitted train first,
    then val, then the rest, each if it fits in what the others left of the budget; 0 keeps
    nothing. The held batches are shared by every later pass, so consumers must not modify a batch
    in place (no stage of the toolkit does: each makes new tensors).
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
        # split -> chunk index -> decoded chunk, for the splits kept in memory (filled as they are read)
        self._held: dict[str, dict[int, Batch]] = {split: {} for split in self._splits_kept()}

    def split_bytes(self, split: str) -> int:
        """Decoded bytes of all of ``split``: what keeping it in memory holds."""
        s = self.spec.splits[split]
        return s.num_samples * s.sample_bytes()

    def _splits_kept(self) -> list[str]:
        """The splits kept in memory: train, then val, then the rest, each if it still fits the budget."""
        kept, room = [], self.keep_in_memory_bytes
        for split in sorted(self.spec.splits, key=lambda name: (name != "train", name != "val")):
            size = self.split_bytes(split)
            if 0 < size <= room:
                kept.append(split)
                room -= size
        return kept

    def in_memory(self, split: str) -> bool:
        """True once every chunk of ``split`` is held in memory: its passes read nothing."""
        held = self._held.get(split)
        return held is not None and len(held) == self.reader.num_chunks(split)

    def held_bytes(self) -> int:
        """Bytes the splits kept in memory hold once read (0 when ``keep_in_memory_bytes`` admits none)."""
        return sum(self.split_bytes(split) for split in self._held)

    def stored_bytes(self) -> int:
        return self.size_bytes

    @property
    def throttle_device(self) -> Any:
        """The simulated device reads go through (its ``stats()``), or None when not throttled."""
        device = getattr(self.reader, "device", None)
        store = getattr(self.reader, "_zarr_store", None)
        return device if device is not None else getattr(store, "device", None)

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
        if total <= 1 or not getattr(self.reader, "SEPARATE_DECODE", False):
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
            chunks = _keeping(chunks, order, held)
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
        chunks = self._take_read_on(split, seed, epoch)
        if chunks is None:
            chunks = self._chunks(split, self._shuffled_order(split, seed, epoch))
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
