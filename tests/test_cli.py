"""The CLI end to end on a shrunken quickstart: run, rerun (reuse), plan, validate, cache ls, bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
import zarr

from pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
# Shrink the quickstart so the suite stays fast; the structure is unchanged.
FAST = ["stages.backbone.train.epochs=1", "stages.two_stage.train.epochs=2", "stages.baseline.train.epochs=1"]


def run_cli(*args: str) -> int:
    return main(list(args))


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("cli")
    store = base / "store"
    store.mkdir()
    first, second = base / "run1", base / "run2"
    assert (
        run_cli(
            "run",
            QUICKSTART,
            *sum((["--set", s] for s in FAST), []),
            "--store",
            str(store),
            "--output",
            str(first),
            "--quiet",
        )
        == 0
    )
    # Downstream-only changes (learning rate, epochs, feature augmentation): the cache is reused.
    assert (
        run_cli(
            "run",
            QUICKSTART,
            *sum((["--set", s] for s in FAST), []),
            "--set",
            "stages.two_stage.train.lr=0.001",
            "--set",
            "stages.augmented_features.crop_padding=1",
            "--store",
            str(store),
            "--output",
            str(second),
            "--quiet",
        )
        == 0
    )
    return {"store": store, "first": first, "second": second}


def stages_by_name(run: Path) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads((run / "summary.json").read_text())["stages"]}


def test_first_run_computes_and_writes_outputs(quick_runs: dict[str, Path]) -> None:
    run = quick_runs["first"]
    summary = json.loads((run / "summary.json").read_text())
    for name in (
        "summary.json",
        "metrics.jsonl",
        "report.md",
        "recipe.resolved.yaml",
        "curves.png",
        "epoch_time.png",
    ):
        assert (run / name).is_file(), name
    stages = stages_by_name(run)
    assert stages["backbone"]["status"] == "computed" and stages["cache"]["status"] == "computed"
    assert stages["cache"]["bytes_written"] > 0
    for s in stages.values():
        assert set(s) >= {"name", "type", "fingerprint", "status", "seconds", "bytes_written"}
    m = summary["metrics"]
    assert {"accuracy", "epoch_seconds", "cache_bytes", "bits"} <= set(m)
    assert summary["results"]["two_stage"]["bits"] == 2 and summary["results"]["baseline"]["bits"] == 32
    assert 0.0 <= m["accuracy"] <= 1.0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in lines} >= {"backbone", "two_stage", "baseline"}


def test_finished_runs_leave_no_reader_threads(quick_runs: dict[str, Path]) -> None:
    # The cache reader reads on into a next training epoch; the run stops it when it ends.
    deadline = time.monotonic() + 5
    while left := [t.name for t in threading.enumerate() if t.name.startswith(("fetch-", "decode-"))]:
        assert time.monotonic() < deadline, f"threads still reading after the runs: {left}"
        time.sleep(0.01)


def test_second_run_reuses_backbone_and_cache(quick_runs: dict[str, Path]) -> None:
    first, second = stages_by_name(quick_runs["first"]), stages_by_name(quick_runs["second"])
    # target_images also feeds the single-stage baseline, which reruns; the frozen forward does not.
    for name in ("backbone", "cache", "features", "quantized"):
        assert second[name]["status"] == "reused", name
        assert second[name]["fingerprint"] == first[name]["fingerprint"]
    assert second["two_stage"]["status"] == "computed"
    assert second["augmented_features"]["fingerprint"] != first["augmented_features"]["fingerprint"]


def test_upstream_change_makes_a_new_entry(
    quick_runs: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    store = str(quick_runs["store"])
    assert (
        run_cli("plan", QUICKSTART, *sum((["--set", s] for s in FAST), []), "--store", store, "--json") == 0
    )
    same = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert same["cache"]["action"] == "reuse" and same["backbone"]["action"] == "reuse"
    assert (
        run_cli(
            "plan",
            QUICKSTART,
            *sum((["--set", s] for s in FAST), []),
            "--set",
            "stages.quantized.bits=4",
            "--store",
            store,
            "--json",
        )
        == 0
    )
    changed = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert changed["cache"]["action"] == "compute" and changed["backbone"]["action"] == "reuse"
    assert changed["cache"]["fingerprint"] != same["cache"]["fingerprint"]
    assert (
        run_cli(
            "plan",
            QUICKSTART,
            *sum((["--set", s] for s in FAST), []),
            "--set",
            "stages.features.train_last_blocks=3",
            "--store",
            store,
            "--json",
        )
        == 0
    )
    cut = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert (
        cut["cache"]["action"] == "compute"
        and cut["features"]["fingerprint"] != same["features"]["fingerprint"]
    )


def test_cache_entry_opens_with_stock_zarr(quick_runs: dict[str, Path]) -> None:
    cache_fp = stages_by_name(quick_runs["first"])["cache"]["fingerprint"]
    group = zarr.open_group(str(quick_runs["store"] / "entries" / cache_fp / "data.zarr"), mode="r")
    codes = group["train/codes"]
    assert codes.dtype == "uint8" and codes.shape[0] == 300  # 60 per class x 5 classes
    assert group["val/x"].dtype == "float16"
    lineage = dict(group.attrs)["lineage"]
    assert lineage["stage"] == "cache" and lineage["meta"]["bits"] == 2 and "cut" in lineage["meta"]


def test_cache_ls_lists_entries(quick_runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert run_cli("cache", "ls", "--store", str(quick_runs["store"])) == 0
    out = capsys.readouterr().out
    assert "quickstart:cache" in out and "quickstart:backbone" in out
    assert "quickstart:two_stage" in out  # a trained result is a stored entry too
    # the settings that tell entries of one recipe stage apart
    cache_line = next(line for line in out.splitlines() if "quickstart:cache" in line)
    assert "2-bit" in cache_line and "mobilenet_v2 top 7 blocks" in cache_line and "32px" in cache_line
    backbone_line = next(line for line in out.splitlines() if "quickstart:backbone" in line)
    assert "mobilenet_v2 x0.35" in backbone_line and "32px" in backbone_line
    assert run_cli("cache", "ls", "--store", str(quick_runs["store"]), "--json") == 0
    rows = {r["stage"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["cache"]["settings"] == {
        "bits": 2, "arch": "mobilenet_v2", "train_last_blocks": 7, "precision": "fp32", "resolution": 32
    }


def test_an_override_of_the_shared_train_settings_leaves_the_baseline_alone(
    quick_runs: dict[str, Path],
) -> None:
    # The second run sets stages.two_stage.train.lr; quickstart's baseline shares that `train:` anchor.
    first, second = stages_by_name(quick_runs["first"]), stages_by_name(quick_runs["second"])
    assert second["baseline"]["fingerprint"] == first["baseline"]["fingerprint"]
    assert second["two_stage"]["fingerprint"] != first["two_stage"]["fingerprint"]
    resolved = yaml.safe_load((quick_runs["second"] / "recipe.resolved.yaml").read_text())
    assert resolved["stages"]["two_stage"]["train"]["lr"] == 0.001
    assert resolved["stages"]["baseline"]["train"]["lr"] == 0.01


def test_the_resolved_recipe_reruns_with_the_same_fingerprints(
    quick_runs: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    run = quick_runs["second"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["overrides"] == [*FAST, "stages.two_stage.train.lr=0.001",
                                    "stages.augmented_features.crop_padding=1"]
    assert set(summary["versions"]) == {"ondevice_tl", "torch", "python"}
    assert summary["status"] == "finished" and summary["skipped_samples"]["total"] == 0
    resolved = run / "recipe.resolved.yaml"
    assert run_cli("validate", str(resolved)) == 0
    capsys.readouterr()
    assert run_cli("plan", str(resolved), "--store", str(quick_runs["store"]), "--json") == 0
    planned = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {n: r["fingerprint"] for n, r in planned.items()} == {
        s["name"]: s["fingerprint"] for s in summary["stages"]
    }
    assert planned["cache"]["action"] == "reuse"


def test_validate_and_plan_text(quick_runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert run_cli("validate", QUICKSTART) == 0
    assert "valid" in capsys.readouterr().out
    assert run_cli("plan", QUICKSTART, "--store", str(quick_runs["store"])) == 0
    assert "frozen_forward" in capsys.readouterr().out


def test_bad_inputs_give_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run_cli("run", str(tmp_path / "missing.yaml")) == 2
    assert "missing.yaml" in capsys.readouterr().err
    # validate checks the cut against the architecture, as plan does
    assert run_cli("validate", QUICKSTART, "--set", "stages.features.train_last_blocks=99") == 2
    assert "0..19" in capsys.readouterr().err
    assert (
        run_cli("plan", QUICKSTART, "--set", "stages.features.train_last_blocks=99", "--store", str(tmp_path))
        == 2
    )
    err = capsys.readouterr().err
    assert "0..19" in err and "train_last_blocks=99" in err
    assert run_cli("plan", QUICKSTART, "--store", str(tmp_path / "no" / "such" / "dir")) == 2
    assert "no/such/dir" in capsys.readouterr().err
    assert run_cli("cache", "ls", "--store", str(tmp_path / "absent")) == 2
    bad = tmp_path / "w.yaml"
    bad.write_text("name: w\nstages:\n  m: {type: backbone, weights: /no/such/weights.pt}\n")
    assert run_cli("plan", str(bad), "--store", str(tmp_path)) == 2
    assert "/no/such/weights.pt" in capsys.readouterr().err


def test_every_shipped_recipe_validates_with_its_stages_resolved(capsys: pytest.CaptureFixture) -> None:
    # validate resolves what plan resolves (data read, nothing written); a dataset this machine lacks
    # is refused as plan refuses it, saying how to get it.
    for recipe in sorted((ROOT / "recipes").rglob("*.yaml")):
        code = run_cli("validate", str(recipe))
        out, err = capsys.readouterr()
        if code == 2 and "fashion_mnist: the idx files" in err:
            assert "apt-get install dataset-fashion-mnist" in err and f"{recipe}: stages." in err, err
            continue
        assert code == 0, f"{recipe}: {err}"
        counts = re.search(r": valid \((\d+) stages, (\d+) resolved;", out)
        assert counts is not None, out
        assert 0 < int(counts[2]) <= int(counts[1]), out


def test_validate_refuses_a_variant_the_way_plan_does(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Found only while resolving: the labels say class 42 is not one of digits' 10.
    argv = [QUICKSTART, "--set", "stages.target_digits.classes=[5,42]"]
    assert run_cli("validate", *argv) == 2
    validated = capsys.readouterr()
    assert run_cli("plan", *argv, "--store", str(tmp_path)) == 2
    planned = capsys.readouterr()
    assert validated.err == planned.err == (
        f"error: {QUICKSTART}: stages.target_digits (split): classes [42] out of range: this dataset has 10 "
        "classes, valid indices are 0..9\n")
    assert validated.out == planned.out == ""
    # a GPU this machine lacks is named with the recipe, by both
    if not torch_cuda_available():
        assert run_cli("validate", QUICKSTART, "--set", "run.device=cuda") == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {QUICKSTART}: run.device: cuda asked for") and err.count("\n") == 1


def torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "validate", QUICKSTART], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr


# Everything heavier than pyyaml + pydantic + numpy that the toolkit imports somewhere.
HEAVY_MODULES = (
    "torch", "torchvision", "zarr", "numcodecs", "crc32c", "h5py", "cv2", "albumentations", "PIL",
    "tqdm", "dask", "distributed", "networkx", "matplotlib", "pymoo", "sklearn", "scipy",
)


def _cli_without(modules: tuple[str, ...], *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m pipeline ARGV`` in a Python where ``modules`` cannot be imported."""
    # ``sys.modules[name] = None`` makes importing it fail as if it were not installed.
    script = (
        f"import runpy, sys; sys.modules.update(dict.fromkeys({list(modules)!r})); "
        f"sys.argv = ['pipeline', *{list(argv)!r}]; "
        "runpy.run_module('pipeline', run_name='__main__')"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)


