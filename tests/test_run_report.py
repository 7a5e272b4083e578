"""report.md, metrics.jsonl and the plots say what was run: titles from what is drawn, pretraining apart from
the transfer, training times filled in, and a rerun that reused everything still shows its training."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image, PngImagePlugin

from pipeline.cli import main
from tests.sweep.recipes import tiny_recipe


def _run(recipe: dict[str, Any], tmp: Path, out: str) -> Path:
    path = tmp / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["run", str(path), "--store", str(tmp / "store"), "--output", str(tmp / out), "--quiet"]) == 0
    return tmp / out


def _title(png: Path) -> str:
    image = Image.open(png)
    assert isinstance(image, PngImagePlugin.PngImageFile)
    return str(image.text["Title"])  # matplotlib writes it into the PNG's tEXt chunk


def _result_row(run: Path, trainer: str) -> list[str]:
    """The cells of ``trainer``'s row in report.md's Results table."""
    results = (run / "report.md").read_text().split("## Results", 1)[1]
    (row,) = [line for line in results.splitlines() if line.startswith(f"| {trainer}")]
    return [cell.strip() for cell in row.strip("|").split("|")]


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny recipe (backbone pretraining + a two-stage top), run, then run again on the same store."""
    tmp = tmp_path_factory.mktemp("report")
    return _run(tiny_recipe(), tmp, "first"), _run(tiny_recipe(), tmp, "again")


def test_plots_are_titled_by_what_they_show(runs: tuple[Path, Path]) -> None:
    first, _ = runs
    # No single-stage trainer in this run: the epoch-time plot does not promise one.
    assert _title(first / "epoch_time.png") == "seconds per epoch: two-stage"
    # The backbone's pretraining learned other classes: its own row, named so, beside the transfer's.
    assert _title(first / "curves.png") == (
        "training curves: transfer (two_stage); backbone pretraining (backbone)"
    )
    report = (first / "report.md").read_text()
    assert "![seconds per epoch: two-stage](epoch_time.png)" in report
    curves = "training curves: transfer (two_stage); backbone pretraining (backbone)"
    assert f"![{curves}](curves.png)" in report


def test_the_training_time_of_a_trainer_is_in_the_report(runs: tuple[Path, Path]) -> None:
    first, _ = runs
    result = json.loads((first / "summary.json").read_text())["results"]["two_stage"]
    assert "train_seconds" not in result  # finetune records its epochs; the report adds them up
    assert _result_row(first, "two_stage")[6] == f"{sum(result['epoch_seconds_all']):.1f}"  # training s


def test_a_rerun_that_reused_everything_shows_the_stored_training(runs: tuple[Path, Path]) -> None:
    first, again = runs
    stages = json.loads((again / "summary.json").read_text())["stages"]
    assert {s["name"]: s["status"] for s in stages}["two_stage"] == "reused"
    assert {s["name"]: s["status"] for s in stages}["backbone"] == "reused"
    trained, reused = _records(first), _records(again)
    # The stored history, epoch by epoch, marked as reused with the entry it comes from.
    for stage in ("backbone", "two_stage"):
        before = [r for r in trained if r["stage"] == stage]
        after = [r for r in reused if r["stage"] == stage]
        assert [r["epoch"] for r in after] == [r["epoch"] for r in before] and after
        assert [r["train_loss"] for r in after] == [r["train_loss"] for r in before]
        assert [r["val_acc"] for r in after] == [r["val_acc"] for r in before]
        fingerprint = {s["name"]: s["fingerprint"] for s in stages}[stage]
        assert all(r["reused"] is True and fingerprint.startswith(r["entry"]) for r in after)
    assert not any(r.get("reused") for r in trained)
    assert (again / "curves.png").is_file()
    assert _title(again / "curves.png") == _title(first / "curves.png")
    row = _result_row(again, "two_stage")
    assert row[0] == "two_stage (reused)" and row[6] == _result_row(first, "two_stage")[6]
    assert "(reused): trained by an earlier run" in (again / "report.md").read_text()


def test_single_and_two_stage_are_both_named_when_both_ran(tmp_path: Path) -> None:
    recipe = tiny_recipe()
    recipe["stages"]["baseline"] = {
        "type": "finetune", "mode": "single_stage", "model": "backbone", "images": "target_images",
        "train_last_blocks": 7, "batch_size": 32, "train": {"epochs": 1, "lr": 0.01, "optimizer": "adamw"},
    }
    recipe["targets"] = ["baseline", "two_stage"]
    run = _run(recipe, tmp_path, "both")
    assert _title(run / "epoch_time.png") == "seconds per epoch: single-stage (orange) vs two-stage (blue)"
    assert "transfer (baseline, two_stage)" in _title(run / "curves.png")


def test_every_file_of_a_run_is_readable_like_any_new_file(runs: tuple[Path, Path]) -> None:
    mask = os.umask(0o022)  # the mask the runs were made under (umask returns the previous one)
    os.umask(mask)
    for run in runs:
        modes = {p.relative_to(run).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in run.rglob("*")
                 if p.is_file()}
        assert modes == dict.fromkeys(modes, 0o666 & ~mask)
        # The backbone's model file (owner-only, 0600, before) is written where the backbone was trained.
        assert "stages/backbone/model.pt" in modes or run == runs[1]
