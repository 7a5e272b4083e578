"""A new user with an image folder and no internet: `new own-data` writes a recipe sized to the folder, the
README's commands take it to a first prediction, and a missing weights file says the ways on."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from pipeline import scaffold
from pipeline.cli import main
from tests.deploy.runs import CLASSES, write_image_tree

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _folder(root: Path, size: tuple[int, int], classes: int = 3, mode: str = "RGB") -> Path:
    """root/class_<c>/<i>.png: four noise images of ``size`` (width, height) per class."""
    rng = np.random.default_rng(0)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(4):
            pixels = rng.integers(0, 255, shape, dtype=np.uint8)
            Image.fromarray(pixels, mode).save(root / f"class_{c}" / f"{i}.png")
    return root


@pytest.mark.parametrize(
    ("size", "mode", "resolution", "small_input"),
    [((28, 28), "L", 32, True), ((60, 50), "RGB", 64, True), ((640, 480), "RGB", 128, False)],
    ids=["28px-gray", "50px", "480px"],
)
def test_the_recipe_is_sized_to_the_folders_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    size: tuple[int, int], mode: str, resolution: int, small_input: bool,
) -> None:
    _folder(tmp_path / "pics", size, mode=mode)
    monkeypatch.chdir(tmp_path)
    assert main(["new", "own-data", "pics"]) == 0
    out = capsys.readouterr().out
    assert f"written     pics.yaml (pics: 3 classes, 12 images, median shorter side {min(size)} px -> " \
           f"{resolution} px, batch 16" in out
    assert "next: python -m pipeline run pics.yaml" in out
    recipe = yaml.safe_load((tmp_path / "pics.yaml").read_text())
    stages = recipe["stages"]
    assert stages["photos"] == {"type": "image_folder", "root": "pics", "on_bad_sample": "skip"}
    backbone = stages["backbone"]
    assert backbone["type"] == "pretrain" and backbone["input"] == "split"  # no weights file needed
    assert (backbone["resolution"], backbone["small_input"]) == (resolution, small_input)
    assert stages["images"]["resolution"] == resolution
    assert backbone["batch_size"] == 16 and backbone["train"]["epochs"] == 30  # 8 training images: 30 epochs
    assert recipe["targets"] == ["two_stage"] and stages["two_stage"]["model"] == "backbone"
    assert main(["validate", "pics.yaml"]) == 0, capsys.readouterr().err


def test_batch_and_epochs_follow_the_folders_size() -> None:
    survey = scaffold.FolderSurvey(Path("x"), ["a", "b"], {"train": 1000}, 28)
    chosen = scaffold.choose_settings(survey)  # 700 training images after the 70/15/15 split
    assert (chosen.batch_size, chosen.pretrain_epochs, chosen.width_mult) == (32, 11, 0.35)
    split = {"train": 5000, "test": 500}  # the folder's own test split: all of train/ trains
    big = scaffold.choose_settings(scaffold.FolderSurvey(Path("x"), ["a", "b"], split, 300))
    assert (big.batch_size, big.pretrain_epochs, big.width_mult, big.resolution) == (32, 5, 0.5, 128)


@pytest.mark.parametrize(
    ("make", "argv", "expected"),
    [
        (lambda t: None, ["new", "own-data", "nowhere"],
         "nowhere does not exist: `new own-data` takes a folder"),
        (lambda t: _folder(t / "one", (8, 8), classes=1), ["new", "own-data", "one"],
         "a classifier needs at least two class folders"),
        (lambda t: (_folder(t / "gap", (8, 8)), (t / "gap" / "empty").mkdir()), ["new", "own-data", "gap"],
         "class folder empty hold no .jpg/.jpeg/.png images"),
        (lambda t: None, ["new", "own-data"], "needs the image folder as its argument, from outside it"),
    ],
    ids=["missing", "one-class", "empty-class", "no-folder"],
)
def test_a_folder_that_cannot_make_a_recipe_is_refused_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], object], argv: list[str], expected: str,
) -> None:
    make(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert expected in capsys.readouterr().err
    assert not list(tmp_path.glob("*.yaml"))


def test_an_edited_recipe_is_kept_unless_forced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _folder(tmp_path / "pics", (8, 8))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pics.yaml").write_text("name: mine\n")
    assert main(["new", "own-data", "pics"]) == 2
    assert "pics.yaml already exists with other content; nothing was written" in capsys.readouterr().err
    assert (tmp_path / "pics.yaml").read_text() == "name: mine\n"
    assert main(["new", "own-data", "pics", "--force"]) == 0
    assert "overwritten pics.yaml" in capsys.readouterr().out
    assert main(["new", "own-data", "pics"]) == 0
    assert "unchanged   pics.yaml" in capsys.readouterr().out


def _own_data_commands() -> list[list[str]]:
    """The README's offline commands (the bash block with `new own-data`), as argv lists for main()."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) if "new own-data" in b]
    return [shlex.split(line.split("#")[0])[3:] for line in block.strip().splitlines()]


def test_the_readmes_offline_path_runs_from_a_folder_to_a_prediction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    new, run, predict = _own_data_commands()
    assert new == ["new", "own-data", "photos"] and run == ["run", "photos.yaml"]
    assert predict[0] == "predict" and predict[2:4] == ["--stage", "two_stage"]
    write_image_tree(tmp_path / "photos")
    monkeypatch.chdir(tmp_path)
    assert main(new) == 0
    # The README's commands as they are, the work shrunk to seconds (one epoch each, one thread).
    fast = ["--set", "stages.backbone.train.epochs=1", "--set", "stages.two_stage.train.epochs=1",
            "--set", "run.threads=1", "--store", str(tmp_path / "store"), "--quiet"]
    assert main(run + fast) == 0, capsys.readouterr().err
    (run_dir,) = (tmp_path / "runs" / "photos").iterdir()  # what "$(ls -d runs/photos/* | tail -1)" names
    capsys.readouterr()
    image = tmp_path / "photos" / "banana" / "00.png"
    assert main([predict[0], str(run_dir), *predict[2:4], str(image)]) == 0
    (line, _) = capsys.readouterr().out.splitlines()
    assert line.startswith(str(image)) and line.split()[1] in CLASSES


def test_a_missing_weights_file_names_the_path_and_the_ways_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S) if "image_folder" in b]
    weights = yaml.safe_load(block)["stages"]["backbone"]["weights"]
    write_image_tree(tmp_path / "photos", per_class=4)
    (tmp_path / "flowers.yaml").write_text(block)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "flowers.yaml", "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    looked = f"weights file not found: {weights} (looked for {tmp_path / weights})"
    assert f"stages.backbone (backbone): {looked}" in err
    assert "a `pretrain` stage" in err and "`python -m pipeline new own-data FOLDER`" in err
    assert "`weights: random`" in err
