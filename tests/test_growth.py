"""A cache over an image folder that grew: the stored entry plus the new samples, byte for byte a full build.

Real parts: PNG files in class folders, a random-weight MobileNetV2 bottom, zarr and HDF5 entries in a real
store. Each test grows a folder the way a device sees it (files added, removed, rewritten, moved to another
class) and compares the extended entry with a full build of the grown folder in a fresh store.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

from pipeline.cli import main
from pipeline.growth import FAMILY, KEYS_FILE
from stores.catalog import Catalog

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("ant", "bee", "cat")
BOOKKEEPING = {"manifest.json", ".last_used", "build.json"}


def draw(folder: Path, cls: str, index: int, *, seed: int = 0) -> Path:
    rng = np.random.default_rng([seed, CLASSES.index(cls) if cls in CLASSES else 9, index])
    image = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
    image[:, : 2 + CLASSES.index(cls) if cls in CLASSES else 0] = 255  # a little class signal
    path = folder / cls / f"{index:03d}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)
    return path


def folder(root: Path, per_class: int) -> Path:
    for cls in CLASSES:
        for i in range(per_class):
            draw(root, cls, i)
    return root


def recipe(path: Path, images: Path, *, fmt: str = "zarr", precision: str = "fp32") -> Path:
    data = {
        "name": "growth",
        "seed": 0,
        "run": {"threads": 1},
        "stages": {
            "photos": {"type": "image_folder", "root": str(images)},
            "split": {"type": "split", "input": "photos", "val_fraction": 0.2, "test_fraction": 0.2},
            "backbone": {"type": "backbone", "arch": "mobilenet_v2", "width_mult": 0.35, "small_input": True,
                         "resolution": 32, "num_classes": 3, "weights": "random"},
            "images": {"type": "decode", "input": "split", "resolution": 32, "batch_size": 7},
            "features": {"type": "frozen_forward", "input": "images", "model": "backbone",
                         "train_last_blocks": 7, "precision": precision, "calibration_batches": 2},
            "quantized": {"type": "quantize", "input": "features", "bits": 4},
            "cache": {"type": "cache", "input": "quantized", "format": fmt, "chunk_bytes": 4096},
        },
        "targets": ["cache"],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(recipe_path: Path, store: Path, out: Path) -> dict[str, Any]:
    store.mkdir(parents=True, exist_ok=True)
    args = ["run", str(recipe_path), "--store", str(store), "--output", str(out), "--quiet", "--force"]
    assert main(args) == 0
    return {s["name"]: s for s in json.loads((out / "summary.json").read_text())["stages"]}


def content(store: Path, fingerprint: str) -> dict[str, str]:
    entry = store / "entries" / fingerprint
    return {str(f.relative_to(entry)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(entry.rglob("*")) if f.is_file() and f.name not in BOOKKEEPING}


def plan(recipe_path: Path, store: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["plan", str(recipe_path), "--store", str(store)]) == 0
    return capsys.readouterr().out


def grow(images: Path) -> None:
    """What a device sees over a week: new photos, one deleted, one rewritten, one moved to another class."""
    for cls in CLASSES:
        for i in range(12, 15):
            draw(images, cls, i)
    (images / "ant" / "000.png").unlink()
    draw(images, "bee", 1, seed=7)  # same name, other content: one removed, one new
    shutil.move(images / "cat" / "002.png", images / "bee" / "moved.png")  # same content, other label


def test_an_unreadable_file_in_the_grown_folder_is_skipped_and_counted_or_fails_as_set(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = folder(tmp_path / "photos", 12)
    store = tmp_path / "store"
    r = recipe(tmp_path / "r.yaml", images)
    data = yaml.safe_load(r.read_text())
    data["stages"]["photos"]["on_bad_sample"] = "skip"
    r.write_text(yaml.safe_dump(data, sort_keys=False))
    first = run(r, store, tmp_path / "run1")["cache"]
    for i in range(12, 15):
        draw(images, "ant", i)
    broken = images / "bee" / "broken.png"
    broken.write_bytes(b"not a png at all")
    cache = run(r, store, tmp_path / "run2")["cache"]
    # skipped: the extension is the stored entry plus the 3 readable new images, and the run says so
    assert cache["metrics"]["extended_from"] == first["fingerprint"] and cache["metrics"]["new"] == 3
    assert "1 in image_folder" in (tmp_path / "run2" / "report.md").read_text()
    skipped = json.loads((tmp_path / "run2" / "summary.json").read_text())["skipped_samples"]
    assert "broken.png" in json.dumps(skipped)
    full = run(r, tmp_path / "fresh", tmp_path / "run3")["cache"]
    assert content(store, cache["fingerprint"]) == content(tmp_path / "fresh", full["fingerprint"])

    data["stages"]["photos"]["on_bad_sample"] = "fail"
    r.write_text(yaml.safe_dump(data, sort_keys=False))
    entries = sorted(p.name for p in (store / "entries").iterdir())
    capsys.readouterr()
    assert main(["run", str(r), "--store", str(store), "--output", str(tmp_path / "run4"), "--quiet"]) == 2
    assert str(broken) in capsys.readouterr().err  # names the file; nothing stored is touched
    assert sorted(p.name for p in (store / "entries").iterdir()) == entries


@pytest.mark.parametrize("fmt", ["zarr", "hdf5"])
def test_a_grown_folder_extends_the_stored_entry_to_the_full_builds_bytes(
        tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    images = folder(tmp_path / "photos", 12)
    store = tmp_path / "store"
    r = recipe(tmp_path / "r.yaml", images, fmt=fmt)
    first = run(r, store, tmp_path / "run1")["cache"]
    before = content(store, first["fingerprint"])
    assert KEYS_FILE in before
    grow(images)
    shown = plan(r, store, capsys)
    said = f"extend {first['fingerprint'][:12]}: +10 new, -2 removed, 34 reused (1 with another label)"
    assert said in shown

    grown = run(r, store, tmp_path / "run2")
    cache = grown["cache"]
    assert cache["status"] == "computed" and cache["fingerprint"] != first["fingerprint"]
    assert {k: cache["metrics"][k] for k in ("new", "removed", "reused", "relabelled")} == \
        {"new": 10, "removed": 2, "reused": 34, "relabelled": 1}
    assert cache["metrics"]["extended_from"] == first["fingerprint"]
    report = (tmp_path / "run2" / "report.md").read_text()
    said = f"`cache`: from `{first['fingerprint'][:12]}`: +10 new, -2 removed, 34 reused, 1 kept with another"
    assert said in report
    # the stored entry is still there, as it was (the new one was built beside it)
    assert content(store, first["fingerprint"]) == before

    fresh = tmp_path / "fresh"
    full = run(r, fresh, tmp_path / "run3")["cache"]
    assert full["fingerprint"] == cache["fingerprint"] and "extended_from" not in full.get("metrics", {})
    assert content(store, cache["fingerprint"]) == content(fresh, full["fingerprint"])
    # the extended entry is extendable in turn, and verifies
    entry, built = Catalog(store).lookup(cache["fingerprint"]), Catalog(fresh).lookup(full["fingerprint"])
    assert entry is not None and built is not None and entry.lineage[FAMILY] == built.lineage[FAMILY]
    assert Catalog(store).verify(cache["fingerprint"]).ok


def test_an_int8_bottom_is_built_whole_and_the_plan_says_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch.ao.quantization")
    images = folder(tmp_path / "photos", 10)
    store = tmp_path / "store"
    r = recipe(tmp_path / "r.yaml", images, precision="int8")
    run(r, store, tmp_path / "run1")
    grow(images)
    shown = plan(r, store, capsys)
    assert "extend " not in shown and "calibrated on the first 2 batches" in shown
    assert "metrics" not in run(r, store, tmp_path / "run2")["cache"] or \
        "extended_from" not in run(r, store, tmp_path / "run2")["cache"]["metrics"]


def test_a_damaged_keys_file_is_a_damaged_entry_and_nothing_is_extended_from_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = folder(tmp_path / "photos", 8)
    store = tmp_path / "store"
    r = recipe(tmp_path / "r.yaml", images)
    first = run(r, store, tmp_path / "run1")["cache"]
    keys = store / "entries" / first["fingerprint"] / KEYS_FILE
    data = bytearray(keys.read_bytes())
    data[-1] ^= 0xFF
    keys.write_bytes(bytes(data))
    report = Catalog(store).verify(first["fingerprint"])
    assert not report.ok and KEYS_FILE in str(report.problems)
    # a grown folder is then built whole, never extended from keys that no longer match their checksum
    grow(images)
    cache = run(r, store, tmp_path / "run2")["cache"]
    assert "extended_from" not in cache.get("metrics", {})
    full = run(r, tmp_path / "fresh", tmp_path / "run3")["cache"]
    assert content(store, cache["fingerprint"]) == content(tmp_path / "fresh", full["fingerprint"])


KILL_AT_VAL = """
import os, signal, sys
from pipeline.ops import extend
from pipeline.cli import main

