"""``python -m pipeline new``: the shipped example recipes written into a folder, never over one's edits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import scaffold
from pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]
REPO_RECIPES = sorted(p.relative_to(ROOT / "recipes").as_posix() for p in (ROOT / "recipes").rglob("*.yaml"))


def test_the_package_ships_exactly_the_repository_recipes() -> None:
    shipped = scaffold.shipped()
    assert sorted(p.as_posix() for p in shipped) == REPO_RECIPES
    for rel, packaged in shipped.items():
        assert packaged.read_bytes() == (ROOT / "recipes" / rel).read_bytes(), rel
    assert {"quickstart", "neuroflux", "mobiletl", "tinytl", "all"} <= set(scaffold.names())


def test_new_quickstart_writes_the_recipe_that_validates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["new", "quickstart", str(tmp_path / "work")]) == 0
    written = tmp_path / "work" / "quickstart.yaml"
    assert written.read_bytes() == (ROOT / "recipes" / "quickstart.yaml").read_bytes()
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["quickstart.yaml"]
    out = capsys.readouterr().out
    assert f"python -m pipeline run {written}" in out
    assert main(["validate", str(written)]) == 0


def test_new_writes_into_the_current_folder_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["new", "neuroflux"]) == 0
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.yaml")) == [
        "neuroflux/digits.yaml",
        "neuroflux/fashion_mnist.yaml",
    ]
    assert main(["new", "all"]) == 0  # the neuroflux files are already there, unchanged: not a clash
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.yaml")) == REPO_RECIPES


def test_an_edited_recipe_is_never_overwritten_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edited = tmp_path / "quickstart.yaml"
    edited.write_text("name: mine\n")
    assert main(["new", "all", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(edited) in err and "--force" in err and "nothing was written" in err
    assert edited.read_text() == "name: mine\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["quickstart.yaml"]  # checked before any write

    assert main(["new", "quickstart", str(tmp_path), "--force"]) == 0
    assert edited.read_bytes() == (ROOT / "recipes" / "quickstart.yaml").read_bytes()
    assert f"overwritten {edited}" in capsys.readouterr().out
    assert main(["new", "quickstart", str(tmp_path)]) == 0  # same bytes again: nothing to refuse
    assert f"unchanged   {edited}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["new", "quikstart"], "no example recipe called 'quikstart'; expected one of: "),
        (["new", "quickstart", "{file}"], "is a file, expected a folder"),
        (["new", "quickstart", "{file}/sub"], "a part of that path is a file"),
    ],
)
def test_bad_names_and_folders_are_exit_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    file = tmp_path / "a_file"
    file.write_text("")
    assert main([a.replace("{file}", str(file)) for a in argv]) == 2
    assert expected in capsys.readouterr().err


def test_a_folder_in_the_way_is_refused_even_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "quickstart.yaml").mkdir()
    assert main(["new", "quickstart", str(tmp_path), "--force"]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_new_needs_no_training_stack(tmp_path: Path) -> None:
    # Like validate: a laptop without torch can prepare recipes for a device.
    blocked = ["torch", "torchvision", "zarr", "numcodecs", "h5py", "tqdm", "matplotlib", "sklearn"]
    script = (
        f"import runpy, sys; sys.modules.update(dict.fromkeys({blocked!r})); "
        f"sys.argv = ['pipeline', 'new', 'quickstart', {str(tmp_path)!r}]; "
        "runpy.run_module('pipeline', run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "quickstart.yaml").is_file()
