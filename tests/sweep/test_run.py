"""Sweeps that train: tables and the best model, a killed sweep resumed, Dask against local, the CLI.

The pretrained backbone and the cache are built once for the module (``upstream``); each test
copies that store, so its trainings are its own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import pipeline
from pipeline.cli import main
from pipeline.sweep import execute, run_sweep
from pipeline.sweep.grid import GridError

from .recipes import CUT, EPOCHS, LR, write_tiny


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny recipe, a store holding its backbone and cache)."""
    base = tmp_path_factory.mktemp("sweep")
    recipe = write_tiny(base / "tiny.yaml")
    pipeline.run(recipe, ["targets=[cache]"], store=base / "store", output=base / "upstream", quiet=True)
    return recipe, base / "store"


def store_copy(upstream: tuple[Path, Path], tmp_path: Path) -> Path:
    shutil.copytree(upstream[1], tmp_path / "store")
    return tmp_path / "store"


def summary(sweep_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    return json.loads((sweep_dir / record["run_dir"] / "summary.json").read_text())


def test_a_sweep_writes_its_table_plot_and_best_model(
    upstream: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, out = store_copy(upstream, tmp_path), tmp_path / "sweep"
    code = main(["sweep", str(upstream[0]), "--grid", f"{LR}=0.003,0.05", "--set", f"{EPOCHS}=1",
                 "--store", str(store), "--output", str(out), "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out.splitlines()
    # The plan first: the backbone and the cache are stored, so only the two trainings run.
    assert printed[0] == ("sweep of tiny-sweep: 2 variants: 0 frozen forwards to run (one per distinct "
                          "upstream); 0 cache builds, 0 backbones to train, 2 trainings; already stored, "
                          "reused: 1 frozen forward, 1 cache, 1 backbone")
    assert printed[-1].startswith("sweep of tiny-sweep: 2/2 variants finished")
    data = json.loads((out / "sweep.json").read_text())
    records = data["variants"]
    assert [r["status"] for r in records] == ["finished", "finished"]
    assert [r["values"] for r in records] == [{LR: 0.003}, {LR: 0.05}]
    for r in records:
        stages = summary(out, r)["stages"]
        assert {s["name"]: s["status"] for s in stages}["cache"] == "reused"
        assert r["trained"] == "computed" and 0 <= r["val_accuracy"] <= 1 and r["memory_total_bytes"] > 0
        assert r["val_accuracy"] == summary(out, r)["results"]["two_stage"]["best_val_accuracy"]
    csv_lines = (out / "sweep.csv").read_text().splitlines()
    assert csv_lines[0].startswith(f"variant,{LR},val_accuracy,test_accuracy") and len(csv_lines) == 3
    table = (out / "sweep.md").read_text()
    assert "| rank | variant | stages.two_stage.train.lr | val acc |" in table and "![sweep.png]" in table
    assert (out / "sweep.png").stat().st_size > 0
    best = json.loads((out / "best" / "variant.json").read_text())
    assert best["id"] == data["best"]
    ranked = sorted(records, key=lambda r: (-r["val_accuracy"], -r["test_accuracy"], r["index"]))
    assert best["id"] == ranked[0]["id"]
    model = pipeline.load_model(out / "best" / "model.pt")
    assert model.metadata["produced_by"]["fingerprint"] == best["target_fingerprint"]


@pytest.mark.slow
def test_a_killed_sweep_resumes_without_rerunning_finished_variants(
    upstream: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, out = store_copy(upstream, tmp_path), tmp_path / "sweep"
    calls: list[str] = []
    kill_at = ["002"]
    real = execute.run_variant

    def killed_at_the_second(recipe: Any, source: str, store: str | None, run_dir: str, quiet: bool) -> Any:
        calls.append(Path(run_dir).name)
        if calls[-1] in kill_at:
            kill_at.clear()
            raise KeyboardInterrupt  # as Ctrl-C in the middle of the second variant
        return real(recipe, source, store, run_dir, quiet)

    monkeypatch.setattr(execute, "run_variant", killed_at_the_second)
    args: dict[str, Any] = {"overrides": [f"{EPOCHS}=1"], "store": store, "output": out, "quiet": True}
    grid = [f"{LR}=0.002,0.02,0.2"]
    with pytest.raises(KeyboardInterrupt):
        run_sweep(upstream[0], grid, **args)
    first = json.loads((out / "variants" / "001" / "variant.json").read_text())
    data = json.loads((out / "sweep.json").read_text())
    assert [r["status"] for r in data["variants"]] == ["finished", "interrupted", "pending"]
    assert (out / "sweep.md").is_file() and not (out / "variants" / "003").exists()

    calls.clear()
    echoed: list[str] = []
    result = run_sweep(upstream[0], grid, echo=echoed.append, **args)
    assert calls == ["002", "003"]  # the finished variant is not run again
    assert "resuming" in echoed[1] and "1 of 3 variants finished before" in echoed[1]
    assert [r["status"] for r in result.variants] == ["finished"] * 3
    assert json.loads((out / "variants" / "001" / "variant.json").read_text()) == first

    # A record is trusted only for the overrides it was made with: a poisoned one is run again,
    # and its training, stored, is reused rather than repeated.
    calls.clear()
    poisoned = {**first, "overrides": [f"{LR}=0.5"]}
    (out / "variants" / "001" / "variant.json").write_text(json.dumps(poisoned))
    result = run_sweep(upstream[0], grid, resume=out, **{k: v for k, v in args.items() if k != "output"})
    assert calls == ["001"]
    assert result.variants[0]["trained"] == "reused"
    assert result.variants[0]["val_accuracy"] == first["val_accuracy"]


@pytest.mark.slow
def test_dask_and_local_sweeps_give_the_same_table(upstream: tuple[Path, Path], tmp_path: Path) -> None:
    """From empty stores: the Dask sweep builds the shared backbone and cache first, here, and the
    workers only train; seeded one-thread CPU training gives the same numbers in either place."""
    grid = [f"{LR}=0.003,0.05", f"{EPOCHS}=1,2"]
    local = run_sweep(upstream[0], grid, store=tmp_path / "a", output=tmp_path / "local", quiet=True)
    on_dask = run_sweep(upstream[0], grid, store=tmp_path / "b", output=tmp_path / "dask", quiet=True,
                        executor="dask", workers=2)
    assert (tmp_path / "dask" / "shared" / "001" / "summary.json").is_file()
    assert not (tmp_path / "local" / "shared").exists()
    for a, b in zip(local.variants, on_dask.variants, strict=True):
        assert a["status"] == b["status"] == "finished" and a["values"] == b["values"]
        assert a["target_fingerprint"] == b["target_fingerprint"]
        assert (a["val_accuracy"], a["test_accuracy"]) == (b["val_accuracy"], b["test_accuracy"])
        ra, rb = (summary(d.sweep_dir, r)["results"]["two_stage"] for d, r in ((local, a), (on_dask, b)))
        assert ra["train_loss_all"] == rb["train_loss_all"]
        # On Dask the cache was built before the task started: the workers only trained.
        assert {s["name"]: s["status"] for s in summary(on_dask.sweep_dir, b)["stages"]}["cache"] == "reused"
        assert b["trained"] == "computed"
    assert local.best is not None and on_dask.best is not None and local.best["id"] == on_dask.best["id"]


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("args", "message"), [
    (["--grid", "stages.two_stage.train.lrr=0.1"], "did you mean 'lr'"),
    (["--grid", f"{LR}=0.1,0.1"], "given twice"),
    (["--grid", f"{LR}=0.1", "--grid", f"{LR}=0.2"], "the key is given twice"),
    ([], "the grid is empty"),
    (["--grid", f"{LR}=0.1,slow"], f"variant 002 ({LR}=slow)"),
    (["--grid", f"{CUT}=7,99"], f"variant 002 ({CUT}=99): invalid recipe"),
    (["--grid", "stages.target_digits.classes=[5,6],[5,5]"], "cannot be planned:\n  variant 002 "),
    (["--grid", f"{LR}=0.1", "--address", "tcp://127.0.0.1:1"], "--address is for --executor dask"),
    (["--grid", f"{LR}=0.1", "--resume", "OUT"], "no sweep.json there"),
    (["--grid", f"{LR}=0.1", "--resume", "elsewhere"], "name two directories"),
])
def test_bad_input_exits_2_before_any_work(
    upstream: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
    message: str,
) -> None:
    out = tmp_path / "sweep"
    args = [str(out) if a == "OUT" else a for a in args]
    code = main(["sweep", str(upstream[0]), *args, "--store", str(tmp_path / "store"), "--output", str(out)])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_random_must_be_a_positive_count(
    upstream: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(upstream[0]), "--grid", f"{LR}=0.1", "--random", "0"])
    assert exit_.value.code == 2 and "expected a whole number >= 1" in capsys.readouterr().err


def test_plan_only_prints_the_plan_and_runs_nothing(
    upstream: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep"
    code = main(["sweep", str(upstream[0]), "--grid", f"{LR}=0.1,0.2,0.3", "--random", "5", "--plan",
                 "--store", str(tmp_path / "empty"), "--output", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and not out.exists()
    assert "--random 5 asks for more variants than the grid has (3)" in printed
    assert "3 variants: 1 frozen forward to run" in printed and "3 trainings" in printed


def test_a_sweep_directory_of_another_recipe_is_refused(upstream: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"recipe": "other"}))
    with pytest.raises(GridError, match="holds another sweep \\(recipe 'other'.*--force"):
        run_sweep(upstream[0], [f"{LR}=0.1"], store=tmp_path / "store", output=out, plan_only=True)


def test_a_second_sweep_into_a_used_output_loses_nothing(
    upstream: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, out = store_copy(upstream, tmp_path), tmp_path / "sweep"
    grid = [f"{LR}=0.003,0.01"]
    first = run_sweep(upstream[0], grid, store=store, output=out, quiet=True, echo=lambda m: None)
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    # another grid: refused before any work, naming what is there and the ways out
    other = ["sweep", str(upstream[0]), "--grid", f"{LR}=0.03", "--store", str(store), "--output", str(out),
             "--quiet"]
    code = main(other)
    err = capsys.readouterr().err
    assert code == 2 and "holds another sweep" in err and "2 of 2 variants finished" in err, err
    assert "--force" in err
    after = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert after == before  # nothing written, nothing lost
    # the same grid: resumed, its finished variants kept
    again = run_sweep(upstream[0], grid, store=store, output=out, quiet=True, echo=lambda m: None)
    assert [v["val_accuracy"] for v in again.variants] == [v["val_accuracy"] for v in first.variants]
    # --force: the other grid replaces it whole (no variant of the old grid left behind)
    assert main([*other, "--force"]) == 0
    data = json.loads((out / "sweep.json").read_text())
    assert [v["overrides"] for v in data["variants"]] == [[f"{LR}=0.03"]]
    assert sorted(p.name for p in (out / "variants").iterdir()) == ["001"]


def test_a_sweep_into_a_file_or_a_foreign_folder_is_refused(
    upstream: tuple[Path, Path], tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(GridError, match="is a file, not a directory"):
        run_sweep(upstream[0], [f"{LR}=0.1"], store=tmp_path / "store", output=tmp_path / "file",
                  plan_only=True)
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_text("x")
    with pytest.raises(GridError, match="is not empty and holds no sweep \\(a.jpg\\)"):
        run_sweep(upstream[0], [f"{LR}=0.1"], store=tmp_path / "store", output=tmp_path / "photos",
                  plan_only=True)
