"""``choose`` against an exhaustive grid of the same candidates on the Fashion-MNIST transfer task (issue 24).

The task is recipes/tinytl/fashion_mnist.yaml's (MobileNetV2 width 0.5 pretrained on classes 0-4,
transferred to classes 5-9 with 100 training images per class), tuning its ``vanilla`` trainer
(lr 0.002, AdamW, cosine) over cut x bits x method: by default cut 5,7 x bits 2,4 x method
vanilla,mobiletl,tinytl = 12 candidates, full length 10 epochs, eta 3 (rungs of 1, 1, 3 and 10
epochs). Both searches start from a store holding only the pretrained backbone (built once into
``--base-store`` and copied), so each pays for its own caches:

- choose: ``pipeline.choose.search.choose`` (successive halving);
- grid: every candidate that fits the budgets trained at the full epochs, through the same
  ``train_candidates`` that choose uses; its best by validation accuracy (the rule choose uses).

Reported: the pick and the grid's best (settings, validation and test accuracy), where the pick
ranks in the grid, and the cost of each (training seconds, epochs trained, cache-build seconds,
wall time), with the ratio. Epoch times are measured on a shared 2-core host: other work on the
machine changes them (``machine.load_average`` in the JSON says how busy it was).

Usage: python -m benchmarks.bench_choose [--epochs 10] [--eta 3] [--space cut=5,7 ...] [--base-store DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._meta import write_result
from pipeline.api import load_recipe, run, run_context
from pipeline.choose.halving import Trained, train_candidates
from pipeline.choose.search import choose
from pipeline.choose.space import parse_space
from pipeline.runner import Runner

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tinytl" / "fashion_mnist.yaml"
TARGET = "vanilla"
SPACE = ["cut=5,7", "bits=2,4", "method=vanilla,mobiletl,tinytl"]


def log(line: str) -> None:
    print(line, flush=True)


def backbone_store(base: Path, overrides: list[str], tmp: Path) -> tuple[str, float]:
    """(fingerprint of the pretrained backbone, seconds it took to build, 0 if it was stored)."""
    recipe = load_recipe(RECIPE, [*overrides, "targets=[backbone]"])
    fingerprint = Runner(recipe, run_context(recipe, store=base, quiet=True)).fingerprints["backbone"]
    start = time.perf_counter()
    result = run(recipe, store=base, output=tmp / "backbone-run", quiet=True)
    built = result.stages["backbone"].status == "computed"
    return fingerprint, (time.perf_counter() - start) if built else 0.0


def fresh_store(base: Path, fingerprint: str, where: Path) -> Path:
    """A new store holding only the backbone's entry (a committed entry is a self-contained folder)."""
    (where / "entries").mkdir(parents=True)
    shutil.copytree(base / "entries" / fingerprint, where / "entries" / fingerprint)
    return where


