"""Recipe stages: partition_search as a stored artifact, frozen_forward precision, finetune_mixed (bf16)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.context import RunContext
from pipeline.errors import StageError
from pipeline.models import int8 as int8_mod
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog

SEARCH = {
    "type": "partition_search",
    "model": "backbone",
    "input": "images",
    "population": 4,
    "generations": 2,
    "min_samples": 8,
    "max_samples": 16,
    "calibration_samples": 8,
    "batch_size": 16,
}


def recipe(**changes: Any) -> Any:
    stages: dict[str, Any] = {
        "data": {"type": "synthetic", "num_samples": 60, "num_classes": 3, "size": 16},
        "split": {"type": "split", "input": "data", "val_fraction": 0.3, "test_fraction": 0.0},
        "backbone": {
            "type": "backbone",
            "arch": "squeezenet1_1",
            "num_classes": 3,
            "small_input": True,
            "resolution": 16,
        },
        "images": {"type": "decode", "input": "split", "resolution": 16, "batch_size": 16, "prefetch": 0},
        "partition": SEARCH,
        "features": {
            "type": "frozen_forward",
            "input": "images",
            "model": "backbone",
            "train_last_blocks": 4,
            "precision": "int8",
            "calibration_batches": 2,
        },
        "float": {"type": "quantize", "input": "features", "bits": 32, "eval_bits": 32},
        "cache": {"type": "cache", "input": "float"},
        "read": {"type": "dequantize", "input": "cache"},
        "top": {
            "type": "finetune_mixed",
            "model": "backbone",
            "features": "read",
            "batch_size": 16,
            "train": {"epochs": 1},
        },
    }
    for name, value in changes.items():
        if value is None:
            del stages[name]
        else:
            stages[name] = {**stages.get(name, {}), **value}
    return recipe_from_dict(
        {
            "name": "mp",
            "stages": stages,
            "targets": ["partition", "top"] if "partition" in stages else ["top"],
        }
    )


def runner(tmp_path: Path, r: Any) -> Runner:
    return Runner(r, RunContext(catalog=Catalog(tmp_path / "store"), recipe_name="mp"))


def test_partition_and_int8_bf16_transfer_run_and_the_search_is_reused(tmp_path: Path) -> None:
    first = runner(tmp_path, recipe())
    reports = {r.name: r for r in first.run()}
    part = first.output("partition")
    assert reports["partition"].status == "computed"
    assert part["evaluations"] > 0 and part["front"] and part["selected"]["bits"]
    assert part["cut_layer"] is None or part["cut_layer"] in part["layers"]
    assert all(c["train_last_blocks"] is not None for c in part["cuts"])  # block granularity
    assert len(part["precision"]) == len(part["layers"]) and part["classifier"] not in part["layers"]
    top = reports["top"].metrics
    assert top["top_precision"] == "bf16" and top["master_weights"] == "fp32"
    assert top["bottom_precision"] == ("int8" if int8_mod.int8_support()[0] else "fp32")
    second = runner(tmp_path, recipe())
    reports2 = {r.name: r for r in second.run()}
    assert reports2["partition"].status == "reused" and reports2["cache"].status == "reused"
    assert second.output("partition")["selected"] == part["selected"]


def test_precision_changes_the_fingerprint_and_fp32_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fp(precision: str) -> str:
        return runner(tmp_path, recipe(partition=None, features={"precision": precision})).fingerprints[
            "features"
        ]

    int8, bf16, fp32 = fp("int8"), fp("bf16"), fp("fp32")
    assert len({int8, bf16, fp32}) == 3
    base = recipe(partition=None)
    stages = {k: v.to_config() for k, v in base.stages.items()}
    del stages["features"]["precision"], stages["features"]["calibration_batches"]
    plain = recipe_from_dict({"name": "mp", "stages": stages})
    assert "precision" not in plain.stages["features"].to_config()  # default fp32 stays out of the config
    assert runner(tmp_path, plain).fingerprints["features"] == fp32
    # without int8 kernels the fallback gets its own fingerprint: never a hit on a real int8 entry
    monkeypatch.setattr(int8_mod, "int8_support", lambda: (None, "no kernels"))
    assert fp("int8") not in (int8, fp32)


def test_search_on_the_wrong_classes_is_a_clear_error(tmp_path: Path) -> None:
    r = recipe(backbone={"num_classes": 5}, features=None, float=None, cache=None, read=None, top=None)
    r = recipe_from_dict(
        {"name": "mp", "stages": {k: v.to_config() for k, v in r.stages.items()}, "targets": ["partition"]}
    )
    with pytest.raises(StageError, match="stages.partition.*own task.*5 classes; found 3"):
        runner(tmp_path, r)


@pytest.mark.parametrize("name", ["resnet18_fashion.yaml", "squeezenet_fashion.yaml"])
def test_mixed_precision_recipes_validate(name: str) -> None:
    from pipeline.graph import Graph
    from pipeline.recipe import load_recipe

    path = Path(__file__).resolve().parents[2] / "recipes" / "mixed_precision" / name
    recipe_ = load_recipe(path)
    graph = Graph(recipe_)
    assert {"partition", "mixed", "bf16_only", "fp32", "cache4"} <= set(graph.targets)
    ff = recipe_.stages["int8_features"]
    assert ff.precision == "int8" and recipe_.stages["bf16_features"].precision == "bf16"
    assert recipe_.stages["mixed"].top_precision == "bf16"
