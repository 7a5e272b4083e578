"""The cache operator's write path: a stream written through to a store entry, resumably.

Writing pulls the upstream stream split by split in sample order and hands batches to a
background writer thread, so compression and disk writes overlap the frozen forward. What
is stored (arrays, counts, chunking, codec, attributes) is the :class:`stores.entry.EntryLayout`
that :func:`cache_layout` derives from the stream's spec; the backend is chosen by
:func:`stores.entry.open_writer`, never here.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stores.entry import (
    EntryLayout,
    EntryWriter,
    Format,
    open_writer,
    plan_chunk_samples,
)
from stores.layout import ArraySpec

from ..lazy import lazy_module
from ..spec import STREAM, Spec, spec_to_json
from ..stream import Stream, samples_from
from .batching import Batch

if TYPE_CHECKING:
    import torch

    from ..stage import Stage
else:
    torch = lazy_module("torch")

SPEC_ATTR = "pipeline_spec"


def _sample_bytes(spec: Spec) -> dict[str, int]:
    return {name: s.sample_bytes() for name, s in spec.splits.items()}


def _counts(spec: Spec) -> dict[str, int]:
    return {name: s.num_samples for name, s in spec.splits.items()}


def chunk_samples_for(spec: Spec, chunk_bytes: int) -> int:
    """Samples per chunk so the largest split's chunks are about ``chunk_bytes`` (one length for all).

    The HDF5 layout (one chunk length per file); zarr entries use :func:`chunk_samples_per_split`.
    """
    planned = plan_chunk_samples("hdf5", _sample_bytes(spec), _counts(spec), chunk_bytes)
    return next(iter(planned.values()), 1)


def chunk_samples_per_split(spec: Spec, chunk_bytes: int) -> dict[str, int]:
    """Samples per chunk of each split, so each split's chunks are about ``chunk_bytes`` of its own samples
    (see :func:`stores.entry.plan_chunk_samples`)."""
    return plan_chunk_samples("zarr", _sample_bytes(spec), _counts(spec), chunk_bytes)


def cache_layout(
    spec: Spec,
    *,
    chunk_bytes: int,
    compressor: str,
    level: int,
    attrs: dict[str, Any],
    fmt: Format = "zarr",
) -> EntryLayout:
    """What a cache entry of ``spec`` stores: one array per split and field, the spec in its attributes.

    The same for every executor, so a local and a Dask build of one stream write the same bytes.
    """
    return EntryLayout(
        arrays={
            f"{split}/{name}": ArraySpec(tuple(f.shape), f.dtype)
            for split, s in spec.splits.items()
            for name, f in s.fields.items()
        },
        counts=_counts(spec),
        chunk_samples=plan_chunk_samples(fmt, _sample_bytes(spec), _counts(spec), chunk_bytes),
        attrs={**attrs, SPEC_ATTR: spec_to_json(spec)},
        compressor=compressor,
        level=level,
    )


def stream_batch_period(stages: Mapping[str, Stage], input_name: str) -> int:
    """Samples after which the stream of stage ``input_name`` is back on a batch boundary.

    The least common multiple of the ``batch_size`` of every stream stage up to
    ``input_name`` (decode's, a frozen forward's re-batching, a rechunk): a stream opened
    at a multiple of it forms the same batches as one opened at 0, which is what makes a
    resumed (or partitioned) build write the bits an uninterrupted one writes.
    """
    period, seen, todo = 1, set(), [input_name]
    while todo:
        name = todo.pop()
        if name in seen or name not in stages:
            continue
        seen.add(name)
        stage = stages[name]
        size = getattr(stage, "batch_size", None)
        if stage.kind == STREAM and isinstance(size, int) and size > 0:
            period = math.lcm(period, size)
        todo.extend(stage.input_refs().values())
    return period


class _BackgroundWriter:
    """Runs ``writer.write`` on a thread with a bounded queue; errors surface on the caller.

    The writer comes from ``open_writer``, called on that thread first: creating a fresh
    entry's files then overlaps computing its first batch. ``writer`` is valid after
    :meth:`finish` returned without an error.
    """

    def __init__(self, open_writer: Callable[[], EntryWriter], depth: int = 4) -> None:
        self.open_writer = open_writer
        self.writer: EntryWriter | None = None
        self.q: queue.Queue[tuple[str, int, dict[str, Any], Any] | None] = queue.Queue(maxsize=depth)
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
                group, start, arrays, ready = item
                try:
                    assert self.writer is not None  # set before any error-free item
                    if ready is not None:  # copies from a GPU still in flight: wait for them here
                        ready.synchronize()
                        arrays = {k: v.numpy() for k, v in arrays.items()}
                    self.writer.write_at(group, start, arrays)
                except BaseException as exc:  # reported by put()/finish()
                    self.error = exc

    def put(self, group: str, start: int, arrays: dict[str, Any], ready: Any = None) -> None:
        """Queue ``arrays`` (numpy) for writing; or CPU tensors still being copied from a GPU, with the
        CUDA event ``ready`` that completes when they are."""
        if self.error is not None:
            raise self.error
        self.q.put((group, start, arrays, ready))

    def finish(self) -> EntryWriter:
        """Wait for every batch to be written; the writer (to close), or the first error raised."""
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.writer is not None
        return self.writer


def host_arrays(batch: Batch) -> tuple[dict[str, Any], Any]:
    """``batch`` on its way to the host: (numpy arrays, None) from CPU tensors; from a GPU, (CPU tensors
    being copied asynchronously, the CUDA event that completes with the copies), so the device goes on
    to the next batch's forward while this one's codes cross the bus and the writer thread waits."""
    if all(v.device.type == "cpu" for v in batch.values()):
        return {k: v.detach().numpy() for k, v in batch.items()}, None
    device = next(v.device for v in batch.values() if v.device.type != "cpu")
    host = {k: v.detach().to("cpu", non_blocking=True) for k, v in batch.items()}
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))  # the copies were queued on that stream
    return host, ready


def write_stream(
    stream: Stream,
    entry_dir: Path,
    *,
    chunk_bytes: int,
    compressor: str,
    level: int,
    attrs: dict[str, Any],
    fmt: Format = "zarr",
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
    layout = cache_layout(
        spec, chunk_bytes=chunk_bytes, compressor=compressor, level=level, attrs=attrs, fmt=fmt
    )
    counts = layout.counts

    def open_entry_writer() -> EntryWriter:
        # Resumes from what the interrupted build durably stored and still verifies (zarr: the
        # leading chunks; HDF5: the rows its progress log records); "wipe": a leftover written
        # with other chunking or codec settings is rebuilt, never mixed in.
        writer = open_writer(entry_dir, fmt, layout, resume=True, on_mismatch="wipe")
        if writer.restart_reason is not None and log is not None:
            kind = "HDF5" if fmt == "hdf5" else fmt
            log(f"could not resume the interrupted {kind} build ({writer.restart_reason}); starting over")
        return writer

    if not entry_dir.is_dir() or not any(entry_dir.iterdir()):
        # Nothing to resume: the writer creates the entry's files on its own thread while the
        # first batch is decoded and forwarded.
        done = dict.fromkeys(spec.splits, 0)
        background = _BackgroundWriter(open_entry_writer)
    else:
        writer = open_entry_writer()
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
                background.put(split, position, *host_arrays(batch))
                position += n
                if progress is not None:
                    progress.update(n)
    finally:
        finished = background.finish()
    finished.close()
    chunk: int | dict[str, int] = layout.chunk_samples
    if fmt == "hdf5":  # recorded in the manifest as it always was: one length for the file
        chunk = next(iter(layout.chunk_samples.values()), 1)
    return {
        "chunk_samples": chunk,
        "compressor": compressor,
        "level": level,
        "format": fmt,
        "resumed_samples": sum(done.values()),
    }
