"""Data that grows, cache part (issue 30, item 2): extending a stored cache entry against a full rebuild.

Fashion-MNIST (Debian's ``dataset-fashion-mnist``) written as an image folder of PNG files, 5 classes
(coat, sandal, shirt, sneaker, bag) x ``--per-class`` images. A Cache & Reuse data path (image_folder ->
split -> decode -> frozen MobileNetV2 bottom -> 4-bit quantize -> zarr cache) is built once. Then 10% more
images arrive in the same classes (``--grow``), and, paired in one run, alternating:

- **extend**: the same recipe over the grown folder, in the store that holds the first entry: only the
  new images are decoded and run through the bottom (``pipeline.growth``);
- **full rebuild**: the same recipe over the grown folder in an empty store (the backbone copied in, so
  both compute only the cache).

Each is timed end to end in this process (``pipeline.cli.main``: indexing the folder, which hashes every
file either way, planning, computing, committing); the cache stage's own seconds are recorded too. The bar:
the extension at most 0.15 of the rebuild's time, and its entry equal to the rebuild's byte for byte.
The backbone's weights are random (``weights: random``): the bottom's cost does not depend on them.

Usage: python -m benchmarks.bench_incremental_cache [--per-class 600] [--grow 0.1] [--resolutions 64 128]
       [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks._meta import write_result

CLASSES = [4, 5, 6, 7, 8]
BOOKKEEPING = {"manifest.json", ".last_used", "build.json"}


def export(root: Path, images: np.ndarray, labels: np.ndarray, names: list[str], per_class: int,
           start: int = 0) -> int:
    """Write images ``start`` .. ``per_class`` of each class as PNG files; how many were written."""
    from PIL import Image

    written = 0
    for c in CLASSES:
        folder = root / names[c]
        folder.mkdir(parents=True, exist_ok=True)
        for i, index in enumerate(np.flatnonzero(labels == c)[start:per_class]):
            Image.fromarray(images[index]).save(folder / f"{start + i:05d}.png")
            written += 1
    return written


def recipe(path: Path, images: Path, resolution: int) -> Path:
    data = {
        "name": "incremental_cache",
        "seed": 0,
        "run": {"threads": "auto"},
        "stages": {
            "photos": {"type": "image_folder", "root": str(images)},
            "split": {"type": "split", "input": "photos", "val_fraction": 0.1, "test_fraction": 0.1},
            "backbone": {"type": "backbone", "arch": "mobilenet_v2", "num_classes": 10, "weights": "random",
                         "resolution": resolution},
            "images": {"type": "decode", "input": "split", "resolution": resolution},
            "features": {"type": "frozen_forward", "input": "images", "model": "backbone",
                         "train_last_blocks": 4},
            "quantized": {"type": "quantize", "input": "features", "bits": 4},
            "cache": {"type": "cache", "input": "quantized"},
        },
        "targets": ["cache"],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def timed_run(recipe_path: Path, store: Path, out: Path) -> dict[str, Any]:
    from pipeline.cli import main

    start = time.perf_counter()
    assert main(["run", str(recipe_path), "--store", str(store), "--output", str(out), "--quiet"]) == 0
    wall = time.perf_counter() - start
    stages = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["stages"]}
    return {"wall_s": round(wall, 3), "cache": stages["cache"]}


def content(store: Path, fingerprint: str) -> str:
    h = hashlib.sha256()
    entry = store / "entries" / fingerprint
    for f in sorted(entry.rglob("*")):
        if f.is_file() and f.name not in BOOKKEEPING:
            h.update(str(f.relative_to(entry)).encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def measure(pixels: np.ndarray, labels: np.ndarray, names: list[str], args: argparse.Namespace,
            resolution: int) -> dict[str, Any]:
    """Build once, grow the folder, then extend and rebuild in turn ``args.repeats`` times."""
    grown = args.per_class + int(round(args.per_class * args.grow))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-incremental-cache-") as tmp:
        root = Path(tmp)
        images = root / "photos"
        first_count = export(images, pixels, labels, names, args.per_class)
        r = recipe(root / "recipe.yaml", images, resolution)
        base_store = root / "base"
        base_store.mkdir()
        first = timed_run(r, base_store, root / "first")
        added = export(images, pixels, labels, names, grown, start=args.per_class)
        for repeat in range(args.repeats):
            for way in ("extend", "full") if repeat % 2 == 0 else ("full", "extend"):
                store = root / f"{way}-{repeat}"
                if way == "extend":
                    shutil.copytree(base_store, store)
                else:  # the backbone is not stored (a random-weight backbone stage); nothing to copy
                    store.mkdir()
                result = timed_run(r, store, root / f"out-{way}-{repeat}")
                result.update(way=way, repeat=repeat,
                              content=content(store, result["cache"]["fingerprint"]))
                rows.append(result)
                print(f"{resolution} px {way}: {result['wall_s']:.2f} s "
                      f"(cache stage {result['cache']['seconds']:.2f} s)", flush=True)
    extend = [r_ for r_ in rows if r_["way"] == "extend"]
    full = [r_ for r_ in rows if r_["way"] == "full"]
    ratio = statistics.median(e["wall_s"] for e in extend) / statistics.median(f["wall_s"] for f in full)
    stage_ratio = (statistics.median(e["cache"]["seconds"] for e in extend)
                   / statistics.median(f["cache"]["seconds"] for f in full))
    same = len({row["content"] for row in rows}) == 1
    delta = extend[0]["cache"].get("metrics", {})
    return {
        "resolution": resolution, "images_before": first_count, "images_added": added,
        "first_build_wall_s": first["wall_s"],
        "runs": [{k: v for k, v in row.items() if k != "cache"} | {"cache_stage_s": row["cache"]["seconds"]}
                 for row in rows],
        "delta": {k: delta.get(k) for k in ("new", "removed", "reused", "relabelled", "computed_seconds")},
        "extend_over_full_wall": round(ratio, 3),
        "extend_over_full_cache_stage": round(stage_ratio, 3),
        "same_bytes": same,
    }


def headline(results: list[dict[str, Any]]) -> str:
    parts = [f"{r['resolution']} px {r['extend_over_full_cache_stage']:.2f}x the cache stage "
             f"({r['extend_over_full_wall']:.2f}x end to end)" for r in results]
    same = all(r["same_bytes"] for r in results)
    return "10% more images: extension " + ", ".join(parts) + (", same bytes" if same else ", BYTES DIFFER")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-class", type=int, default=600)
    ap.add_argument("--grow", type=float, default=0.1, help="fraction of new images per class")
    ap.add_argument("--resolutions", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="60 images per class, one repeat, JSON to a tmp dir")
    args = ap.parse_args()
    if args.quick:
        args.per_class, args.repeats = 60, 1
    from pipeline.data.sources import fashion_mnist

    train = fashion_mnist()["train"]
    pixels = np.asarray(train.load(np.arange(len(train))))[..., 0]
    labels, names = np.asarray(train.labels), train.class_names
    results = [measure(pixels, labels, names, args, resolution) for resolution in args.resolutions]
    payload = {
        "settings": {"classes": [names[c] for c in CLASSES], "per_class": args.per_class, "grow": args.grow,
                     "arch": "mobilenet_v2 (random weights), train_last_blocks 4, 4-bit, zarr zstd",
                     "repeats": args.repeats, "resolutions": args.resolutions},
        "by_resolution": results,
        "bar": {f"{r['resolution']}px": {"extend_at_most_0.15_of_full": r["extend_over_full_wall"] <= 0.15,
                                         "same_bytes": r["same_bytes"]} for r in results},
    }
    payload["headline"] = headline(results)
    path = write_result("incremental", payload, Path(tempfile.mkdtemp()) if args.quick else None)
    for r in results:
        print(f"{r['resolution']} px: extension {r['extend_over_full_wall']:.3f}x the rebuild's time end "
              f"to end ({r['extend_over_full_cache_stage']:.3f}x the cache stage's); same bytes: "
              f"{r['same_bytes']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
