"""A damaged stored file is never used: `cache verify` names it (any entry kind), a run rebuilds the entry
and says so, and a damaged manifest is reported by `ls`, `du` and `verify` and named by the run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.cli import main

RECIPE: dict[str, Any] = {
    "name": "damage",
    "run": {"threads": 1},
    "stages": {
        "digits": {"type": "digits"},
        "source": {"type": "split", "input": "digits", "classes": [0, 1, 2], "per_class": 30,
                   "val_fraction": 0.2, "test_fraction": 0.0},
        "target": {"type": "split", "input": "digits", "classes": [5, 6, 7], "per_class": 20,
                   "val_fraction": 0.2, "test_fraction": 0.2},
        "backbone": {"type": "pretrain", "input": "source", "arch": "mobilenet_v2", "width_mult": 0.35,
                     "small_input": True, "resolution": 16, "train": {"epochs": 1}},
        "images": {"type": "decode", "input": "target", "resolution": 16},
        "features": {"type": "frozen_forward", "input": "images", "model": "backbone",
                     "train_last_blocks": 3},
        "quantized": {"type": "quantize", "input": "features", "bits": 2},
        "cache": {"type": "cache", "input": "quantized"},
        "deq": {"type": "dequantize", "input": "cache"},
        "top": {"type": "finetune", "model": "backbone", "features": "deq", "train": {"epochs": 1}},
    },
    "targets": ["top"],
}


def flip(path: Path, count: int = 8) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("damage")
    recipe = base / "damage.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    store = base / "store"
    assert main(["run", str(recipe), "--store", str(store), "--output", str(base / "run0"), "--quiet"]) == 0
    stages = {s["name"]: s["fingerprint"] for s in
              json.loads((base / "run0" / "summary.json").read_text())["stages"]}
    return {"base": base, "recipe": recipe, "store": store, "fp": stages}


def fresh_store(stored: dict[str, Any], tmp_path: Path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(stored["store"], store)
    return store


def run(stored: dict[str, Any], store: Path, out: Path, target: str) -> dict[str, Any]:
    """Run the recipe up to ``target`` (a run reads only what its targets need)."""
    assert main(["run", str(stored["recipe"]), "--store", str(store), "--output", str(out),
                 "--set", f"targets=[{target}]"]) == 0
    return {s["name"]: s for s in json.loads((out / "summary.json").read_text())["stages"]}


@pytest.mark.parametrize(("stage", "file"), [("backbone", "weights.pt"), ("top", "model.pt"),
                                              ("top", "best.pt"), ("top", "result.json"),
                                              ("cache", "data.zarr/train/codes/zarr.json")])
def test_a_flipped_byte_is_found_by_verify_and_rebuilt_by_a_run(
    stored: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], stage: str, file: str
) -> None:
    store = fresh_store(stored, tmp_path)
    fp = stored["fp"][stage]
    flip(store / "entries" / fp / file)
    assert main(["cache", "verify", "--store", str(store)]) == 1
    out = capsys.readouterr().out
    assert f"entry {fp[:12]}" in out and file in out and "1 damaged" in out, out
    stages = run(stored, store, tmp_path / "run", stage)
    err = capsys.readouterr().err
    assert f"the stored {stages[stage]['kind']} {fp[:12]} is damaged ({file} did not match" in err, err
    assert "rebuilding it" in err and stages[stage]["status"] == "computed"
    assert main(["cache", "verify", "--store", str(store)]) == 0


def test_a_damaged_manifest_is_reported_by_ls_du_verify_and_named_by_the_run(
    stored: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = fresh_store(stored, tmp_path)
    fp = stored["fp"]["backbone"]
    (store / "entries" / fp / "manifest.json").write_text('{"format": "ondevice-tl-entry", "fing')
    capsys.readouterr()
    assert main(["cache", "ls", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert f"{fp[:12]}  DAMAGED" in out and "manifest.json is not valid JSON" in out, out
    assert main(["cache", "du", "--store", str(store), "--json"]) == 0
    usage = json.loads(capsys.readouterr().out)
    assert usage["damaged_entries"] == 1 and usage["damaged_bytes"] > 1_000_000  # the weights are counted
    assert main(["cache", "verify", "--store", str(store)]) == 1
    assert f"entry {fp[:12]}: manifest.json is not valid JSON" in capsys.readouterr().out
    stages = run(stored, store, tmp_path / "run", "backbone")
    err = capsys.readouterr().err
    assert f"the stored model {fp[:12]} is damaged (manifest.json is not valid JSON" in err, err
    assert stages["backbone"]["status"] == "computed"
    assert main(["cache", "verify", "--store", str(store)]) == 0


def test_rm_removes_an_entry_whose_manifest_is_damaged(
    stored: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = fresh_store(stored, tmp_path)
    fp = stored["fp"]["top"]
    (store / "entries" / fp / "manifest.json").write_bytes(b"\xff\xfe")
    assert main(["cache", "rm", fp[:12], "--store", str(store)]) == 0
    assert "removed" in capsys.readouterr().out and not (store / "entries" / fp).exists()
