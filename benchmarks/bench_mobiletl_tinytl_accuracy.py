"""Accuracy of MobileTL and TinyTL on the Fashion-MNIST transfer task (issue: memory-efficient trainers).

Runs recipes/mobiletl/fashion_mnist.yaml and recipes/tinytl/fashion_mnist.yaml once per seed through
the real pipeline and store. Both share the Cache & Reuse recipe's backbone and 4-bit cache (built
by the first seed, or reused from a store that already has them), so every row trains the last 7
blocks of the same pretrained MobileNetV2 from the same cached batches; only the trainer and
feature-augmentation seeds change between seeds. The tinytl recipe's ``vanilla`` row is the same
trainer as the mobiletl recipe's and is not run twice.

Reports test accuracy (mean and standard deviation over seeds), steady epoch time, trainable
parameters and each trainer's training-memory footprint, and checks: MobileTL within about a point
of vanilla fine-tuning of the same blocks; TinyTL-L+B clearly (> 2 points) above FT-Last.

Usage: python -m benchmarks.bench_mobiletl_tinytl_accuracy [--seeds 0 1 2] [--store DIR] [--threads 1]
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
from pipeline.context import RunContext
from pipeline.progress import Progress
from pipeline.recipe import load_recipe
from pipeline.runner import Runner
from stores.catalog import Catalog

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "mobiletl": (ROOT / "recipes" / "mobiletl" / "fashion_mnist.yaml",
                 ["vanilla", "mobiletl", "mobiletl_all_shift", "mobiletl_all_bn"]),
    "tinytl": (ROOT / "recipes" / "tinytl" / "fashion_mnist.yaml",
               ["ft_last", "ft_norm_last", "tinytl_b", "tinytl_l", "tinytl_lb"]),
}
KEEP = ("accuracy", "best_val_accuracy", "epoch_seconds_steady", "trainable_parameters", "method", "bits",
        "memory_activation_bytes", "memory_activation_bytes_measured", "memory_total_bytes", "lr")


def run_recipe(path: Path, rows: list[str], seed: int, store: Path, threads: int, quiet: bool,
               extra: list[str]) -> tuple[dict[str, dict[str, Any]], float]:
    overrides = [f"stages.{r}.seed={seed}" for r in [*rows, "aug4"]]
    overrides += [f"run.threads={threads}", f"targets=[{','.join(rows)}]", *extra]
    recipe = load_recipe(path, overrides)
    torch.set_num_threads(threads)
    ctx = RunContext(catalog=Catalog(store), seed=recipe.seed, recipe_name=recipe.name,
                     progress=Progress(quiet=quiet))
    start = time.perf_counter()
    reports = {r.name: r for r in Runner(recipe, ctx).run()}
    out = {}
    for r in rows:
        m = reports[r].metrics
        out[r] = {k: m.get(k) for k in KEEP if k in m}
        stage: Any = recipe.stages[r]  # a finetune stage (ROWS): it has a train config
        out[r]["lr"] = stage.train.lr
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--store", help="store directory (default: a temporary one; the backbone is pretrained)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core CPU, 2 threads spin, ~10x slower)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="extra recipe overrides, applied to both recipes")
    args = ap.parse_args()
    tmp = None
    if args.store:
        store = Path(args.store)
        store.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="mtl-tinytl-")
        store = Path(tmp.name)
    per_seed: list[dict[str, Any]] = []
    for seed in args.seeds:
        metrics: dict[str, dict[str, Any]] = {}
        seconds = {}
        for key, (path, rows) in RECIPES.items():
            m, s = run_recipe(path, rows, seed, store, args.threads, args.quiet, args.overrides)
            metrics.update(m)
            seconds[key] = s
        per_seed.append({"seed": seed, "seconds": seconds, "metrics": metrics})
        print(f"seed {seed}: " + "  ".join(f"{r} {v['accuracy']:.4f}" for r, v in metrics.items())
              + f"  ({sum(seconds.values()):.0f}s)", flush=True)
    names = [r for _, rows in RECIPES.values() for r in rows]
    table = []
    for name in names:
        accs = [s["metrics"][name]["accuracy"] for s in per_seed]
        first = per_seed[0]["metrics"][name]
        table.append({
            "row": name, "method": first["method"], "lr": first["lr"],
            "accuracy_mean": statistics.fmean(accs),
            "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "accuracies": accs,
            "epoch_seconds_steady": statistics.fmean(s["metrics"][name]["epoch_seconds_steady"]
                                                     for s in per_seed),
            "trainable_parameters": first["trainable_parameters"],
            "activation_bytes": first["memory_activation_bytes"],
            "activation_bytes_measured": first["memory_activation_bytes_measured"],
            "total_bytes": first["memory_total_bytes"],
        })
    by = {r["row"]: r for r in table}
    acc = {k: v["accuracy_mean"] for k, v in by.items()}
    findings = {
        "mobiletl_minus_vanilla": acc["mobiletl"] - acc["vanilla"],
        "mobiletl_within_1pt_of_vanilla": abs(acc["mobiletl"] - acc["vanilla"]) <= 0.01,
        "tinytl_lb_minus_ft_last": acc["tinytl_lb"] - acc["ft_last"],
        "tinytl_lb_clearly_above_ft_last": acc["tinytl_lb"] > acc["ft_last"] + 0.02,
    }
    print(f"{'row':<20}{'method':<20}{'lr':>7}{'accuracy':>18}{'s/epoch':>9}{'trained':>10}"
          f"{'act (analytic)':>16}{'total mem':>12}")
    for r in table:
        print(f"{r['row']:<20}{r['method']:<20}{r['lr']:>7}"
              f"{r['accuracy_mean']:>10.4f} ± {r['accuracy_std']:.4f}"
              f"{r['epoch_seconds_steady']:>9.2f}{r['trainable_parameters']:>10,}"
              f"{r['activation_bytes'] / 2**20:>13.2f}MiB{r['total_bytes'] / 2**20:>9.2f}MiB")
    print(f"findings: {findings}")
    path = write_result("mobiletl_tinytl_accuracy", {
        "question": "test accuracy of MobileTL and TinyTL rows on the Fashion-MNIST transfer task",
        "settings": {"recipes": {k: str(p.relative_to(ROOT)) for k, (p, _) in RECIPES.items()},
                     "seeds": args.seeds, "overrides": args.overrides, "torch_threads": args.threads,
                     "task": "pretrain MobileNetV2 0.5 on classes 0-4 (2000/class), transfer to 5-9 with "
                             "100 train images/class, last 7 blocks from a 4-bit cache with feature "
                             "augmentation, 30 epochs AdamW cosine; official test split (5000 images)"},
        "rows": table,
        "findings": findings,
        "per_seed": per_seed,
    })
    print(f"wrote {path}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
