"""Stage A as a user runs it: bounded memory; an interruption never leaves an entry reading as complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from stores.catalog import Catalog
from tests.helpers import ROOT, run_pipeline, start_pipeline


def recipe(tmp: Path, samples: int, name: str = "build") -> Path:
    """Synthetic images -> first block of a small MobileNetV2 -> float32 cache (64 KiB per sample)."""
    data = {
        "name": name,
        "stages": {
            "data": {"type": "synthetic", "num_samples": samples, "num_classes": 4, "size": 32},
            "split": {"type": "split", "input": "data", "val_fraction": 0.1, "test_fraction": 0.1},
            "model": {
                "type": "backbone",
                "arch": "mobilenet_v2",
                "width_mult": 0.35,
                "small_input": True,
                "num_classes": 4,
                "resolution": 32,
            },
            "images": {"type": "decode", "input": "split", "resolution": 32, "batch_size": 64},
            "features": {
                "type": "frozen_forward",
                "input": "images",
                "model": "model",
                "train_last_blocks": 18,
            },
            "float": {"type": "quantize", "input": "features", "bits": 32, "eval_bits": 32},
            "cache": {"type": "cache", "input": "float", "chunk_bytes": 262144},
        },
        "run": {"threads": 1},
        "targets": ["cache"],
    }
    path = tmp / f"{name}-{samples}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


PEAK_RSS = """
import resource, sys
from pipeline.cli import main
code = main(sys.argv[1:])
print("PEAK_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""


def run_measured(recipe_path: Path, store: Path, out: Path) -> int:
    proc = run_pipeline(recipe_path, store, out, "--quiet", entry=("-c", PEAK_RSS))
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split("PEAK_KIB")[1].split()[0]) * 1024


def test_cache_build_memory_does_not_grow_with_samples(tmp_path: Path) -> None:
    small = run_measured(recipe(tmp_path, 400), tmp_path / "s1", tmp_path / "o1")
    large = run_measured(recipe(tmp_path, 3200), tmp_path / "s2", tmp_path / "o2")
    # 2800 more samples are ~175 MiB of features: holding them would show; streaming keeps peak flat.
    feature_bytes = 2800 * 16 * 32 * 32 * 4
    assert large - small < feature_bytes / 4, (small, large)
    summary = json.loads((tmp_path / "o2" / "summary.json").read_text())
    cache = next(s for s in summary["stages"] if s["name"] == "cache")
    assert cache["status"] == "computed" and cache["bytes_written"] > 0


def _cache_fingerprint(recipe_path: Path, store: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "plan", str(recipe_path), "--store", str(store), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return next(r for r in json.loads(out.stdout) if r["name"] == "cache")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_build_never_reads_as_complete(tmp_path: Path, sig: signal.Signals) -> None:
    path = recipe(tmp_path, 2500)
    store = tmp_path / "store"
    store.mkdir()
    fp = _cache_fingerprint(path, store)["fingerprint"]
    staging = store / "staging" / fp / "data.zarr"
    proc = start_pipeline(path, store, tmp_path / "out", "--quiet")
    deadline = time.monotonic() + 300
    # Wait until chunks are being written, then interrupt mid-build.
    while time.monotonic() < deadline and proc.poll() is None:
        if staging.is_dir() and sum(1 for _ in staging.rglob("c/*")) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the build finished before it could be interrupted"
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "interrupted" in err
    catalog = Catalog(store)
    assert not catalog.exists(fp) and catalog.lookup(fp) is None
    assert _cache_fingerprint(path, store)["action"] == "compute"
    # The next run resumes from the verified chunks (no recomputation of those) and completes the entry,
    # bit-identical to an uninterrupted build of the same recipe in a fresh store.
    done = run_pipeline(path, store, tmp_path / "out2")
    assert done.returncode == 0, done.stderr
    assert "resuming an interrupted build" in done.stderr
    assert catalog.exists(fp)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    clean = run_pipeline(path, fresh, tmp_path / "out3", "--quiet")
    assert clean.returncode == 0, clean.stderr
    assert catalog.content_hash(fp) == Catalog(fresh).content_hash(fp)
