"""One partition of a Dask cache build, as it runs on a worker.

The worker re-creates the recipe's graph from the resolved recipe and the store path,
so the upstream entries the client made sure of (the pretrained backbone, say) are
read from the store, never rebuilt, and it keeps that graph per process, so the frozen
model is loaded once per worker, not once per partition. It then pulls only its
partition's samples (``stream.open(split, start=...)``) and writes whole chunks straight
into the staging hierarchy through :class:`stores.zarr_part.ZarrPartWriter` (temp file,
fsync, rename): a worker killed mid-write leaves each chunk absent or complete, never torn. Features
never travel through the scheduler; the task returns a few numbers.

Resume is per partition: the chunks of the partition that are already present and
decode (crc32c checked) are kept, and the stream is opened at the first one that is not.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stores.errors import StoreNotFoundError
from stores.zarr_format import META
from stores.zarr_part import ZarrPartWriter, kept_chunks

from ..device import device_description
from ..fingerprint import canonical_json, is_cacheable
from ..heap import heap_kept
from ..spec import spec_to_json
from ..stream import Stream, samples_from
from ..switches import KEEP_HEAP, apply_process_settings
from .errors import ExecutorError, WorkerStoreError
from .partitions import Partition

if TYPE_CHECKING:
    from ..recipe import Recipe


@dataclass(frozen=True)
class BuildJob:
    """What every partition of one build shares: enough for a worker to re-create the upstream stream."""

    recipe: dict[str, Any]  # resolved recipe; targets narrowed to the cache stage, executor local
    # The client's recipe class, which re-creates the recipe here (the engine never parses recipes).
    recipe_type: type[Recipe]
    source: str  # where the recipe came from, for messages
    store: str  # catalog root: the same path on every machine
    stage: str  # the cache stage being built
    input: str  # the stage whose stream it stores
    fingerprint: str  # the cache stage's fingerprint as the client computed it
    spec: str  # canonical JSON of the input stream's spec as the client resolved it
    zarr_dir: str  # the staging hierarchy to write into
    torch_threads: int
    batch_period: int  # streams are opened at multiples of this (see partitions.batch_period)
    # The client's ONDEVICE_TL_KEEP_HEAP choice (pipeline/heap.py): a worker on another machine
    # does not share the client's environment, so the choice travels with the job.
    keep_heap: bool = False

    @property
    def key(self) -> str:
        """Identity of the upstream graph a worker keeps for this job (and reuses for the next one)."""
        text = canonical_json([self.recipe, self.store, self.stage, self.fingerprint, self.torch_threads])
        return hashlib.sha256(text.encode()).hexdigest()


def where() -> str:
    """This worker, as messages name it."""
    return f"{socket.gethostname()} (pid {os.getpid()})"


@dataclass
class _Upstream:
    key: str
    runner: Any
    stream: Stream
    built_on: dict[str, Any]  # this worker's device, for the entry's manifest (device_description)


# Per worker process: the last job's upstream graph (frozen model loaded, weights read once).
# One slot: a worker serving a new build drops the previous model instead of accumulating them.
_slot: list[_Upstream] = []
_slot_lock = threading.Lock()


def _open_upstream(job: BuildJob) -> _Upstream:
    import torch

    from stores.catalog import Catalog

    from ..context import RunContext
    from ..progress import Progress
    from ..runner import Runner

    try:
        catalog = Catalog(job.store, create=False)
    except StoreNotFoundError:
        raise WorkerStoreError(
            f"Dask worker {where()} cannot open the store {job.store}: it does not exist there. Workers "
            "read the stored model and write chunks in place, so every worker must see the store at the "
            "same path as the client (a shared or network filesystem)"
        ) from None
    recipe = job.recipe_type.from_dict(job.recipe, source=job.source)
    ctx = RunContext(
        catalog=catalog,
        seed=recipe.seed,
        device=recipe.run.device,
        recipe_name=recipe.name,
        recipe_path=job.source,
        progress=Progress(quiet=True),
    )
    # Process-wide on purpose: every partition this worker runs shares one torch thread pool.
    torch.set_num_threads(job.torch_threads)
    runner = Runner(recipe, ctx)
    fp = runner.fingerprints.get(job.stage)
    if fp != job.fingerprint:
        raise ExecutorError(
            f"Dask worker {where()} computes fingerprint {str(fp)[:12]} for stage {job.stage!r}, the client "
            f"{job.fingerprint[:12]}: its data, weights or code differ from the client's (same package "
            "version and the same dataset files at the same paths are needed on every worker)"
        )
    # Stored stages upstream (the backbone) were built or loaded by the client before any task was
    # submitted. A worker that cannot find them looks at another store; it must not rebuild them.
    for name in sorted(runner.graph.ancestors([job.input])):
        stage, up = recipe.stages[name], runner.fingerprints[name]
        if stage.cacheable and is_cacheable(up) and not catalog.exists(up):
            raise WorkerStoreError(
                f"Dask worker {where()} finds no entry {up[:12]} for stage {name!r} in the store "
                f"{job.store}, although the client has it: the worker sees another directory at that "
                "path. Every worker must see the client's store at the same path (a shared filesystem)"
            )
    stream = runner.output(job.input)
    found = canonical_json(spec_to_json(stream.spec))
    if found != job.spec:
        raise ExecutorError(
            f"Dask worker {where()} resolves stage {job.input!r} to another stream spec than the client "
            f"(worker: {found[:300]}; client: {job.spec[:300]})"
        )
    return _Upstream(job.key, runner, stream, device_description(ctx.torch_device))


def upstream(job: BuildJob) -> tuple[_Upstream, float]:
    """The job's upstream graph in this process, built on first use; (it, seconds spent building it)."""
    with _slot_lock:  # threads of one worker wait for one build instead of loading the model twice
        if _slot and _slot[0].key == job.key:
            return _slot[0], 0.0
        while _slot:
            _slot.pop().runner.release()
        start = time.perf_counter()
        _slot.append(_open_upstream(job))
        return _slot[0], time.perf_counter() - start