def trained_row(t: Trained, settings: dict[str, Any]) -> dict[str, Any]:
    return {"id": t.candidate, **{k: str(v) for k, v in settings.items()}, "epochs": t.epochs,
            "val_accuracy": t.val_accuracy, "val_loss": t.val_loss, "test_accuracy": t.test_accuracy,
            "epoch_seconds": round(t.epoch_seconds, 3), "train_seconds": round(t.train_seconds, 2),
            "build_seconds": round(t.build_seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10, help="full training length (the last rung's)")
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every run (run.threads)")
    ap.add_argument("--space", action="append", help=f"KEY=V1,V2 (default: {' '.join(SPACE)})")
    ap.add_argument("--max-memory", type=int, default=64 * 2**20, help="bytes (default 64 MiB)")
    ap.add_argument("--max-epoch-seconds", type=float, default=60.0)
    ap.add_argument("--base-store", type=Path, help="store with (or to get) the pretrained backbone; "
                    "default: a temporary one")
    ap.add_argument("--results-dir", type=Path, help="write the JSON here instead of benchmarks/results")
    ap.add_argument("--work-dir", type=Path, help="keep the stores and run records here (default: temporary)")
    args = ap.parse_args()
    space_texts = args.space or SPACE
    # One torch thread: on a shared 2-core host, two threads per process contend with the other work and
    # an epoch takes many times longer (the Fashion-MNIST tables in benchmarks/README.md use 1 too).
    overrides = [f"stages.{TARGET}.train.epochs={args.epochs}", f"run.threads={args.threads}"]

    work = tempfile.TemporaryDirectory(prefix="bench-choose-") if args.work_dir is None else None
    with work if work is not None else contextlib.nullcontext(str(args.work_dir)) as tmp_dir:
        tmp = Path(tmp_dir)
        base = args.base_store or tmp / "base"
        fingerprint, backbone_seconds = backbone_store(base, overrides, tmp)
        built = f"built in {backbone_seconds:.0f}s" if backbone_seconds else "stored"
        log(f"backbone {fingerprint[:12]} ({built})")

        start = time.perf_counter()
        chosen = choose(RECIPE, max_memory=args.max_memory, max_epoch_seconds=args.max_epoch_seconds,
                        space=parse_space(space_texts), target=TARGET, eta=args.eta, overrides=overrides,
                        store=fresh_store(base, fingerprint, tmp / "choose-store"), output=tmp / "choose",
                        log=log)
        choose_wall = time.perf_counter() - start
        fitting = [m.candidate for m in chosen.metered if m.excluded is None]
        settings = {c.id: c.settings for c in chosen.candidates}

        start = time.perf_counter()
        grid = train_candidates(chosen.recipe, fitting, args.epochs, target=TARGET,
                                store=fresh_store(base, fingerprint, tmp / "grid-store"), output=tmp / "grid",
                                log=log, rung=0)
        grid_wall = time.perf_counter() - start
        # The raw numbers first: the summary below is derived from them alone.
        (tmp / "raw.json").write_text(json.dumps({"grid": [vars(t) for t in grid], "grid_wall": grid_wall,
                                                  "choose_wall": choose_wall, "choose_cost": chosen.cost()},
                                                 default=str))

    pick = chosen.halving.rungs[-1].trained[chosen.halving.winner]
    ranked = sorted(grid, key=lambda t: (-t.val_accuracy, t.val_loss if t.val_loss is not None else 1e9))
    best = ranked[0]
    by_test = max(grid, key=lambda t: t.test_accuracy)
    pick_in_grid = next(t for t in grid if t.candidate == pick.candidate)
    cost = chosen.cost()
    grid_cost = {"trainings": len(grid), "epochs_trained": args.epochs * len(grid),
                 "train_seconds": sum(t.train_seconds for t in grid),
                 "build_seconds": sum(t.build_seconds for t in grid), "wall_seconds": grid_wall}
    payload = {
        "settings": {"recipe": str(RECIPE.relative_to(ROOT)), "target": TARGET, "space": space_texts,
                     "threads": args.threads,
                     "candidates": len(chosen.candidates), "fitting": len(fitting), "epochs": args.epochs,
                     "eta": args.eta, "max_memory_bytes": args.max_memory,
                     "max_epoch_seconds": args.max_epoch_seconds,
                     "rungs": [{"epochs": r.epochs, "trained": len(r.trained)} for r in chosen.halving.rungs],
                     "backbone_seconds": backbone_seconds},
        "choose": {"pick": pick.candidate, "pick_settings": settings[pick.candidate],
                   "val_accuracy": pick.val_accuracy, "test_accuracy": pick.test_accuracy,
                   "pick_rank_in_grid_by_val": ranked.index(pick_in_grid) + 1,
                   "cost": {**cost, "wall_seconds": choose_wall}},
        "grid": {"best": best.candidate, "best_settings": settings[best.candidate],
                 "val_accuracy": best.val_accuracy, "test_accuracy": best.test_accuracy,
                 "best_by_test": by_test.candidate, "best_by_test_accuracy": by_test.test_accuracy,
                 "cost": grid_cost},
        "cost_ratio_train_seconds": grid_cost["train_seconds"] / max(cost["train_seconds"], 1e-9),
        "cost_ratio_epochs": grid_cost["epochs_trained"] / max(cost["epochs_trained"], 1),
        "cost_ratio_wall": grid_wall / max(choose_wall, 1e-9),
        "grid_rows": [trained_row(t, settings[t.candidate]) for t in grid],
        "choose_rows": [trained_row(t, settings[t.candidate]) | {"rung": i}
                        for i, rung in enumerate(chosen.halving.rungs) for t in rung.trained.values()],
    }
    payload["headline"] = (
        f"choose picked {pick.candidate} ({' '.join(f'{k}={v}' for k, v in settings[pick.candidate].items())}"
        "): "
        f"test {pick.test_accuracy:.3f} vs the grid's best by val {best.test_accuracy:.3f} "
        f"({best.candidate}); {cost['epochs_trained']} vs {grid_cost['epochs_trained']} epochs, "
        f"{payload['cost_ratio_train_seconds']:.1f}x less training time"
    )
    path = write_result("choose_fashion_mnist", payload, args.results_dir)
    log(payload["headline"])
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
