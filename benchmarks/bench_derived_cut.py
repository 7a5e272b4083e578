"""Caches at three cuts: from the images three times, or once from the images plus two derivations.

A sweep over the cut (``train_last_blocks`` 1, 4, 7) needs a feature cache at each cut. Built from
the images, each one decodes every image and runs the frozen bottom up to its cut. Derived
(``frozen_forward`` on a feature stream, ``pipeline.stages.derived_cut``), only the deepest cut (7,
the lowest in the network) reads the images; cuts 4 and 1 run the blocks between on its stored
float32 features. Both ways run through the real pipeline (recipes built in code, a real zarr store
in a temporary directory, each way in a fresh store), all caches float32 (quantize bits 32, eval_bits
32), in one process, alternating which way goes first from repeat to repeat. Reported per case:
seconds of each build (the run of its recipe; resolving it is not counted), the total of each way,
their ratio, each derivation's own cost (the derived stage's seconds and samples/s from the run's
stage report), and the largest difference between a derived cache and the one built from the
images at the same cut (relative to the largest value).

Cases: the Fashion-MNIST recipe's backbone (MobileNetV2 width 0.5, small input, 32 px) on the
transfer classes 5-9 (100 training images per class; 1% of the training pool each for validation and
test, 300 images each, instead of the 5000 official test images, to keep the run short), and
MobileNetV2 (width 1.0) at 224 px on synthetic images, both with random weights (the time does not
depend on them).

Usage: python -m benchmarks.bench_derived_cut [--repeats 2] [--synthetic-images 64] [--cases fashion224 ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._meta import write_result
from pipeline.api import load_recipe, run_context
from pipeline.runner import Runner

CUTS = (1, 4, 7)


def base_stages(case: str, images: int) -> dict[str, Any]:
    if case == "fashion32":
        return {
            "data": {"type": "fashion_mnist"},
            # The recipe's transfer split (classes 5-9, 100 training images per class), with 1% of the
            # training images for val and for test instead of the 5000 official test images: a short run.
            "split": {"type": "split", "input": "data", "classes": [5, 6, 7, 8, 9], "per_class": 100,
                      "val_fraction": 0.01, "test_fraction": 0.01, "use_official_test": False},
            "backbone": {"type": "backbone", "arch": "mobilenet_v2", "width_mult": 0.5, "small_input": True,
                         "resolution": 32, "num_classes": 5, "weights": "random"},
            "images": {"type": "decode", "input": "split", "resolution": 32},
        }
    return {
        "data": {"type": "synthetic", "num_samples": images, "num_classes": 4, "size": 224},
        "split": {"type": "split", "input": "data", "val_fraction": 0.1, "test_fraction": 0.1},
        "backbone": {"type": "backbone", "arch": "mobilenet_v2", "num_classes": 4, "weights": "random"},
        "images": {"type": "decode", "input": "split", "resolution": 224},
    }


def chain(prefix: str, source: str, cut: int) -> dict[str, Any]:
    return {
        f"{prefix}_ff": {"type": "frozen_forward", "input": source, "model": "backbone",
                         "train_last_blocks": cut},
        f"{prefix}_q": {"type": "quantize", "input": f"{prefix}_ff", "bits": 32, "eval_bits": 32},
        f"{prefix}_c": {"type": "cache", "input": f"{prefix}_q"},
        f"{prefix}_d": {"type": "dequantize", "input": f"{prefix}_c"},
    }


def run(stages: dict[str, Any], target: str, store: Path, threads: int) -> tuple[float, dict[str, Any], Any]:
    """(seconds of the run, stage reports by name, the target's stored values by split)."""
    r = load_recipe({"name": "bench-derived-cut", "run": {"threads": threads}, "stages": stages,
                     "targets": [target]})
    runner = Runner(r, run_context(r, store=store, quiet=True))
    start = time.perf_counter()
    reports = {rep.name: rep for rep in runner.run()}
    seconds = time.perf_counter() - start
    stream = runner._outputs[target]
    values = {split: torch.cat([b["x"] for b in stream.open(split)]) for split in stream.spec.splits}
    runner.release()
    return seconds, reports, values


def from_images(base: dict[str, Any], store: Path, threads: int) -> tuple[dict[int, float], dict[int, Any]]:
    seconds, values = {}, {}
    for k in sorted(CUTS, reverse=True):
        seconds[k], _, values[k] = run({**base, **chain(f"c{k}", "images", k)}, f"c{k}_d", store, threads)
    return seconds, values


def derived(base: dict[str, Any], store: Path, threads: int) -> tuple[dict[int, float], dict[int, Any],
                                                                     dict[int, dict[str, Any]]]:
    deepest = max(CUTS)
    bottom = chain(f"c{deepest}", "images", deepest)
    seconds, values, costs = {}, {}, {}
    seconds[deepest], _, values[deepest] = run({**base, **bottom}, f"c{deepest}_d", store, threads)
    for j in sorted(CUTS, reverse=True)[1:]:
        stages = {**base, **bottom, **chain(f"d{j}", f"c{deepest}_d", j)}
        seconds[j], reports, values[j] = run(stages, f"d{j}_d", store, threads)
        assert reports[f"c{deepest}_c"].status == "reused"
        costs[j] = reports[f"d{j}_ff"].metrics
    return seconds, values, costs


def max_relative_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[s] - b[s]).abs().max() / a[s].abs().max().clamp_min(1e-30)) for s in a)


