"""A derived cache built on a real Dask cluster (loopback, 2 worker processes) is the local build's entry.

Workers re-create the upstream graph, load the stored float cache at cut 7 from the shared store and
run only the blocks up to cut 4 over their partitions. Partitions start at chunk boundaries, not at the
derived forward's batch boundaries, so this also checks that a derived stream opened mid-split forms
the batches an uninterrupted pass forms (the committed bytes would differ otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.context import RunContext
from pipeline.executors import executor_for
from pipeline.executors.dask_build import start_local_cluster
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog


def recipe_dict(executor: dict[str, Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "derived-dask",
        "run": {"threads": 1},
        "stages": {
            "digits": {"type": "digits"},
            "split": {"type": "split", "input": "digits", "val_fraction": 0.2, "test_fraction": 0.2},
            "model": {"type": "backbone", "arch": "mobilenet_v2", "width_mult": 0.35, "small_input": True,
                      "num_classes": 10, "resolution": 32, "weights": "random"},
            "images": {"type": "decode", "input": "split", "resolution": 32, "batch_size": 30},
            "k7": {"type": "frozen_forward", "input": "images", "model": "model", "train_last_blocks": 7},
            "k7_float": {"type": "quantize", "input": "k7", "bits": 32, "eval_bits": 32},
            "k7_stored": {"type": "cache", "input": "k7_float"},
            "k7_read": {"type": "dequantize", "input": "k7_stored"},
            # No batch_size: the derived forward's default batches (64) are not in the runner's batch
            # period (decode's 30), so partitions open it at multiples of 30 and its own alignment is what
            # forms the batches an uninterrupted pass forms.
            "cut4": {"type": "frozen_forward", "input": "k7_read", "model": "model", "train_last_blocks": 4},
            "cut4_float": {"type": "quantize", "input": "cut4", "bits": 32, "eval_bits": 32},
            "cut4_stored": {"type": "cache", "input": "cut4_float", "chunk_bytes": 16384},
        },
        "targets": ["cut4_stored"],
    }
    if executor is not None:
        data["executor"] = executor
    return data


def build(data: dict[str, Any], store: Path) -> Runner:
    recipe = recipe_from_dict(data)
    runner = Runner(recipe, RunContext(catalog=Catalog(store), recipe_name=recipe.name,
                                       executor=executor_for(recipe)))
    runner.run()
    return runner


def test_a_derived_cache_built_on_dask_is_the_local_entry(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        local = build(recipe_dict(), tmp_path / "local")
    finally:
        torch.set_num_threads(threads)
    fp = local.fingerprints["cut4_stored"]
    with start_local_cluster(2, 1) as cluster:
        executor = {"type": "dask", "address": cluster.scheduler_address, "partition_chunks": 1,
                    "torch_threads": 1}
        remote = build(recipe_dict(executor), tmp_path / "dask")
    assert remote.fingerprints["cut4_stored"] == fp
    extra = Catalog(tmp_path / "dask").lookup(fp).manifest["extra"]  # type: ignore[union-attr]
    assert extra["executor"]["type"] == "dask" and extra["executor"]["partitions"] > 2
    assert Catalog(tmp_path / "dask").content_hash(fp) == Catalog(tmp_path / "local").content_hash(fp)
    assert remote._outputs["cut4"].stats.batches == 0  # the workers derived it, not the client