opened = extend.ExtendedStream.open

def open_then_die(self, split, **kw):
    if split == "val":  # train is written (or being written): the kill lands mid-extension
        os.kill(os.getpid(), signal.SIGKILL)
    yield from opened(self, split, **kw)

extend.ExtendedStream.open = open_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_an_extension_killed_midway_resumes_to_the_same_bytes_and_keeps_the_old_entry(
        tmp_path: Path) -> None:
    images = folder(tmp_path / "photos", 12)
    store = tmp_path / "store"
    r = recipe(tmp_path / "r.yaml", images)
    first = run(r, store, tmp_path / "run1")["cache"]
    before = content(store, first["fingerprint"])
    grow(images)
    killed = subprocess.run([sys.executable, "-c", KILL_AT_VAL, "run", str(r), "--store", str(store),
                             "--output", str(tmp_path / "killed"), "--quiet"], cwd=ROOT,
                            capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [e.fingerprint for e in Catalog(store).entries() if e.kind == "stream"] == [first["fingerprint"]]
    assert content(store, first["fingerprint"]) == before  # the stored entry is untouched and still used
    cache = run(r, store, tmp_path / "run2")["cache"]
    assert cache["metrics"]["extended_from"] == first["fingerprint"]
    full = run(r, tmp_path / "fresh", tmp_path / "run3")["cache"]
    assert content(store, cache["fingerprint"]) == content(tmp_path / "fresh", full["fingerprint"])


def test_on_dask_an_extension_is_computed_by_the_client_to_the_same_bytes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.executors.dask_build import start_local_cluster

    images = folder(tmp_path / "photos", 12)
    store = tmp_path / "store"
    r = recipe(tmp_path / "r.yaml", images)
    with start_local_cluster(1, 1) as cluster:
        data = yaml.safe_load(r.read_text())
        data["executor"] = {"type": "dask", "address": cluster.scheduler_address, "partition_chunks": 1,
                            "torch_threads": 1}
        r.write_text(yaml.safe_dump(data, sort_keys=False))
        first = run(r, store, tmp_path / "run1")["cache"]
        grow(images)
        capsys.readouterr()
        store.mkdir(exist_ok=True)
        assert main(["run", str(r), "--store", str(store), "--output", str(tmp_path / "run2")]) == 0
        said = capsys.readouterr()
        assert f"extending {first['fingerprint'][:12]} in this process" in said.out + said.err
        cache = {s["name"]: s for s in json.loads((tmp_path / "run2" / "summary.json").read_text())["stages"]}
    full = run(recipe(tmp_path / "local.yaml", images), tmp_path / "fresh", tmp_path / "run3")["cache"]
    assert content(store, cache["cache"]["fingerprint"]) == content(tmp_path / "fresh", full["fingerprint"])
