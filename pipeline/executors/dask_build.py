"""Build a cache entry on a Dask cluster: recipe ``executor: {type: dask, address: ... | workers: N}``.

The client (the process running the recipe) does the bookkeeping and none of the
heavy work:

1. it lays down the zarr metadata in the staging directory the catalog gave it, byte
   for byte what a local build writes (:func:`stores.zarr_part.prepare_hierarchy`),
   keeping an interrupted build's hierarchy when the layout matches;
2. it cuts every split into partitions of whole chunks and submits one task per
   partition (``worker.build_partition``); each worker re-creates the upstream stream
   from the recipe and the store, computes decode -> frozen forward -> quantize for its
   samples only, and writes its chunks in place; tasks return a few numbers, never
   features;
3. it counts finished partitions on a progress bar, retries failed ones (``retries``;
   a killed worker's partitions are rescheduled by Dask), and returns; the runner then
   commits the manifest once, exactly as after a local build.

Workers must see the store at the same path as the client (a shared or network
filesystem) and have this package installed. The entry's bytes do not depend on the
executor, so its content hash equals a local build's with the same torch thread count
(torch's CPU kernels may round differently with another thread count; the fingerprint,
and so reuse, is unaffected either way).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dask
from distributed import Client, KilledWorker, LocalCluster, as_completed

from stores.entry import ZARR_DIR, EntryLayout
from stores.errors import StoreError
from stores.zarr_part import missing_chunk_files, prepare_hierarchy, sweep_temp_files

from ..errors import PipelineError
from ..fingerprint import canonical_json
from ..spec import Spec, spec_to_json
from ..switches import KEEP_HEAP, process_settings
from .errors import ExecutorError
from .partitions import (
    Partition,
    align_partition_chunks,
    auto_partition_chunks,
    batch_period,
    plan_partitions,
)
from .worker import BuildJob, build_partition

if TYPE_CHECKING:
    from ..recipe import ExecutorConfig, Recipe

MALLOC_TRIM = "MALLOC_TRIM_THRESHOLD_"
# Seconds a local cluster's worker processes get to start (spawn, import, register) on a slow device.
LOCAL_START_TIMEOUT = 300


def worker_recipe(recipe: Recipe, stage: str) -> dict[str, Any]:
    """The recipe as a worker runs it: the same stages, only what ``stage`` needs, nothing distributed."""
    data = recipe.resolved_dict()
    data.pop("executor", None)  # a worker computes its share in-process; it never starts a cluster
    data["targets"] = [stage]  # datasets and stages the cache does not need are not even resolved there
    return data


def start_local_cluster(workers: int, threads_per_worker: int, *, allowed_failures: int = 3) -> LocalCluster:
    """A loopback cluster of ``workers`` processes, set up for torch work (also used by tests and benchmarks).

    ``allowed_failures``: times a task may be running on a worker that dies before Dask gives
    up on it (a task's ``retries`` cover exceptions, not deaths); the scheduler reads it when
    it starts, so it can only be set for a cluster started here.
    """
    # Dask's nannies give workers MALLOC_TRIM_THRESHOLD_=65536 (to hand freed memory back fast).
    # Setting it also freezes glibc's mmap threshold, so torch's large activation buffers are
    # mapped and faulted in afresh on every batch, which slows the frozen forward down markedly.
    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    environ.pop(MALLOC_TRIM, None)
    settings = {
        "distributed.scheduler.allowed-failures": allowed_failures,
        "distributed.nanny.pre-spawn-environ": environ,
    }
    with dask.config.set(settings):
        return LocalCluster(
            n_workers=workers,
            threads_per_worker=threads_per_worker,
            processes=True,  # the GIL: one frozen forward per process is what scales
            host="127.0.0.1",
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )


@contextmanager
def dask_client(executor: ExecutorConfig, log: Callable[[str], None]) -> Iterator[Client]:
    """A client of the scheduler at ``executor.address``, or of a local cluster started (and stopped) here."""
    if executor.address is not None:
        try:
            client = Client(executor.address, timeout=executor.connect_timeout, set_as_default=False)
        except (OSError, TimeoutError) as exc:
            raise ExecutorError(
                f"executor.address: cannot reach a Dask scheduler at {executor.address} within "
                f"{executor.connect_timeout:g} s ({type(exc).__name__}: {exc}). Start one there "
                "(`dask scheduler`, then `dask worker ADDRESS` on each machine), fix the address, or use "
                "executor.workers: N for a local cluster"
            ) from None
        try:
            try:
                client.wait_for_workers(1, timeout=executor.connect_timeout)
            except (OSError, TimeoutError):
                raise ExecutorError(
                    f"executor.address: the Dask scheduler at {executor.address} has no workers (waited "
                    f"{executor.connect_timeout:g} s); start some with `dask worker {executor.address}`"
                ) from None
            yield client
        finally:
            client.close()
        return
    assert executor.workers is not None
    try:
        cluster = start_local_cluster(
            executor.workers, executor.threads_per_worker, allowed_failures=executor.retries + 1
        )
    except (OSError, TimeoutError, RuntimeError) as exc:
        raise ExecutorError(
            f"executor.workers: cannot start a local Dask cluster of {executor.workers} worker processes: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    try:
        client = Client(cluster, set_as_default=False)
        try:
            # Worker processes import torch before they register; do not plan partitions without them.
            client.wait_for_workers(executor.workers, timeout=LOCAL_START_TIMEOUT)
            log(f"started a local Dask cluster at {cluster.scheduler_address}")
            yield client
        finally:
            client.close()
    finally:
        cluster.close()


def _failure(exc: BaseException, part: Partition, retries: int) -> BaseException:
    """The error to raise for a partition that failed for good: the worker's own if it is already clear."""
    if isinstance(exc, KilledWorker):
        return ExecutorError(
            f"partition {part.describe()}: its workers died too often while running it (out of memory? "
            "see the worker logs); re-running the recipe resumes from the chunks already written"
        )
    if isinstance(exc, ImportError):
        return ExecutorError(
            f"a Dask worker cannot import what partition {part.describe()} needs ({exc}): install this "
            "package (the same version as the client) in every worker's environment"
        )
    if isinstance(exc, (PipelineError, StoreError, OSError)):
        return exc  # already names what went wrong and where (a path, a sample, a field)
    return ExecutorError(
        f"partition {part.describe()} failed on a Dask worker after {retries} retries: "
        f"{type(exc).__name__}: {exc}"
    )


def build_on_dask(
    ctx: Any,
    recipe: Recipe,
    *,
    name: str,
    fingerprint: str,
    input_name: str,
    spec: Spec,
    staging: Path,
    layout: EntryLayout,
) -> dict[str, Any]:
    """Build the cache entry ``fingerprint`` of ``recipe``'s stage ``name`` into ``staging`` on Dask.

    ``spec`` is the input stream's spec as the client resolved it: the stream itself is
    never pulled here. Each worker re-creates the run from ``recipe`` and checks that it
    computes ``fingerprint`` for the stage.
    """
    executor = recipe.executor

    def log(message: str) -> None:
        ctx.progress.log(f"[{name}] {message}")

    zarr_dir = staging / ZARR_DIR
    kept_hierarchy = prepare_hierarchy(zarr_dir, layout)
    if kept_hierarchy:
        log("resuming an interrupted build: chunks already written are verified and kept, per partition")
    job = BuildJob(
        recipe=worker_recipe(recipe, name),
        recipe_type=type(recipe),
        source=recipe.source,
        store=str(Path(ctx.catalog.root).resolve()),
        stage=name,
        input=input_name,
        fingerprint=fingerprint,
        spec=canonical_json(spec_to_json(spec)),
        zarr_dir=str(zarr_dir.resolve()),
        torch_threads=executor.torch_threads,
        batch_period=batch_period(recipe, input_name),
        keep_heap=process_settings()[KEEP_HEAP],
    )
    total = sum(layout.counts.values())
    stats: dict[str, Any] = {
        "partitions": 0,
        "partitions_computed": 0,
        "kept_chunks": 0,
        "computed_samples": 0,
        "lead_in_samples": 0,  # recomputed before partition starts to form a local build's batches
        "worker_startup_s": 0.0,  # the longest a worker took to re-create the upstream graph
        "task_s": 0.0,  # summed over partitions: worker time inside tasks (wall x threads - this = overhead)
    }
    built_on: dict[str, dict[str, Any]] = {}  # where the partitions computed here were computed, distinct
    started = time.perf_counter()
    with dask_client(executor, log) as client:
        nthreads = client.nthreads()
        threads = sum(nthreads.values())
        auto = auto_partition_chunks(layout.counts, layout.chunk_samples, threads)
        per = {
            split: executor.partition_chunks or align_partition_chunks(auto[split], chunk, job.batch_period)
            for split, chunk in layout.chunk_samples.items()
        }
        parts = plan_partitions(layout.counts, layout.chunk_samples, per)
        stats["partitions"] = len(parts)
        log(
            f"building on Dask ({client.scheduler_info().get('address', '?')}): {len(parts)} "
            f"partitions of at most "
            f"{max(per.values(), default=0)} chunks (samples per chunk by split: {layout.chunk_samples}) "
            f"on {len(nthreads)} workers, {threads} threads"
        )
        futures = {
            client.submit(
                build_partition,
                job,
                part,
                key=f"cache-{job.fingerprint[:12]}-{part.split}-{part.first_chunk}",
                retries=executor.retries,
                pure=False,
            ): part
            for part in parts
        }
        warned_malloc = warned_heap = False
        try:
            with ctx.progress.bar(total, f"{name}: building cache on Dask", unit="img") as bar:
                for done, future in enumerate(as_completed(futures, loop=client.loop), start=1):
                    part = futures[future]
                    try:
                        result = future.result()
                    except Exception as exc:
                        log(f"partition {part.describe()} failed: {type(exc).__name__}: {exc}")
                        raise _failure(exc, part, executor.retries) from exc
                    stats["kept_chunks"] += result["kept_chunks"]
                    stats["computed_samples"] += result["computed_samples"]
                    stats["lead_in_samples"] += result["lead_in_samples"]
                    stats["task_s"] += result["seconds"]
                    if result.get("malloc_trim") is not None and not warned_malloc:
                        warned_malloc = True
                        log(
                            f"hint: Dask workers run with {MALLOC_TRIM}={result['malloc_trim']} (the nanny's "
                            "default), which can halve torch's CPU speed; start them without it (remove it "
                            "from distributed.nanny.pre-spawn-environ in their Dask config)"
                        )
                    if job.keep_heap and not result["heap_kept"] and not warned_heap:
                        warned_heap = True
                        log(
                            f"warning: {KEEP_HEAP}=1 could not be applied on worker {result['worker']} (it "
                            "needs Linux with glibc there); that worker runs with its default allocator"
                        )
                    if "built_on" in result:
                        built_on.setdefault(canonical_json(result["built_on"]), result["built_on"])
                    stats["partitions_computed"] += result["computed_samples"] > 0
                    stats["worker_startup_s"] = max(stats["worker_startup_s"], result["upstream_seconds"])
                    bar.update(part.num_samples)
                    bar.set_postfix_str(f"{done}/{len(parts)} partitions", refresh=False)
        finally:
            client.cancel(list(futures))  # no-op when all finished; on failure or Ctrl-C, stop the rest
    # Temp files of chunk writes cut short by a killed worker: never data, and never a payload file.
    sweep_temp_files(zarr_dir)
    missing = missing_chunk_files(zarr_dir, layout)
    if missing:
        raise ExecutorError(
            f"every partition reported success but {len(missing)} chunk files are missing in {zarr_dir} "
            f"(first: {missing[0]}); is another process deleting the staging directory (`cache gc`)?"
        )
    seconds = time.perf_counter() - started
    kept_samples = total - stats["computed_samples"]
    log(
        f"{stats['partitions']} partitions done in {seconds:.1f} s: {stats['partitions_computed']} computed, "
        f"{stats['partitions'] - stats['partitions_computed']} already stored ({kept_samples} samples kept)"
    )
    return {
        "chunk_samples": layout.chunk_samples,
        "compressor": layout.compressor,
        "level": layout.level,
        "format": "zarr",
        "resumed_samples": kept_samples,
        # Lineage for people, never identity: which worker hosts and devices computed the chunks.
        **({"built_on": {"executor": "dask", "workers": [built_on[k] for k in sorted(built_on)]}}
           if built_on else {}),
        "executor": {
            "type": "dask",
            "address": executor.address,
            "workers": len(nthreads),
            "threads": threads,
            "partition_chunks": per,
            **stats,
        },
    }
