"""Run records and the CLI's handling of the environment (issue 23): a run that fails, is interrupted or is
terminated (SIGTERM) still leaves summary.json and report.md saying where and why; summary.json carries the
versions, overrides and skipped-sample counts; store paths and permissions fail before work with the fix;
`--max-bytes 0` is `store.max_bytes: 0`; a random backbone is announced; `validate` checks cuts."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from PIL import Image

from pipeline.cli import main
from tests.helpers import ROOT, run_pipeline, start_pipeline

QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")


def tiny_recipe(tmp: Path, *, samples: int = 64, weights: str | None = "random", name: str = "tiny",
                source: dict | None = None, **extra: object) -> Path:
    """Synthetic images -> first block of a small MobileNetV2 -> float cache: seconds, no training."""
    model: dict[str, object] = {"type": "backbone", "arch": "mobilenet_v2", "width_mult": 0.35,
                                "small_input": True, "num_classes": 4, "resolution": 32}
    if weights is not None:
        model["weights"] = weights
    data = {
        "name": name,
        "stages": {
            "data": source or {"type": "synthetic", "num_samples": samples, "num_classes": 4, "size": 32},
            "split": {"type": "split", "input": "data", "val_fraction": 0.1, "test_fraction": 0.1},
            "model": model,
            "images": {"type": "decode", "input": "split", "resolution": 32, "batch_size": 64},
            "features": {
                "type": "frozen_forward", "input": "images", "model": "model", "train_last_blocks": 18
            },
            "float": {"type": "quantize", "input": "features", "bits": 32, "eval_bits": 32},
            "cache": {"type": "cache", "input": "float", "chunk_bytes": 262144},
        },
        "run": {"threads": 1},
        "targets": ["cache"],
        **extra,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def summary_of(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


# ------------------------------------------------------------------------------ SIGTERM, failures
@pytest.mark.parametrize(
    ("sig", "code", "status", "said"),
    [
        (signal.SIGTERM, 143, "terminated", "terminated (SIGTERM)"),
        (signal.SIGINT, 130, "interrupted", "interrupted"),
    ],
)
def test_sigterm_and_ctrl_c_write_the_run_record(
    tmp_path: Path, sig: signal.Signals, code: int, status: str, said: str
) -> None:
    path = tiny_recipe(tmp_path, samples=2500)
    store, out = tmp_path / "store", tmp_path / "run"
    store.mkdir()
    proc = start_pipeline(path, store, out, "--quiet")
    deadline = time.monotonic() + 300
    # Wait until the cache is being written, then terminate as systemd or docker would.
    while time.monotonic() < deadline and proc.poll() is None:
        if sum(1 for _ in (store / "staging").rglob("c/*")) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the build finished before it could be terminated"
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert said in err and "Traceback" not in err
    summary = summary_of(out)
    assert summary["status"] == status
    assert summary["failure"]["stage"] == "cache" and summary["failure"]["error"] == (
        "Terminated" if sig == signal.SIGTERM else "KeyboardInterrupt"
    )
    assert {s["name"] for s in summary["stages"]} >= {"data", "split"}  # what finished before
    report = (out / "report.md").read_text()
    assert f"The run {status}** in stage `cache`" in report
    assert (out / "recipe.resolved.yaml").is_file()


def test_a_failed_run_records_the_failing_stage_and_message(tmp_path: Path) -> None:
    # A budget of 0 bytes refuses the cache entry when the cache stage starts building it.
    path = tiny_recipe(tmp_path, store={"max_bytes": 0})
    store, out = tmp_path / "store", tmp_path / "run"
    store.mkdir()
    proc = run_pipeline(path, store, out, "--quiet")
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr
    summary = summary_of(out)
    assert summary["status"] == "failed"
    failure = summary["failure"]
    assert failure["stage"] == "cache" and failure["message"] and failure["message"] in proc.stderr
    assert "failed in stage cache" in summary["summary_line"]
    assert "failed" in (out / "report.md").read_text()


def test_a_run_failing_while_its_stages_resolve_still_records_the_stage(tmp_path: Path) -> None:
    path = tiny_recipe(tmp_path, source={"type": "image_folder", "root": str(tmp_path / "no-such-folder")})
    out = tmp_path / "run"
    assert main(["run", str(path), "--store", str(tmp_path), "--output", str(out), "--quiet"]) == 2
    summary = summary_of(out)
    assert summary["status"] == "failed" and summary["failure"]["stage"] == "data"
    assert "no-such-folder" in summary["failure"]["message"]


def test_max_bytes_0_on_the_command_line_is_store_max_bytes_0(tmp_path: Path) -> None:
    in_recipe = run_pipeline(tiny_recipe(tmp_path, name="a", store={"max_bytes": 0}), tmp_path / "s1",
                             tmp_path / "o1", "--quiet")
    (tmp_path / "s2").mkdir()
    on_cli = run_pipeline(tiny_recipe(tmp_path, name="a"), tmp_path / "s2", tmp_path / "o2", "--quiet",
                          "--max-bytes", "0")
    assert on_cli.returncode == in_recipe.returncode != 0
    assert "budget" in on_cli.stderr
    assert on_cli.stderr.replace("s2", "s1").replace("o2", "o1") == in_recipe.stderr


# ---------------------------------------------------------------------------------- run records
def test_summary_records_versions_overrides_and_skipped_samples(tmp_path: Path) -> None:
    import torch

    folder = tmp_path / "images"
    for cls in ("a", "b"):
        (folder / cls).mkdir(parents=True)
        for i in range(6):
            colour = (40 * i, 100 if cls == "a" else 200, 0)
            Image.new("RGB", (16, 16), colour).save(folder / cls / f"{i}.png")
    (folder / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    source = {"type": "image_folder", "root": str(folder), "on_bad_sample": "skip"}
    path = tiny_recipe(tmp_path, source=source)
    out = tmp_path / "run"
    assert main(["run", str(path), "--store", str(tmp_path), "--output", str(out), "--quiet",
                 "--set", "stages.float.bits=16"]) == 0
    summary = summary_of(out)
    assert summary["status"] == "finished" and "failure" not in summary
    assert summary["overrides"] == ["stages.float.bits=16"]
    assert summary["versions"]["torch"] == torch.__version__
    assert set(summary["versions"]) == {"ondevice_tl", "torch", "python"}
    skipped = summary["skipped_samples"]
    assert skipped["total"] == 1 and "broken.png" in skipped["sources"][0]["examples"][0]
    assert "1 unreadable samples skipped" in summary["summary_line"]
    assert "stages.float.bits=16" in (out / "report.md").read_text()


# ------------------------------------------------------------------------- stores and paths
def test_a_store_path_under_a_regular_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("")
    for command in (["plan"], ["run"]):
        assert main([*command, QUICKSTART, "--store", str(tmp_path / "afile" / "store")]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'afile'} is a regular file" in err and "does not exist" not in err
    assert main(["cache", "ls", "--store", str(tmp_path / "afile" / "store")]) == 2
    assert "is a regular file" in capsys.readouterr().err


def test_a_store_without_write_permission_fails_before_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    store = tmp_path / "store"
    (store / "entries").mkdir(parents=True)
    store.chmod(0o555)
    if os.geteuid() == 0:
        # root passes permission bits: make os.access answer for the store as it would for a user
        real_access = os.access
        monkeypatch.setattr(
            os, "access", lambda p, mode, **kw: False if Path(p) == store else real_access(p, mode, **kw)
        )
    try:
        out = tmp_path / "run"
        code = main(["run", str(tiny_recipe(tmp_path)), "--store", str(store), "--output", str(out)])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"store directory {store} is not writable" in err and "chmod" in err and "--store" in err
        assert not out.exists()  # before any work: not even a run directory
        # reading needs no write permission; changing the store does
        assert main(["cache", "ls", "--store", str(store)]) == 0
        assert main(["cache", "gc", "--store", str(store)]) == 2
        assert f"store directory {store} is not writable" in capsys.readouterr().err
    finally:
        store.chmod(0o755)


def test_an_unwritable_run_directory_fails_before_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    path = tiny_recipe(tmp_path)
    monkeypatch.setattr(Path, "write_text", refuse)
    code = main(["run", str(path), "--store", str(tmp_path), "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot write the run directory {tmp_path / 'run'}" in err and "--output" in err


def test_a_permission_error_while_working_is_exit_1_with_the_path_and_a_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from pipeline.runner import Runner

    def refuse(self: Runner) -> None:
        raise PermissionError(13, "Permission denied", "/somewhere/locked")

    monkeypatch.setattr(Runner, "run", refuse)
    out = tmp_path / "run"
    code = main(["run", str(tiny_recipe(tmp_path)), "--store", str(tmp_path), "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "permission denied: /somewhere/locked" in err and "fix:" in err
    assert summary_of(out)["failure"]["error"] == "PermissionError"


# ------------------------------------------------------------------------ warnings and checks
def test_a_random_backbone_is_announced_unless_written(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(tiny_recipe(tmp_path, weights=None)), "--store", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "warning: stages.model (mobilenet_v2 backbone) has no weights" in err
    assert "weights: random" in err
    assert main(["plan", str(tiny_recipe(tmp_path, weights="random")), "--store", str(tmp_path)]) == 0
    assert "warning" not in capsys.readouterr().err
    # a recipe whose backbone is pretrained by the recipe itself says nothing
    assert main(["plan", QUICKSTART, "--store", str(tmp_path)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_validate_checks_cuts_against_the_architecture(capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", QUICKSTART, "--set", "stages.features.train_last_blocks=40"]) == 2
    err = capsys.readouterr().err
    assert "stages.features.train_last_blocks" in err
    assert "train_last_blocks=40" in err and "0..19" in err and "mobilenet_v2" in err
    assert main(["validate", QUICKSTART, "--set", "stages.baseline.train_last_blocks=20"]) == 2
    assert "stages.baseline.train_last_blocks" in capsys.readouterr().err
    assert main(["validate", QUICKSTART, "--set", "stages.backbone.arch=mobilenet_v9"]) == 2
    assert "stages.backbone.arch" in capsys.readouterr().err
    assert main(["validate", QUICKSTART, "--set", "stages.features.train_last_blocks=19"]) == 0