def test_validate_and_stages_need_only_the_recipe_tools() -> None:
    # A recipe is checked where only pyyaml and pydantic are installed (a laptop preparing
    # recipes for a Pi, a lint job): every shipped recipe validates with the rest blocked.
    recipes = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes").rglob("*.yaml"))
    assert len(recipes) >= 10
    for recipe in recipes:
        out = _cli_without(HEAVY_MODULES, "validate", recipe)
        assert out.returncode == 0, f"{recipe}: {out.stderr}"
        assert f"{recipe}: valid" in out.stdout and "not resolved: torch is not installed" in out.stdout
    out = _cli_without(HEAVY_MODULES, "stages")
    assert out.returncode == 0, out.stderr
    assert "neuroflux" in out.stdout and "finetune" in out.stdout
    # and a typo is still a recipe error there, not a missing-module message
    out = _cli_without(HEAVY_MODULES, "validate", QUICKSTART, "--set", "stages.two_stage.epoks=3")
    assert out.returncode == 2 and "unknown key 'epoks'" in out.stderr


@pytest.mark.parametrize("missing", ["zarr", "torch"])
def test_a_command_that_works_needs_its_libraries_first(missing: str, tmp_path: Path) -> None:
    # Checked before any stage runs: no output directory, no store entry.
    out = _cli_without(
        (missing,), "run", QUICKSTART, "--store", str(tmp_path / "store"), "--output", str(tmp_path / "run")
    )
    assert out.returncode == 2
    assert f"lacks {missing!r}" in out.stderr and "pip install -e ." in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()


def test_memory_command_reports_every_trainer(
    quick_runs: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    assert run_cli("memory", QUICKSTART, "--store", str(quick_runs["store"]), "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["stages"]) >= {"two_stage", "baseline"}
    assert {s["convention"] for s in data["stages"].values() if "convention" in s} == {"mask"}
    argv = ("memory", QUICKSTART, "--store", str(quick_runs["store"]), "--json", "--convention", "map")
    assert run_cli(*argv) == 0
    as_maps = json.loads(capsys.readouterr().out)["stages"]["two_stage"]
    assert as_maps["convention"] == "map"
    # the quickstart's trained blocks have ReLU6s: their maps weigh more than their masks
    assert as_maps["activation_bytes"] > data["stages"]["two_stage"]["activation_bytes"]


def test_memory_command_names_the_valid_conventions(capsys: pytest.CaptureFixture) -> None:
    from pipeline.models.memory import CONVENTIONS

    with pytest.raises(SystemExit) as exit_:
        run_cli("memory", QUICKSTART, "--convention", "paper")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'paper'" in err and all(f"'{c}'" in err for c in CONVENTIONS)
