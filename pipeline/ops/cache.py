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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stores.h5_entry import H5Reader, H5Writer
from stores.throttle import ThrottledZarrStore
from stores.zarr_entry import ArraySpec, ZarrReader, ZarrWriter

from ..spec import FieldSpec, Spec, SplitSpec
from ..stream import Stream, StreamStats
from .batching import Batch
from .prefetch import prefetch
from .shuffle import window_shuffle

SPEC_ATTR = "pipeline_spec"


def spec_to_json(spec: Spec) -> dict[str, Any]:
    return {
        "kind": spec.kind,
        "num_classes": spec.num_classes,
        "splits": {
            name: {
                "num_samples": s.num_samples,
                "fields": {k: [list(f.shape), f.dtype] for k, f in s.fields.items()},
            }
            for name, s in spec.splits.items()
        },
        "meta": dict(spec.meta),
    }


def spec_from_json(data: dict[str, Any]) -> Spec:
    splits = {
        name: SplitSpec(
            s["num_samples"], {k: FieldSpec(tuple(shape), dtype) for k, (shape, dtype) in s["fields"].items()}
        )
        for name, s in data["splits"].items()
    }
    return Spec(data["kind"], data["num_classes"], splits, data["meta"])


def chunk_samples_for(spec: Spec, chunk_bytes: int) -> int:
    """Samples per chunk so the largest split's chunks are about ``chunk_bytes``."""
    per_sample = max(s.sample_bytes() for s in spec.splits.values()) or 1
    most = max(s.num_samples for s in spec.splits.values()) or 1
    return int(max(1, min(most, chunk_bytes // per_sample)))


class _BackgroundWriter:
    """Runs ``writer.write`` on a thread with a bounded queue; errors surface on the caller."""

    def __init__(self, writer: Any, depth: int = 4) -> None:
        self.writer = writer
        self.q: queue.Queue[tuple[str, int, dict[str, np.ndarray]] | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._work, name="cache-writer", daemon=True)
        self.thread.start()

    def _work(self) -> None:
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
) -> dict[str, Any]:
    """Write every split of ``stream`` into ``entry_dir`` (zarr v3 ``data.zarr`` or HDF5 ``entry.h5``).

    A zarr build resumes: chunks a killed or interrupted build already wrote (and that
    still verify) are kept, and the stream is reopened at the first missing sample, so
    upstream work (decode, frozen forward) is not redone for them. The result is
    bit-identical to an uninterrupted build because chunks are a pure function of the
    samples and the codec. HDF5 files are not resumable and restart from scratch.
    """
    spec = stream.spec
    chunk = chunk_samples_for(spec, chunk_bytes)
    arrays = {
        f"{split}/{name}": ArraySpec(tuple(f.shape), f.dtype)
        for split, s in spec.splits.items()
        for name, f in s.fields.items()
    }
    counts = {split: s.num_samples for split, s in spec.splits.items()}
    attrs = {**attrs, SPEC_ATTR: spec_to_json(spec)}
    writer: Any
    if fmt == "hdf5":
        leftover = entry_dir / H5_FILE
        if leftover.exists():
            leftover.unlink()
        writer = H5Writer(
            entry_dir / H5_FILE, arrays, counts, chunk, attrs, compressor=compressor, level=level
        )
    else:
        # "wipe": a leftover written with other chunking/codec settings is rebuilt, never mixed in.
        writer = ZarrWriter(
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
    done = {split: writer.resume_samples(split) if fmt == "zarr" else 0 for split in spec.splits}
    if any(done.values()) and log is not None:
        kept = ", ".join(f"{split} {n}/{counts[split]}" for split, n in done.items())
        log(f"resuming an interrupted build: kept verified chunks ({kept} samples)")
    if progress is not None:
        progress.update(sum(done.values()))
    background = _BackgroundWriter(writer)
    try:
        for split in spec.splits:
            if done[split] >= counts[split]:
                continue
            position = done[split]
            for batch in stream.open(split, epoch=0, shuffle=False, start=position):
                n = len(next(iter(batch.values())))
                background.put(split, position, {k: v.detach().cpu().numpy() for k, v in batch.items()})
                position += n
                if progress is not None:
                    progress.update(n)
    finally:
        background.finish()
    writer.close()
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
        if throttle is not None:
            raise ValueError(f"read throttling is only supported for zarr entries; {entry_dir} is HDF5")
        return H5Reader(entry_dir / H5_FILE)
    store = None
    if throttle is not None:
        store = ThrottledZarrStore(entry_dir / ZARR_DIR, throttle, read_only=True)
    return ZarrReader(entry_dir / ZARR_DIR, zarr_store=store)


class StoredStream(Stream):
    """A committed cache entry read as a stream.

    Reads are whole chunks (large and sequential, what SD cards and eMMC do well), run
    ahead of the consumer on a background thread. Memory held by the reader is bounded:
    at most ``prefetch_depth`` decoded chunks queued, fewer if ``prefetch_max_bytes``
    says so, plus the chunk being decoded, plus the shuffle window of ``window_chunks``
    chunks on training passes.
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

    def stored_bytes(self) -> int:
        return self.size_bytes

    def chunk_bytes(self, split: str) -> int:
        """Decoded bytes of one chunk of ``split``: the unit of read-ahead memory."""
        return self.reader.chunk_samples(split) * self.spec.splits[split].sample_bytes()

    def read_ahead(self, split: str) -> int:
        """Chunks queued ahead of the consumer: the depth, capped by the byte budget (at least 1)."""
        if self.prefetch_max_bytes is None or self.prefetch_depth == 0:
            return self.prefetch_depth
        return max(1, min(self.prefetch_depth, self.prefetch_max_bytes // max(1, self.chunk_bytes(split))))

    def _chunks(self, split: str, order: np.ndarray) -> Iterator[Batch]:
        import time

        for index in order:
            t0 = time.perf_counter()
            arrays = self.reader.read_chunk(split, int(index))
            batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
            self.stats.add(time.perf_counter() - t0, len(next(iter(batch.values()))))
            yield batch

    def open(
        self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0, start: int = 0
    ) -> Iterator[Batch]:
        self.spec.split(split, stage=str(self.path))
        n_chunks = self.reader.num_chunks(split)
        if shuffle:
            if start:
                raise ValueError("start (resume) is only defined for the unshuffled order")
            gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
            order = torch.randperm(n_chunks, generator=gen).numpy()
        else:
            per = self.reader.chunk_samples(split)
            order = np.arange(start // per, n_chunks)
        chunks = prefetch(self._chunks(split, order), self.read_ahead(split), name=f"read-{split}")
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
