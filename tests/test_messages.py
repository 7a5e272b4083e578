"""Messages a careless user meets, each one they can act on (issue: same recipe, same bytes, item 7)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline import cli
from pipeline.cli import main
from pipeline.errors import Terminated
from stores.catalog import Catalog

ROOT = Path(__file__).resolve().parents[1]


def png(path: Path) -> Path:
    from PIL import Image

    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(path, format="PNG")  # whatever the file is named
    return path


@pytest.mark.parametrize("name", ["photo.png", "model.pt"])
def test_an_image_given_as_the_model_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    image = png(tmp_path / name)
    assert main(["predict", str(image), str(image)]) == 2
    err = capsys.readouterr().err
    assert f"{image} is a PNG image, not a model file: the model comes first" in err, err
    assert "weights_only" not in err  # never the advice to load a file of unknown origin unsafely


def test_a_file_torch_cannot_load_safely_gets_no_unsafe_advice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"\x80\x04garbage that is no pickle a weights-only load accepts")
    assert main(["predict", str(bad), str(png(tmp_path / "x.png"))]) == 2
    err = capsys.readouterr().err
    assert f"cannot read model file {bad}" in err and "weights_only" not in err, err


def test_cache_rm_of_an_entry_in_use_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    catalog = Catalog(tmp_path / "store")
    fp = "ab" * 32
    with catalog.stage(fp, "model", {}) as staging:
        (staging.path / "weights.pt").write_bytes(b"w")
        staging.commit()
    with catalog.use(fp):
        assert main(["cache", "rm", fp[:12], "--store", str(tmp_path / "store")]) == 1
    err = capsys.readouterr().err
    assert "pass --force" in err and "force=True" not in err, err


def test_cache_ls_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    Catalog(tmp_path / "store")
    script = (f"{sys.executable} -m pipeline cache ls --store {tmp_path / 'store'} | head -c 1 > /dev/null; "
              "exit ${PIPESTATUS[0]}")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "Broken pipe" not in done.stderr and done.stderr == "", done.stderr


@pytest.mark.parametrize(("command", "builds"), [("validate", False), ("run", True)])
def test_an_interruption_speaks_of_builds_only_for_commands_that_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str,
    builds: bool,
) -> None:
    def terminated(args: object) -> int:
        raise Terminated

    monkeypatch.setitem(cli.COMMANDS, command, terminated)
    recipe = ROOT / "recipes" / "quickstart.yaml"
    assert main([command, str(recipe)]) == 143
    err = capsys.readouterr().err
    assert err.startswith("terminated (SIGTERM)")
    assert ("cache build" in err) == builds, err
