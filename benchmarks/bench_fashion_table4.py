"""Accuracy of Cache & Reuse on Fashion-MNIST in the structure of the paper's Table 4 (issue: the main job).

Runs recipes/cache_reuse/fashion_mnist.yaml once per seed through the real pipeline
and store: the pretrained backbone and the caches are built by the first seed and
reused by the others (only trainer and feature-augmentation seeds change), so the
rows differ only in where the training batches come from. Reports test accuracy
(mean and standard deviation over seeds), epoch time and cache size per row, and
checks the paper's findings: 2- and 4-bit within about a point of the baseline,
1-bit clearly lower, no feature augmentation lower.

On a GPU (``--device cuda``, written to ``cache_reuse_fashion_table4_<R>px_cuda.json`` with the GPU named),
``--resolution 96`` (or 128) upsamples the 28x28 images so the cached maps at the cut are at least 7x7
(12x12 at 96 px for this small-input MobileNetV2; 4x4 at the CPU run's 32 px), the setting of the paper,
to check whether "no feature augmentation is lower" holds where a one-cell feature shift is small.

Usage: python -m benchmarks.bench_fashion_table4 [--seeds 0 1 2] [--store DIR] [--set KEY=VALUE ...]
       [--device cuda] [--resolution 96] [--quick]  (--quick: minutes, written under /tmp)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from benchmarks._device import device_info, require_device, result_name
from benchmarks._meta import write_result
from pipeline.context import RunContext
from pipeline.progress import Progress
from pipeline.recipe import load_recipe
from pipeline.runner import Runner
from stores.catalog import Catalog

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cache_reuse" / "fashion_mnist.yaml"
ROWS = ["baseline", "no_compression", "no_feature_aug", "bits_8", "bits_4", "bits_2", "bits_1"]
SEEDED = [*ROWS, "float_aug", "aug8", "aug4", "aug2", "aug1"]


def resolution_overrides(resolution: int | None) -> list[str]:
    """``--set`` overrides putting every stage of the recipe that has a resolution at ``resolution``."""
    if resolution is None:
        return []
    stages = yaml.safe_load(RECIPE.read_text())["stages"]
    return [f"stages.{name}.resolution={resolution}" for name, cfg in stages.items() if "resolution" in cfg]


QUICK = [  # the code path in minutes: few images (val and test about 1% of the classes' data), one epoch
    "stages.source.per_class=40", "stages.source.val_fraction=0.01", "stages.target.per_class=10",
    "stages.target.use_official_test=false", "stages.target.val_fraction=0.01",
    "stages.target.test_fraction=0.01", "stages.backbone.train.epochs=1",
    *[f"stages.{name}.train.epochs=1" for name in ROWS],
]


def run_seed(
    seed: int, store: Path, extra: list[str], device: torch.device
) -> tuple[dict[str, dict], dict[str, str], float]:
    overrides = [f"stages.{name}.seed={seed}" for name in SEEDED] + extra
    recipe = load_recipe(RECIPE, overrides)
    threads = recipe.run.threads
    torch.set_num_threads(threads if isinstance(threads, int) else torch.get_num_threads())
    ctx = RunContext(
        catalog=Catalog(store), seed=recipe.seed, recipe_name=recipe.name, progress=Progress(quiet=False),
        device=str(device),
    )
    start = time.perf_counter()
    runner = Runner(recipe, ctx)
    reports = {r.name: r for r in runner.run()}
    statuses = {name: r.status for name, r in reports.items()}
    return {name: reports[name].metrics for name in ROWS}, statuses, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--store", help="store directory (default: a temporary one)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--resolution", type=int, help="input resolution of every stage (96 or 128 on a GPU)")
    ap.add_argument("--quick", action="store_true", help="one seed, tiny data, one epoch: checks the path")
    ap.add_argument("--output-dir", type=Path, help="write the result here instead of benchmarks/results")
    args = ap.parse_args()
    device = require_device(args.device)
    if args.quick:
        args.seeds = args.seeds[:1]
        args.output_dir = args.output_dir or Path(tempfile.gettempdir()) / "bench-quick"
    extra = [*(QUICK if args.quick else []), *resolution_overrides(args.resolution), *args.overrides]
    tmp = None
    if args.store:
        store = Path(args.store)
        store.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="table4-")
        store = Path(tmp.name)
    per_seed = []
    for seed in args.seeds:
        metrics, statuses, seconds = run_seed(seed, store, extra, device)
        per_seed.append({"seed": seed, "seconds": seconds, "statuses": statuses, "metrics": metrics})
        print(
            f"seed {seed}: "
            + "  ".join(f"{r} {metrics[r]['accuracy']:.4f}" for r in ROWS)
            + f"  ({seconds:.0f}s)"
        )
    rows = []
    for name in ROWS:
        accs = [s["metrics"][name]["accuracy"] for s in per_seed]
        first = per_seed[0]["metrics"][name]
        rows.append(
            {
                "row": name,
                "bits": first["bits"],
                "mode": first["mode"],
                "accuracy_mean": statistics.fmean(accs),
                "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "accuracies": accs,
                "epoch_seconds_steady": statistics.fmean(
                    s["metrics"][name]["epoch_seconds_steady"] for s in per_seed
                ),
                "cache_bytes": first["cache_bytes"],
                "test_samples": first["test_samples"],
            }
        )
    by = {r["row"]: r for r in rows}
    base = by["baseline"]["accuracy_mean"]
    findings = {
        "bits_4_within_1pt_of_baseline": abs(by["bits_4"]["accuracy_mean"] - base) <= 0.01,
        "bits_2_within_1pt_of_baseline": abs(by["bits_2"]["accuracy_mean"] - base) <= 0.01,
        "bits_1_clearly_lower_than_2bit": by["bits_1"]["accuracy_mean"]
        < by["bits_2"]["accuracy_mean"] - 0.01,
        "no_feature_aug_lower_than_with": by["no_feature_aug"]["accuracy_mean"]
        < by["no_compression"]["accuracy_mean"],
    }
    print(f"{'row':<16}{'bits':>5}{'accuracy':>18}{'s/epoch':>9}{'cache':>12}")
    for r in rows:
        print(
            f"{r['row']:<16}{r['bits']:>5}{r['accuracy_mean']:>10.4f} ± {r['accuracy_std']:.4f}"
            f"{r['epoch_seconds_steady']:>9.3f}{r['cache_bytes'] / 1024:>10.1f}Ki"
        )
    print(f"findings: {findings}")
    # One file per resolution and device: cache_reuse_fashion_table4[_96px][_cuda].json
    name = "cache_reuse_fashion_table4" + (f"_{args.resolution}px" if args.resolution else "")
    path = write_result(
        result_name(name, device),
        {
            "question": "test accuracy of Cache & Reuse rows (Table 4 structure) on the Fashion-MNIST "
            "transfer task",
            "settings": {
                "recipe": str(RECIPE.relative_to(RECIPE.parents[2])),
                "seeds": args.seeds,
                "overrides": extra,
                "resolution": args.resolution or 32,
                "quick": args.quick,
                "torch_threads": torch.get_num_threads(),
                "task": "pretrain on classes 0-4 (2000/class), transfer to 5-9 with 100 train images/class, "
                "official test split (5000 images)",
            },
            "device": device_info(device),
            "feature_map": {"shape": per_seed[0]["metrics"]["no_compression"].get("top_input_shape")},
            "rows": rows,
            "findings": findings,
            "per_seed": per_seed,
        },
        directory=args.output_dir,
    )
    print(f"wrote {path}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