def build_partition(job: BuildJob, part: Partition) -> dict[str, Any]:
    """Compute and write ``part``'s missing chunks; return what was kept and computed (no data)."""
    start = time.perf_counter()
    zarr_dir = Path(job.zarr_dir)
    if not (zarr_dir / META).is_file():
        raise WorkerStoreError(
            f"Dask worker {where()} cannot see the cache being built at {zarr_dir} (store {job.store}). "
            "Workers write their chunks straight into the store, so every worker must see the store at "
            "the same path as the client (a shared or network filesystem)"
        )
    # The client's process-wide settings, here, not where the upstream graph is built: a worker may
    # reuse a graph built for an earlier job (same recipe and store) that did not ask for them. Idempotent.
    apply_process_settings({KEEP_HEAP: job.keep_heap})
    kept = kept_chunks(zarr_dir, part.split, part.first_chunk, part.stop_chunk)
    result = {
        "split": part.split,
        "first_chunk": part.first_chunk,
        "stop_chunk": part.stop_chunk,
        "kept_chunks": kept,
        "computed_samples": 0,
        "lead_in_samples": 0,
        "upstream_seconds": 0.0,
        "worker": where(),
        # Dask's nanny default; slows torch down (see dask_build.start_local_cluster): the client says so.
        "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
        "heap_kept": heap_kept(),  # the client warns when it asked for this and did not get it
    }
    if kept == part.num_chunks:
        result["seconds"] = time.perf_counter() - start
        return result
    graph, result["upstream_seconds"] = upstream(job)
    stream = graph.stream
    result["built_on"] = {**graph.built_on, "worker": socket.gethostname()}
    first = (part.first_chunk + kept) * part.chunk_samples
    # Batched as a local build batches them (same bits): lead-in samples are computed and dropped.
    result["lead_in_samples"] = first % job.batch_period
    writer = ZarrPartWriter(zarr_dir, part.split, first, part.stop)
    position = first
    batches = samples_from(stream, part.split, first, job.batch_period)
    try:
        for batch in batches:
            n = min(len(next(iter(batch.values()))), part.stop - position)
            writer.write(part.split, {k: v[:n].detach().cpu().numpy() for k, v in batch.items()})
            position += n
            if position >= part.stop:
                break
    finally:
        # The rest of the split is not ours: stop the upstream (its decode prefetch thread) now. Closing
        # waits for that thread, which polls for the stop every 0.1 s, so it is done off this task's path.
        close = getattr(batches, "close", None)
        if close is not None:
            threading.Thread(target=close, name="close-upstream", daemon=True).start()
    if position < part.stop:
        raise ExecutorError(
            f"stage {job.input!r} ended split {part.split!r} at sample {position} on worker "
            f"{where()}, but partition {part.describe()} needs samples up to {part.stop}"
        )
    writer.close()
    result["computed_samples"] = part.stop - first
    result["seconds"] = time.perf_counter() - start
    return result
