"""predict and evaluate: the numbers are the model's own, bad images follow the rules, output parses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.cli import main
from pipeline.deploy.evaluate import evaluate, folder_samples, plot_confusion
from pipeline.deploy.model_file import load_model
from pipeline.deploy.predict import image_files, predict
from pipeline.errors import DataError
from tests.deploy.runs import CLASSES


def _logits(loaded: Any, files: list[Path]) -> torch.Tensor:
    with torch.no_grad():
        return loaded(loaded.transform.batch(files))


@pytest.fixture
def with_broken(trained: dict[str, Any], tmp_path: Path) -> Path:
    """apple/ and banana/ with two good images each, and one file in apple/ that is no image."""
    root = tmp_path / "mixed"
    for name in ("apple", "banana"):
        (root / name).mkdir(parents=True)
        for i in range(2):
            shutil.copy(trained["tree"] / name / f"{i:02d}.png", root / name / f"{i:02d}.png")
    (root / "apple" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n but then nothing")
    return root


def test_predict_gives_the_models_top_k_classes(trained: dict[str, Any]) -> None:
    loaded = load_model(trained["run"], stage="baseline")
    files = image_files([trained["tree"] / "apple", trained["tree"] / "cherry" / "03.png"])
    result = predict(loaded, [trained["tree"] / "apple", trained["tree"] / "cherry" / "03.png"], top_k=2)
    assert [p.file for p in result.predictions] == [str(f) for f in files] and not result.skipped
    probs = torch.softmax(_logits(loaded, files), 1)
    for p, row in zip(result.predictions, probs, strict=True):
        order = row.argsort(descending=True)[:2].tolist()
        assert [c for c, _ in p.top] == [CLASSES[i] for i in order]
        assert [v for _, v in p.top] == pytest.approx(row[order].tolist(), abs=1e-6)


def test_unreadable_images_follow_the_models_rule_or_the_callers(
    trained: dict[str, Any], with_broken: Path
) -> None:
    loaded = load_model(trained["run"], stage="baseline")  # trained on an image folder with skip
    skipped = predict(loaded, [with_broken])
    assert len(skipped.predictions) == 4
    assert [s["file"] for s in skipped.skipped] == [str(with_broken / "apple" / "broken.png")]
    with pytest.raises(DataError, match=r"broken\.png: cannot decode image.*on_bad_sample: fail"):
        predict(loaded, [with_broken], on_bad_sample="fail")


def test_predict_cli_json_and_exit_codes(
    trained: dict[str, Any], with_broken: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = str(trained["run"])
    assert main(["predict", run, "--stage", "two_stage", str(with_broken), "--top-k", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["predictions"]) == 4 and len(out["skipped"]) == 1
    assert all(len(p["top"]) == 3 and p["class"] in CLASSES for p in out["predictions"])
    assert main(["predict", run, "--stage", "two_stage", str(with_broken), "--on-bad-sample", "fail"]) == 2
    assert "broken.png" in capsys.readouterr().err
    assert main(["predict", run, "--stage", "two_stage", str(with_broken / "nothing.png")]) == 2
    assert "image not found" in capsys.readouterr().err
    assert main(["predict", run, "--stage", "two_stage", str(with_broken)]) == 0
    text = capsys.readouterr().out
    assert "4 image(s) classified" in text and "1 unreadable skipped" in text


def test_evaluate_on_a_folder_counts_what_the_model_predicts(trained: dict[str, Any], tmp_path: Path) -> None:
    loaded = load_model(trained["run"], stage="two_stage")
    result = evaluate(loaded, folder_samples(loaded, trained["tree"], None, None))
    files = image_files([trained["tree"] / c for c in CLASSES])
    truth = np.repeat(np.arange(len(CLASSES)), 12)
    predicted = _logits(loaded, files).argmax(1).numpy()
    expected = np.zeros((3, 3), np.int64)
    np.add.at(expected, (truth, predicted), 1)
    assert (result.confusion == expected).all()
    assert result.accuracy == pytest.approx(float((predicted == truth).mean()))
    per_class = result.per_class()
    assert per_class["apple"]["samples"] == 12
    assert per_class["apple"]["accuracy"] == pytest.approx(float((predicted[:12] == 0).mean()))
    png = plot_confusion(result, tmp_path / "cm.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_folder_rules(trained: dict[str, Any], with_broken: Path, tmp_path: Path) -> None:
    loaded = load_model(trained["run"], stage="two_stage")
    data = folder_samples(loaded, with_broken, None, None)  # the model's rule: skip
    assert data.skipped == [str(with_broken / "apple" / "broken.png")] and len(data.labels) == 4
    with pytest.raises(DataError, match="broken.png"):
        folder_samples(loaded, with_broken, None, "fail")
    (with_broken / "durian").mkdir()
    shutil.copy(trained["tree"] / "apple" / "00.png", with_broken / "durian" / "x.png")
    with pytest.raises(DataError, match=r"classes \['durian'\] are not classes of the model"):
        folder_samples(loaded, with_broken, None, None)
    split_tree = tmp_path / "splits"
    for split, n in (("train", 1), ("test", 2)):
        for name in ("banana", "cherry"):
            (split_tree / split / name).mkdir(parents=True)
            for i in range(n):
                shutil.copy(trained["tree"] / name / f"{i:02d}.png", split_tree / split / name / f"{i}.png")
    chosen = folder_samples(loaded, split_tree, None, None)
    assert chosen.source.endswith("(test)") and sorted(chosen.labels.tolist()) == [1, 1, 2, 2]


def test_evaluate_cli_on_a_recipe_and_a_folder(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, recipe = str(trained["run"]), str(trained["recipe"])
    plot = tmp_path / "cm.png"
    assert main(["evaluate", run, recipe, "--stage", "baseline", "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    metrics = trained["reports"]["baseline"].metrics
    assert out["samples"] == metrics["test_samples"] and out["data"].endswith("stage split (test)")
    assert set(out["per_class"]) == set(CLASSES) and plot.is_file() and out["plot"] == str(plot)
    assert main(["evaluate", run, str(trained["tree"]), "--stage", "baseline"]) == 0
    text = capsys.readouterr().out
    assert "36 images, accuracy" in text and "confusion matrix:" in text
    assert (trained["run"] / "stages" / "baseline" / "confusion_images.png").is_file()
    assert main(["evaluate", run, recipe, "--stage", "baseline", "--data", "splt"]) == 2
    assert "did you mean 'split'" in capsys.readouterr().err
    assert main(["evaluate", run, str(tmp_path / "none"), "--stage", "baseline"]) == 2
    assert "evaluation data not found" in capsys.readouterr().err
