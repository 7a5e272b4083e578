"""An N-variant sweep against N independent runs: what sharing the frozen forward saves.

Both arms train the same N variants (only downstream settings differ, so they share one cache):

- **independent**: N ``pipeline.run`` calls, each into its own store that holds only the pretrained
  backbone (as if each variant were run from scratch by hand, with the backbone given);
- **sweep**: one ``pipeline.run_sweep`` over the same grid, into a store that holds only the backbone.

The backbone is pre-built once and copied into every store of both arms: a fresh store would
otherwise pretrain it N times in the independent arm, which is not what a sweep saves. Both arms run
in this one process (imports paid before either), with the same thread setting.

Reported: both wall times, the parts (the cache build: decode + frozen forward + quantize + write,
as the independent runs' cache stage times it; each variant's training, as its finetune stage times
it) and the target ratio ``sweep / (one cache build + the N trainings) <= 1.10``: what the sweep
adds to the work it cannot avoid (planning, per-run records and plots, tables, best model).

    python -m benchmarks.bench_sweep                                    # quickstart (digits), 8 variants
    python -m benchmarks.bench_sweep --recipe fashion_mnist             # recipes/cache_reuse, epochs reduced
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pipeline
from benchmarks._meta import write_result

ROOT = Path(__file__).resolve().parents[1]

# name -> recipe file, overrides applied to every run of both arms, target, the cache stages whose builds
# (summed) are "the cache build", the backbone stage, the grid
SETUPS: dict[str, dict[str, Any]] = {
    "quickstart": {
        "recipe": ROOT / "recipes" / "quickstart.yaml",
        # The two-stage trainer only; the backbone's pretraining shortened (pre-built for both arms, not
        # measured), and the transfer's epochs below the recipe's 15 to keep the run short on 2 cores.
        "overrides": ["targets=[two_stage]", "stages.backbone.train.epochs=4"],
        "target": "two_stage",
        "cache": ["cache"],
        "backbone": "backbone",
        "grid": {"stages.two_stage.train.lr": [0.003, 0.01, 0.03, 0.1],
                 "stages.two_stage.train.epochs": [6, 10]},
    },
    "fashion_mnist": {
        "recipe": ROOT / "recipes" / "cache_reuse" / "fashion_mnist.yaml",
        # One two-stage trainer from the 2-bit cache; the backbone's pretraining shortened (it is
        # pre-built for both arms and not measured), the transfer's epochs reduced.
        "overrides": ["targets=[bits_2]", "stages.backbone.train.epochs=2"],
        "target": "bits_2",
        "cache": ["float_cache", "cache2"],  # the frozen forward runs in the float cache's build
        "backbone": "backbone",
        "grid": {"stages.bits_2.train.lr": [0.001, 0.002, 0.004, 0.008],
                 "stages.bits_2.train.epochs": [4, 6]},
    },
}


def stage_seconds(summary: dict[str, Any], name: str) -> tuple[float, str]:
    stage = next(s for s in summary["stages"] if s["name"] == name)
    return float(stage["seconds"]), str(stage["status"])


def fresh_store(backbone_store: Path, dest: Path) -> Path:
    shutil.copytree(backbone_store, dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--recipe", choices=sorted(SETUPS), default="quickstart")
    ap.add_argument("--results-dir", type=Path, default=None,
                    help="write the JSON here instead of benchmarks/results (a trial run must not "
                    "replace one)")
    args = ap.parse_args()
    setup = SETUPS[args.recipe]
    recipe, overrides, grid = setup["recipe"], list(setup["overrides"]), setup["grid"]
    variants = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        pipeline.run(recipe, [*overrides, f"targets=[{setup['backbone']}]"], store=work / "backbone-store",
                     output=work / "backbone-run", quiet=True)
        backbone_seconds = time.perf_counter() - start
        print(f"backbone pre-built in {backbone_seconds:.1f}s (not part of either arm)")

        independent = []
        start = time.perf_counter()
        for i, values in enumerate(variants):
            store = fresh_store(work / "backbone-store", work / f"store-{i}")
            t0 = time.perf_counter()
            result = pipeline.run(recipe, [*overrides, *(f"{k}={v}" for k, v in values.items())], store=store,
                                  output=work / f"run-{i}", quiet=True)
            wall = time.perf_counter() - t0
            cache_parts = [stage_seconds(result.summary, name) for name in setup["cache"]]
            cache_s = sum(seconds for seconds, _ in cache_parts)
            train_s, _ = stage_seconds(result.summary, setup["target"])
            assert all(status == "computed" for _, status in cache_parts), "each run builds its own cache"
            accuracy = result.summary["results"][setup["target"]]["best_val_accuracy"]
            independent.append({"values": values, "wall_seconds": round(wall, 3), "cache_seconds": cache_s,
                                "train_seconds": train_s, "val_accuracy": accuracy})
            print(f"independent {i + 1}/{len(variants)} {values}: {wall:.1f}s (cache {cache_s:.1f}s, "
                  f"training {train_s:.1f}s)")
        independent_wall = time.perf_counter() - start

        store = fresh_store(work / "backbone-store", work / "sweep-store")
        t0 = time.perf_counter()
        swept = pipeline.run_sweep(recipe, grid, overrides=overrides, store=store, output=work / "sweep",
                                   quiet=True)
        sweep_wall = time.perf_counter() - t0
        print(swept.summary_line)
        records = swept.variants
        assert all(r["status"] == "finished" for r in records)
        sweep_cache = [{"status": r["stages"][setup["cache"][0]]["status"],
                        "seconds": sum(r["stages"][name]["seconds"] for name in setup["cache"])}
                       for r in records]
        assert sum(s["status"] == "computed" for s in sweep_cache) == 1, "the sweep builds the cache once"

    cache_build = statistics.median(r["cache_seconds"] for r in independent)
    trainings = sum(r["train_seconds"] for r in independent)
    sweep_trainings = sum(r["train_seconds"] for r in records)
    sweep_cache_build = next(s["seconds"] for s in sweep_cache if s["status"] == "computed")
    ratio = sweep_wall / (cache_build + trainings)
    own_ratio = sweep_wall / (sweep_cache_build + sweep_trainings)
    print(f"{len(variants)} variants: sweep {sweep_wall:.1f}s, independent runs {independent_wall:.1f}s "
          f"({independent_wall / sweep_wall:.2f}x); one cache build {cache_build:.1f}s + {len(variants)} "
          f"trainings {trainings:.1f}s = {cache_build + trainings:.1f}s; sweep / that = {ratio:.3f} "
          f"(with the sweep's own parts: {own_ratio:.3f}; target <= 1.10)")
    path = write_result(
        f"sweep_{args.recipe}",
        {
            "question": f"wall time of a {len(variants)}-variant sweep (downstream settings only) against "
            f"{len(variants)} independent runs, and against one cache build + the {len(variants)} trainings",
            "settings": {
                "recipe": str(setup["recipe"].relative_to(ROOT)),
                "overrides": overrides,
                "grid": grid,
                "variants": len(variants),
                "target": setup["target"],
                "executor": "local (variants one after another in this process)",
                "backbone": "pre-built once, copied into every store of both arms (each arm's stores "
                f"start with only the backbone); its pretraining took {backbone_seconds:.1f}s, not counted",
                "process": "both arms in one process, imports paid before either; independent runs are "
                "pipeline.run calls, each into a fresh store",
            },
            "sweep_seconds": round(sweep_wall, 3),
            "independent_seconds": round(independent_wall, 3),
            "independent_over_sweep": round(independent_wall / sweep_wall, 3),
            "cache_build_seconds": round(cache_build, 3),
            "cache_build_seconds_all": [r["cache_seconds"] for r in independent],
            "training_seconds": [r["train_seconds"] for r in independent],
            "training_seconds_total": round(trainings, 3),
            "sweep_over_cache_build_plus_trainings": round(ratio, 4),
            "sweep_parts": {"cache_build_seconds": sweep_cache_build, "training_seconds": [r["train_seconds"]
                            for r in records], "ratio": round(own_ratio, 4)},
            # The target is read on the sweep's own parts, timed in the same pass: the independent arm
            # runs at another time, and on a shared machine its parts can differ by more than the bar.
            "headline": f"{len(variants)}-variant sweep {sweep_wall:.1f}s = {own_ratio:.3f}× its own cache "
            f"build + {len(variants)} trainings (target ≤ 1.10; {ratio:.3f}× the independent runs' parts); "
            f"{len(variants)} independent runs {independent_wall / sweep_wall:.2f}× the sweep",
            "targets": {"sweep_within_10pct_of_one_cache_build_plus_trainings": own_ratio <= 1.10},
            "independent_runs": independent,
            "sweep_variants": [{k: r.get(k) for k in ("id", "values", "seconds", "train_seconds",
                                                       "val_accuracy", "test_accuracy")} for r in records],
            "sweep_plan": swept.data["plan_lines"],
        },
        args.results_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
