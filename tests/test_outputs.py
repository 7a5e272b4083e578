"""Outputs are never overwritten, and a budget that cannot hold a run is refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from tests.sweep.recipes import tiny_recipe


@pytest.fixture()
def recipe(tmp_path: Path) -> Path:
    data = tiny_recipe()
    data["targets"] = ["cache"]  # a backbone and a cache: seconds
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(*args: str) -> int:
    return main(["run", *args, "--quiet"])


def test_a_run_into_a_used_output_is_refused_unless_forced(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, out = tmp_path / "store", tmp_path / "run"
    assert run(str(recipe), "--store", str(store), "--output", str(out)) == 0
    (out / "stages" / "leftover").mkdir(parents=True)  # as an earlier run's trainer folder would be
    before = json.loads((out / "summary.json").read_text())
    capsys.readouterr()
    assert run(str(recipe), "--store", str(store), "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert f"--output {out} holds another run (recipe 'tiny-sweep', finished" in err and "--force" in err
    assert json.loads((out / "summary.json").read_text()) == before  # untouched
    assert run(str(recipe), "--store", str(store), "--output", str(out), "--force") == 0
    assert not (out / "stages" / "leftover").exists()  # nothing of the older run beside the new one
    assert json.loads((out / "summary.json").read_text())["created"] >= before["created"]


@pytest.mark.parametrize("what", ["file", "foreign", "readonly"])
def test_an_output_that_is_not_a_run_directory_is_named(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    out = tmp_path / "out"
    if what == "file":
        out.write_text("x")
        expected = "is a file, not a directory"
    elif what == "foreign":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        expected = "holds files that are not a run's (notes.txt)"
    else:
        import os

        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        out.mkdir()
        out.chmod(0o500)
        expected = "not writable"
    code = run(str(recipe), "--store", str(tmp_path / "store"), "--output", str(out))
    err = capsys.readouterr().err
    assert code == 2 and f"{out}" in err and expected in err, err
    assert "--output" in err or what == "readonly"
    if what == "foreign":
        assert (out / "notes.txt").read_text() == "mine"


def test_a_budget_that_cannot_hold_the_run_is_refused_before_any_work(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    code = run(str(recipe), "--store", str(store), "--output", str(tmp_path / "run"), "--max-bytes", "1")
    err = capsys.readouterr().err
    assert code == 2 and "store budget (1 B, --max-bytes / store.max_bytes) cannot hold" in err, err
    assert "cache ~" in err  # the entries it plans, with their estimated sizes
    record = json.loads((tmp_path / "run" / "summary.json").read_text())  # as any run that stops says
    assert record["status"] == "failed" and "cannot hold" in json.dumps(record["failure"])
    entries = list((store / "entries").iterdir()) if (store / "entries").exists() else []
    staging = list((store / "staging").iterdir()) if (store / "staging").exists() else []
    assert entries == [] and staging == []  # nothing was computed


def test_two_runs_in_one_second_get_their_own_directories(recipe: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = str(tmp_path / "store")
    assert run(str(recipe), "--store", store) == 0
    assert run(str(recipe), "--store", store) == 0  # the second reuses all: often within the same second
    dirs = sorted((tmp_path / "runs" / "tiny-sweep").iterdir())
    assert len(dirs) == 2 and all((d / "summary.json").is_file() for d in dirs)
