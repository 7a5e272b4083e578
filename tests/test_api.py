"""The Python API exported from ``pipeline``: cheap to import, documented, and doing what the CLI does.

One small transfer recipe (the quickstart shrunk: a one-epoch backbone, a few images per class) is
run once through ``pipeline.run``; plan, rerun and ``cache_dataset`` are checked against it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import pipeline
from pipeline.errors import MissingPathError, RecipeError, StageError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
HAS_MODEL_FILE = importlib.util.find_spec("pipeline.deploy") is not None and (
    importlib.util.find_spec("pipeline.deploy.model_file") is not None
)


def tiny_recipe() -> dict[str, Any]:
    """The quickstart with its structure kept and its work shrunk to seconds."""
    data = yaml.safe_load(QUICKSTART.read_text())
    data["name"] = "tiny"
    data["run"] = {"threads": 1}
    stages = data["stages"]
    stages["source_digits"]["per_class"] = 40
    stages["target_digits"]["per_class"] = 20
    stages["backbone"]["train"] = {"epochs": 1, "lr": 0.01, "optimizer": "adamw"}
    stages["two_stage"]["train"] = {"epochs": 2, "lr": 0.01, "optimizer": "adamw"}
    del stages["baseline"]
    data["targets"] = ["two_stage"]
    return data


# ------------------------------------------------------------------------------ the package
def test_importing_pipeline_loads_no_heavy_library() -> None:
    code = (
        "import sys, pipeline\n"
        "heavy = {'torch', 'numpy', 'zarr', 'pydantic', 'yaml', 'h5py'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
        "pipeline.load_recipe\n"  # the recipe tools only: still no torch
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "False"]


@pytest.mark.parametrize("name", ["load_recipe", "plan", "run", "cache_dataset", "run_sweep"])
def test_every_export_is_documented_with_an_example(name: str) -> None:
    doc = getattr(pipeline, name).__doc__ or ""
    assert "Example::" in doc and f"pipeline.{name}(" in doc
    assert name in pipeline.__all__ and name in dir(pipeline)


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        pipeline.trian  # noqa: B018


@pytest.mark.skipif(not HAS_MODEL_FILE, reason="pipeline.deploy.model_file is not in this tree yet")
def test_load_model_is_the_model_file_loader() -> None:
    from pipeline.deploy import model_file

    assert pipeline.load_model is model_file.load_model
    assert "Example" in (pipeline.load_model.__doc__ or "")


@pytest.mark.skipif(HAS_MODEL_FILE, reason="pipeline.deploy.model_file exists: the export works")
def test_load_model_missing_is_a_clear_import_error() -> None:
    clear = r"pipeline.load_model is not available .*pipeline.deploy.model_file"
    with pytest.raises(ImportError, match=clear):
        pipeline.load_model  # noqa: B018
    with pytest.raises(ImportError, match="not available in this version"):
        from pipeline import load_model  # noqa: F401


# ------------------------------------------------------------------------------- load_recipe
def test_overrides_as_a_dict_or_as_set_strings() -> None:
    lr = "stages.two_stage.train.lr"
    as_dict = pipeline.load_recipe(QUICKSTART, {"stages.quantized.bits": 4, lr: 1e-7})
    as_list = pipeline.load_recipe(QUICKSTART, ["stages.quantized.bits=4", f"{lr}=1.0e-7"])
    assert as_dict == as_list
    assert as_dict.stages["quantized"].bits == 4 and as_dict.stages["two_stage"].train.lr == 1e-7
    # A recipe object, and a dict, take overrides too.
    again = pipeline.load_recipe(as_dict, {"stages.quantized.bits": 8})
    assert again.stages["quantized"].bits == 8 and again.stages["two_stage"].train.lr == 1e-7
    splits = pipeline.load_recipe(QUICKSTART, {"stages.augmented_features.splits": ("train", "val")})
    assert splits.stages["augmented_features"].splits == ("train", "val")
    from_dict = pipeline.load_recipe(tiny_recipe(), ["stages.quantized.bits=1"])
    assert from_dict.name == "tiny" and from_dict.stages["quantized"].bits == 1
    assert pipeline.load_recipe(as_dict) is as_dict


def test_bad_recipes_and_overrides_raise_the_toolkits_errors(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"--set stages.quantized.bits\).*bits"):
        pipeline.load_recipe(QUICKSTART, {"stages.quantized.bits": 3})
    with pytest.raises(RecipeError, match="not plain data"):
        pipeline.load_recipe(QUICKSTART, {"stages.quantized.bits": object()})
    with pytest.raises(RecipeError, match="KEY.PATH=VALUE"):
        pipeline.load_recipe(QUICKSTART, ["stages.quantized.bits"])
    with pytest.raises(RecipeError, match="expected a recipe file path, a dict or a Recipe"):
        pipeline.load_recipe(42)  # type: ignore[arg-type]
    with pytest.raises(MissingPathError, match="missing.yaml"):
        pipeline.run(tmp_path / "missing.yaml", store=tmp_path)


def test_max_bytes_zero_is_a_budget(tmp_path: Path) -> None:
    from pipeline.api import run_context

    recipe = pipeline.load_recipe(QUICKSTART)
    assert run_context(recipe, store=tmp_path, max_bytes=0).catalog.max_bytes == 0
    assert run_context(recipe, store=tmp_path).catalog.max_bytes is None


# -------------------------------------------------------------------------- run, plan, reuse
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("api")
    store = base / "store"
    store.mkdir()
    path = base / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(), sort_keys=False))
    result = pipeline.run(path, store=store, output=base / "run1", quiet=True)
    return {"store": store, "path": path, "result": result, "base": base}


def test_run_returns_summary_run_dir_and_outputs(tiny: dict[str, Any]) -> None:
    result = tiny["result"]
    assert result.run_dir == tiny["base"] / "run1"
    assert json.loads((result.run_dir / "summary.json").read_text()) == json.loads(
        json.dumps(result.summary, default=float)
    )
    assert (result.run_dir / "report.md").is_file()
    assert {r.status for r in result.stages.values()} == {"computed"}
    assert set(result.outputs) == {"two_stage"}
    accuracy = result.outputs["two_stage"]["accuracy"]
    assert 0.0 <= accuracy <= 1.0 and result.metrics["accuracy"] == accuracy
    assert result.summary_line.startswith("tiny: 11 stages (11 computed, 0 reused)")


def test_plan_then_rerun_reuse_what_is_stored(tiny: dict[str, Any]) -> None:
    rows = {r.name: r for r in pipeline.plan(tiny["path"], store=tiny["store"])}
    assert rows["backbone"].action == rows["cache"].action == "reuse"
    assert rows["cache"].fingerprint == tiny["result"].stages["cache"].fingerprint
    rows4 = pipeline.plan(tiny["path"], {"stages.quantized.bits": 4}, store=tiny["store"])
    changed = {r.name: r for r in rows4}
    assert changed["backbone"].action == "reuse" and changed["cache"].action == "compute"
    again = pipeline.run(tiny["path"], {"stages.two_stage.train.epochs": 1}, store=tiny["store"],
                         output=tiny["base"] / "run2", quiet=True)
    assert again.stages["backbone"].status == again.stages["cache"].status == "reused"
    assert again.stages["two_stage"].status == "computed"


# ---------------------------------------------------------------------------- cache_dataset
def test_cache_dataset_by_recipe_and_by_fingerprint(tiny: dict[str, Any]) -> None:
    fingerprint = tiny["result"].stages["cache"].fingerprint
    by_recipe = pipeline.cache_dataset(tiny["path"], store=tiny["store"], batch_size=1000, return_ids=True)
    by_prefix = pipeline.cache_dataset(fingerprint[:10], store=tiny["store"], batch_size=1000,
                                       return_ids=True)
    with by_recipe, by_prefix:
        assert by_recipe.fingerprint == by_prefix.fingerprint == fingerprint  # the only cache stage
        (x1, y1, i1), = list(by_recipe)
        (x2, y2, i2), = list(by_prefix)
    assert x1.equal(x2) and y1.equal(y2) and i1.equal(i2)
    assert x1.shape[1:] == by_recipe.feature_shape and by_recipe.num_classes == 5
    # augment=True is the recipe's own feature_aug stage (crop_padding 0, no flip in the quickstart);
    # by fingerprint there is no recipe, so feature_aug's defaults.
    recipe_aug = pipeline.cache_dataset(tiny["path"], stage="cache", store=tiny["store"], augment=True)
    prefix_aug = pipeline.cache_dataset(fingerprint[:10], store=tiny["store"], augment=True)
    with recipe_aug, prefix_aug:
        assert recipe_aug.augment is not None and recipe_aug.augment.crop_padding == 0
        assert prefix_aug.augment is not None and prefix_aug.augment.crop_padding == 1
    custom = pipeline.cache_dataset(fingerprint[:10], store=tiny["store"], augment={"hflip": 1.0})
    with custom:
        assert custom.augment is not None and custom.augment.hflip == 1.0


def test_cache_dataset_errors_say_how_to_fix(tiny: dict[str, Any]) -> None:
    with pytest.raises(StageError, match="'two_stage' .*not a stored stream.*cache"):
        pipeline.cache_dataset(tiny["path"], stage="two_stage", store=tiny["store"])
    with pytest.raises(StageError, match="no stage named 'cahce'.*did you mean 'cache'"):
        pipeline.cache_dataset(tiny["path"], stage="cahce", store=tiny["store"])
    from pipeline.data.cache_dataset import CacheEntryError

    with pytest.raises(CacheEntryError, match=r"'cache' of .*tiny.yaml is not stored yet.*targets=\[cache\]"):
        pipeline.cache_dataset(
            tiny["path"], overrides={"stages.quantized.bits": 8}, stage="cache", store=tiny["store"]
        )
    with pytest.raises(StageError, match="augment: expected feature_aug settings.*hflip"):
        pipeline.cache_dataset(tiny["path"], store=tiny["store"], augment={"hflip": 2})


# ------------------------------------------------------------------------------------ example
def run_example(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """examples/train_own_head.py as a user runs it, importing this checkout's pipeline."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "examples" / "train_own_head.py"), *args],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_example_trains_its_own_head_from_the_cache(
    tiny: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--recipe", str(tiny["path"]), "--store", str(tiny["store"]), "--workers", "2"]
    # A 4-bit cache is not stored yet: the example builds it (the backbone is reused), then trains.
    first = run_example(*common, "--set", "stages.quantized.bits=4", "--epochs", "2", cwd=tiny["base"])
    assert first.returncode == 0, first.stderr
    assert "building the cache tiny:cache" in first.stdout
    assert "epoch 1: loss" in first.stdout and "2 loader workers" in first.stdout
    accuracy = float(first.stdout.split("test accuracy ")[-1].split()[0])
    assert 0.0 <= accuracy <= 1.0
    # Again, in this process (no second interpreter start): now the cache is reused.
    spec = importlib.util.spec_from_file_location("train_own_head", ROOT / "examples" / "train_own_head.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main([*common, "--set", "stages.quantized.bits=4", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "reusing the stored cache" in out and "building" not in out
    assert example.main([*common, "--stage", "two_stage"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert "'two_stage' is not a cache stage of the recipe; its cache stages: cache" in err
