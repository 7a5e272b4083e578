"""Stage A on a real Dask cluster (loopback, 2 worker processes): the same entry as a local build.

A local build and a Dask build of one recipe must commit byte-identical entries (equal
content hashes); a worker killed mid-build and a client killed mid-build must both end
in that same entry, the latter recomputing only the partitions that were not finished.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
import zarr
from distributed import Client

from pipeline.context import RunContext
from pipeline.errors import RecipeError, StageError
from pipeline.executors import ExecutorError, WorkerStoreError, executor_for
from pipeline.executors.dask_build import start_local_cluster
from pipeline.executors.partitions import (
    PARTITIONS_PER_THREAD,
    Partition,
    auto_partition_chunks,
    plan_partitions,
)
from pipeline.executors.worker import BuildJob, build_partition
from pipeline.recipe import Recipe, recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog
from tests.helpers import start_pipeline

# Chunks of 15 samples and one chunk per partition: over a hundred partitions, so a kill lands
# mid-build. Decode batches of 30: every other partition starts mid-batch and needs a lead-in.
CHUNK_BYTES = 16384
BATCH = 30


def recipe_dict(executor: dict[str, Any] | None = None, name: str = "dask-build") -> dict[str, Any]:
    """Digits (1797 images) -> decode at 32 px -> tiny MobileNetV2 bottom -> 2-bit codes -> zarr cache."""
    data: dict[str, Any] = {
        "name": name,
        "stages": {
            "digits": {"type": "digits"},
            "split": {"type": "split", "input": "digits", "val_fraction": 0.2, "test_fraction": 0.2},
            "model": {
                "type": "backbone",
                "arch": "mobilenet_v2",
                "width_mult": 0.35,
                "small_input": True,
                "num_classes": 10,
                "resolution": 32,
            },
            "images": {"type": "decode", "input": "split", "resolution": 32, "batch_size": BATCH},
            "features": {
                "type": "frozen_forward",
                "input": "images",
                "model": "model",
                "train_last_blocks": 7,
            },
            "quantized": {"type": "quantize", "input": "features", "bits": 2},
            "cache": {"type": "cache", "input": "quantized", "chunk_bytes": CHUNK_BYTES},
        },
        "run": {"threads": 1},
        "targets": ["cache"],
    }
    if executor is not None:
        data["executor"] = executor
    return data


def dask_executor(address: str, **extra: Any) -> dict[str, Any]:
    return {"type": "dask", "address": address, "partition_chunks": 1, "torch_threads": 1, **extra}


def run(recipe: Recipe, store: Path) -> tuple[Runner, str]:
    """Run ``recipe`` into ``store`` in this process; (runner, the cache stage's fingerprint)."""
    runner = Runner(recipe, RunContext(
        catalog=Catalog(store), recipe_name=recipe.name, executor=executor_for(recipe)
    ))
    runner.run()
    return runner, runner.fingerprints["cache"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with start_local_cluster(2, 1) as c:
        yield c


@pytest.fixture(scope="module")
def local_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The reference: the same recipe built by the local runner with 1 torch thread, like the workers."""
    store = tmp_path_factory.mktemp("local-store")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, fp = run(recipe_from_dict(recipe_dict()), store)
    finally:
        torch.set_num_threads(threads)
    return store, fp


def chunk_files(staging: Path) -> int:
    return sum(1 for p in staging.rglob("*") if p.is_file() and p.name != "zarr.json")


def test_dask_build_equals_local_build(cluster: Any, local_build: tuple[Path, str], tmp_path: Path) -> None:
    local_store, fp = local_build
    recipe = recipe_from_dict(recipe_dict(dask_executor(cluster.scheduler_address)))
    runner, dask_fp = run(recipe, tmp_path / "store")
    assert dask_fp == fp
    local, remote = Catalog(local_store), Catalog(tmp_path / "store")
    assert remote.content_hash(fp) == local.content_hash(fp)
    a = zarr.open_group(str(local.lookup(fp).path / "data.zarr"), mode="r")
    b = zarr.open_group(str(remote.lookup(fp).path / "data.zarr"), mode="r")
    arrays = [name for name, node in a.members(max_depth=None) if isinstance(node, zarr.Array)]
    assert {"train/codes", "train/lo", "train/scale", "val/x", "test/y"} <= set(arrays)
    for name in arrays:
        np.testing.assert_array_equal(a[name][:], b[name][:])
    extra = remote.lookup(fp).manifest["extra"]
    assert extra["executor"]["type"] == "dask" and extra["executor"]["partitions"] > 10
    assert extra["executor"]["partitions_computed"] == extra["executor"]["partitions"]
    assert extra["executor"]["lead_in_samples"] > 0  # partitions starting mid-batch formed local batches
    # Where the chunks were computed: each distinct worker host and device, as a local build records it.
    workers = extra["built_on"]["workers"]
    assert extra["built_on"]["executor"] == "dask" and workers
    assert all(w["device"] == "cpu" and w["worker"] and w["torch"] for w in workers)
    # The client resolved the input stream but never pulled it: no frozen forward ran here.
    assert runner._outputs["features"].stats.batches == 0
    assert runner._outputs["images"].stats.batches == 0


def test_killed_worker_build_still_completes(
    cluster: Any, local_build: tuple[Path, str], tmp_path: Path
) -> None:
    local_store, fp = local_build
    store = tmp_path / "store"
    staging = store / "staging" / fp
    client = Client(cluster, set_as_default=False)
    pids = client.run(os.getpid)
    killed: list[int] = []  # chunk files written when the worker was killed
    stop = threading.Event()

    def kill_one_worker_mid_build() -> None:
        while not stop.is_set():
            written = chunk_files(staging) if staging.is_dir() else 0
            if written >= 10:  # some partitions are finished
                os.kill(next(iter(pids.values())), signal.SIGKILL)
                killed.append(written)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_one_worker_mid_build, daemon=True)
    killer.start()
    try:
        recipe = recipe_from_dict(recipe_dict(dask_executor(cluster.scheduler_address)))
        run(recipe, store)
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was killed: the build never wrote 10 chunk files"
    catalog = Catalog(store)
    assert killed[0] < chunk_files(catalog.lookup(fp).path / "data.zarr"), "killed after the last chunk"
    assert catalog.content_hash(fp) == Catalog(local_store).content_hash(fp)
    client.wait_for_workers(2, timeout=60)  # the nanny restarted it, for the next test
    client.close()


def test_resume_after_client_dies(cluster: Any, local_build: tuple[Path, str], tmp_path: Path) -> None:
    """The client runs in a subprocess with its own 2-worker cluster and is SIGKILLed mid-build."""
    local_store, fp = local_build
    store = tmp_path / "store"
    store.mkdir()
    path = tmp_path / "recipe.yaml"
    executor = {"type": "dask", "workers": 2, "partition_chunks": 1}
    path.write_text(yaml.safe_dump(recipe_dict(executor)))
    staging = store / "staging" / fp
    proc = start_pipeline(
        path,
        store,
        tmp_path / "out",
        "--quiet",
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # its workers share the session: nothing survives the kill below
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if staging.is_dir() and chunk_files(staging) >= 10:
                break
            time.sleep(0.01)
        assert proc.poll() is None, f"the build ended before it could be killed: {proc.communicate()[1]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # worker processes of the dead client, if any linger
        except ProcessLookupError:
            pass
    catalog = Catalog(store)
    assert not catalog.exists(fp)
    written = chunk_files(staging)
    assert written >= 10
    # Re-running resumes the staging directory the dead client left (here on the test's cluster).
    recipe = recipe_from_dict(recipe_dict(dask_executor(cluster.scheduler_address)))
    run(recipe, store)
    assert catalog.content_hash(fp) == Catalog(local_store).content_hash(fp)
    extra = catalog.lookup(fp).manifest["extra"]
    assert extra["resumed_samples"] > 0
    assert extra["executor"]["partitions_computed"] < extra["executor"]["partitions"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_workers_keep_the_heap_when_the_client_asks(
    cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Workers do not share the client's environment (they may be other machines): the choice
    # travels with the job, and each worker applies it before its frozen forward.
    from pipeline.heap import ENV, heap_kept

    monkeypatch.setenv(ENV, "1")
    run(recipe_from_dict(recipe_dict(dask_executor(cluster.scheduler_address))), tmp_path / "store")
    with Client(cluster, set_as_default=False) as client:
        # Every worker that ran a partition applied it (with over a hundred partitions, in practice both).
        assert True in client.run(heap_kept).values()


def test_unreachable_scheduler_names_the_address(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    recipe = recipe_from_dict(recipe_dict(dask_executor(address, connect_timeout=1)))
    with pytest.raises(ExecutorError, match=f"executor.address: cannot reach a Dask scheduler at {address}"):
        run(recipe, tmp_path / "store")
    # Nothing was committed, and the staging directory stays for a later run to resume.
    assert not Catalog(tmp_path / "store").entries()


def test_worker_without_the_store_names_the_path(tmp_path: Path) -> None:
    """What a worker on a machine without the shared filesystem raises (run in-process here)."""
    missing = tmp_path / "not-mounted" / "staging" / "x" / "data.zarr"
    job = BuildJob(
        recipe=recipe_dict(),
        recipe_type=Recipe,
        source="r.yaml",
        store=str(tmp_path / "not-mounted"),
        stage="cache",
        input="quantized",
        fingerprint="0" * 64,
        spec="{}",
        zarr_dir=str(missing),
        torch_threads=1,
        batch_period=64,
    )
    with pytest.raises(WorkerStoreError, match="same path as the client") as err:
        build_partition(job, Partition("train", 0, 1, 10, 100))
    assert str(missing) in str(err.value)
    # It crosses the process boundary (Dask pickles it back to the client) with its message intact.
    again = pickle.loads(pickle.dumps(err.value))
    assert isinstance(again, WorkerStoreError) and str(again) == str(err.value)


def test_executor_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="executor: .*needs address .* or workers"):
        recipe_from_dict(recipe_dict({"type": "dask"}))
    with pytest.raises(RecipeError, match="not both"):
        recipe_from_dict(recipe_dict({"type": "dask", "workers": 2, "address": "tcp://127.0.0.1:1"}))
    with pytest.raises(RecipeError, match="executor.worker: unknown key .*did you mean 'workers'"):
        recipe_from_dict(recipe_dict({"type": "dask", "worker": 2}))
    data = recipe_dict({"type": "dask", "workers": 2})
    data["stages"]["cache"]["format"] = "hdf5"
    recipe = recipe_from_dict(data)
    with pytest.raises(
        StageError, match="stages.cache .*format: hdf5 cannot be built with executor.type: dask"
    ):
        ctx = RunContext(catalog=Catalog(tmp_path / "store"), executor=executor_for(recipe))
        Runner(recipe, ctx)
    # A distributed recipe needs the executor its caller picked; the runner never imports one.
    recipe = recipe_from_dict(recipe_dict({"type": "dask", "workers": 2}))
    with pytest.raises(StageError, match="executor.type is 'dask' but the run context has no executor"):
        Runner(recipe, RunContext(catalog=Catalog(tmp_path / "store")))


def test_partitions_cover_every_chunk_once() -> None:
    counts = {"train": 1001, "val": 0, "test": 37}
    parts = plan_partitions(counts, chunk_samples=10, partition_chunks=3)
    for split, n in counts.items():
        mine = [p for p in parts if p.split == split]
        covered = [i for p in mine for i in range(p.first_chunk, p.stop_chunk)]
        assert covered == list(range(-(-n // 10)))
        assert sum(p.num_samples for p in mine) == n
        assert all(p.start % 10 == 0 for p in mine)
    assert json.dumps([p.describe() for p in parts])  # plain text for progress and errors


def test_partitions_with_a_chunk_length_per_split() -> None:
    counts = {"train": 1001, "val": 37}
    chunks = {"train": 100, "val": 6}
    parts = plan_partitions(counts, chunk_samples=chunks, partition_chunks={"train": 4, "val": 2})
    for split, n in counts.items():
        mine = [p for p in parts if p.split == split]
        assert [i for p in mine for i in range(p.first_chunk, p.stop_chunk)] == list(
            range(-(-n // chunks[split]))
        )
        assert sum(p.num_samples for p in mine) == n
        assert all(p.start % chunks[split] == 0 for p in mine)
    assert [p.stop_chunk - p.first_chunk for p in parts if p.split == "val"] == [2, 2, 2, 1]


def test_automatic_partitions_hold_about_the_same_samples_in_every_split() -> None:
    counts = {"train": 2000, "val": 250, "test": 250}
    chunks = {"train": 128, "val": 16, "test": 16}  # a 2-bit train split beside float16 val/test
    per = auto_partition_chunks(counts, chunks, threads=4)
    parts = plan_partitions(counts, chunks, per)
    sizes = [p.num_samples for p in parts if p.stop < p.split_samples]  # all but each split's last
    assert max(sizes) <= 2 * min(sizes)  # not 8x, as with the same chunk count in every split
    assert PARTITIONS_PER_THREAD * 4 * 0.5 <= len(parts) <= PARTITIONS_PER_THREAD * 4 * 2
    assert auto_partition_chunks({"train": 10}, 100, threads=8) == {"train": 1}
