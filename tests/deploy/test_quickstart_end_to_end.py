"""The quickstart as a user runs it: train, then predict, evaluate and export what it trained."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from pipeline.cli import main
from pipeline.deploy.model_file import MODEL_FILE, load_model
from tests.deploy.runs import run_stock

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
FAST = ["stages.backbone.train.epochs=1", "stages.two_stage.train.epochs=2", "stages.baseline.train.epochs=1",
        "stages.target_digits.per_class=20"]


def digit_pngs(folder: Path, per_digit: int = 2) -> list[Path]:
    """Target-class digits (5-9) as 8x8 grayscale PNGs, as a user's own files would be."""
    digits = load_digits()
    folder.mkdir(parents=True)
    paths = []
    for d in range(5, 10):
        for i in np.flatnonzero(digits.target == d)[:per_digit]:
            path = folder / f"{d}_{i}.png"
            Image.fromarray((digits.images[i] * 255 / 16).astype(np.uint8)).save(path)
            paths.append(path)
    return paths


def test_train_then_predict_evaluate_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, store = tmp_path / "run", tmp_path / "store"
    sets = sum((["--set", s] for s in FAST), [])
    assert main(["run", QUICKSTART, *sets, "--store", str(store), "--output", str(run), "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    for stage in ("backbone", "baseline", "two_stage"):
        assert (run / "stages" / stage / MODEL_FILE).is_file(), stage
    capsys.readouterr()

    # evaluate on the recipe's own test split: the run's accuracy, from the model file alone
    assert main(["evaluate", str(run), QUICKSTART, "--stage", "baseline", *sets, "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    baseline = summary["results"]["baseline"]
    assert evaluated["samples"] == baseline["test_samples"]
    assert evaluated["accuracy"] == pytest.approx(baseline["accuracy"], abs=1.01 / evaluated["samples"])
    assert Path(evaluated["plot"]).is_file()

    # predict on image files: the target classes' names
    images = digit_pngs(tmp_path / "mine")
    assert main(["predict", str(run), "--stage", "two_stage", str(tmp_path / "mine"), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["predictions"]
    assert len(predicted) == len(images) and {p["class"] for p in predicted} <= {"5", "6", "7", "8", "9"}

    # export, then run the exported file in stock torch on those images: the model file's logits
    assert main(["export", str(run), "--stage", "two_stage"]) == 0
    exported = run / "stages" / "two_stage" / "model.pt2"
    loaded = load_model(run, stage="two_stage")
    x = loaded.transform.batch(images)
    with torch.no_grad():
        torch.save({"x": x, "logits": loaded(x)}, tmp_path / "mine.pt")
    full, first3, toolkit = run_stock("pt2", exported, tmp_path / "mine.pt", tmp_path)
    assert full <= 1e-4 and first3 <= 1e-4 and toolkit == "[]"