def measure(case: str, repeats: int, images: int, threads: int) -> dict[str, Any]:
    base = base_stages(case, images)
    rows = []
    for i in range(repeats):
        order = ("images", "derived") if i % 2 == 0 else ("derived", "images")
        got: dict[str, Any] = {}
        for way in order:
            with tempfile.TemporaryDirectory(prefix=f"derived-cut-{way}-") as tmp:
                got[way] = from_images(base, Path(tmp), threads) if way == "images" else \
                    derived(base, Path(tmp), threads)
        direct_s, direct_v = got["images"]
        derived_s, derived_v, costs = got["derived"]
        rows.append({
            "repeat": i,
            "first": order[0],
            "from_images_seconds": {str(k): round(v, 3) for k, v in direct_s.items()},
            "derived_seconds": {str(k): round(v, 3) for k, v in derived_s.items()},
            "from_images_total": round(sum(direct_s.values()), 3),
            "derived_total": round(sum(derived_s.values()), 3),
            "derivation_cost": {str(j): {key: c[key] for key in ("seconds", "samples", "samples_per_s")}
                                for j, c in costs.items()},
            "max_relative_diff": {str(j): max_relative_diff(direct_v[j], derived_v[j]) for j in costs},
        })
        print(f"{case} repeat {i}: from images {rows[-1]['from_images_total']:.1f}s, "
              f"derived {rows[-1]['derived_total']:.1f}s", flush=True)
    samples = next(iter(rows[0]["derivation_cost"].values()))["samples"]
    ratio = statistics.median(r["from_images_total"] / r["derived_total"] for r in rows)
    per_cut = {str(k): statistics.median(r["from_images_seconds"][str(k)] for r in rows) for k in CUTS}
    derive = {str(j): statistics.median(r["derived_seconds"][str(j)] for r in rows) for j in CUTS[:-1]}
    return {
        "case": case,
        "samples": samples,
        "from_images_seconds_median": per_cut,
        "derived_seconds_median": {**derive, str(max(CUTS)): statistics.median(
            r["derived_seconds"][str(max(CUTS))] for r in rows)},
        "from_images_total_median": statistics.median(r["from_images_total"] for r in rows),
        "derived_total_median": statistics.median(r["derived_total"] for r in rows),
        "speedup_median": round(ratio, 3),
        "max_relative_diff": max(max(r["max_relative_diff"].values()) for r in rows),
        "repeats": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--synthetic-images", type=int, default=64, help="images of the 224-px case")
    parser.add_argument("--threads", type=int, default=1,
                        help="run.threads of every run (1: the least sensitive to other work on the machine)")
    parser.add_argument("--cases", nargs="+", default=["fashion32", "synthetic224"],
                        choices=["fashion32", "synthetic224"])
    parser.add_argument("--output", type=Path, default=None, help="write the JSON here instead of results/")
    args = parser.parse_args(argv)
    cases = [measure(case, args.repeats, args.synthetic_images, args.threads) for case in args.cases]
    lines = ", ".join(f"{c['case']} {c['speedup_median']:.2f}x" for c in cases)
    path = write_result("derived_cut", {
        "settings": {"cuts": list(CUTS), "repeats": args.repeats, "synthetic_images": args.synthetic_images,
                     "threads": args.threads},
        "headline": f"caches at cuts 1/4/7: bottom once + 2 derivations vs 3 builds from images: {lines}",
        "cases": cases,
    }, args.output)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
