"""NeuroFlux vs backpropagation vs classic local learning at the same memory budgets (issue: NeuroFlux).

Runs the stages of ``recipes/neuroflux/fashion_mnist.yaml`` through the real pipeline (decode stream,
store-backed spills, re-chunk, prefetch, early exit, export) at several training-memory budgets, each
method as its own target in one fresh store, all in this process and one after another.

How the paper's setting is scaled to this CPU and data: Fashion-MNIST at 32x32 (5000 training images,
the official test set), models at width 0.25, 4 epochs per block, and budgets expressed relative to
what backpropagation needs on the same model (the profiler's line for the whole network):

- ``below_bp``: 90% of what backpropagation needs at batch size 1 (it cannot run at all);
- ``bp4`` / ``bp16`` / ``bp64``: what backpropagation needs at batch 4 / 16 / 64.

Memory on a CPU is the toolkit's training-memory meter (saved tensors + weights + gradients + optimizer
state). With ``--device cuda`` it is the paper's setting: every layer, and backpropagation's whole network,
profiled with ``torch.cuda.max_memory_allocated`` over one real training step, so NeuroFlux and backprop
are compared at equal GPU memory budgets; the result goes to ``neuroflux_cuda.json`` with the GPU named.
Training time includes profiling, spill writes and per-epoch validation for every method (on the
recipe's ``val_per_epoch`` subset of the validation split, the same for every method; the exit is chosen
on the whole split).

Usage: python -m benchmarks.bench_neuroflux [--archs vgg11 vgg16 resnet18] [--epochs 4] [--per-class 500]
       [--device cuda] [--val-fraction F] [--seed N] [--quick]   (--quick: a few minutes' check of the code
       path, written under /tmp; --seed: another draw of the split, the weights and the order, written as
       neuroflux_seedN.json, so the exits' spread over seeds can be read beside the recipe's seed)
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks._device import device_info, require_device, result_name
from benchmarks._meta import RESULTS_DIR, write_result
from pipeline.context import RunContext
from pipeline.errors import StageError
from pipeline.methods.neuroflux.exit import ExitCandidate, choose_exit
from pipeline.methods.neuroflux.models import build_layer_net
from pipeline.methods.neuroflux.profiler import DEFAULT_BATCHES, profile_module
from pipeline.progress import Progress
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "neuroflux" / "fashion_mnist.yaml"
MIB = 2**20
TOLERANCES = (0.005, 0.01, 0.02)
# label -> (scale, batch): the budget is scale x what backpropagation needs at that batch size
BUDGETS = {"below_bp": (0.9, 1), "bp4": (1.0, 4), "bp16": (1.0, 16), "bp64": (1.0, 64)}
BACKPROP_FROM_BATCH = 16  # the neuroflux stage's default backprop_from_batch


def bp_profile(arch: str, width: float, device: torch.device) -> Any:
    net = build_layer_net(arch, 10, width_mult=width, seed=0).to(device)
    return profile_module(
        "the whole network", net, (3, 32, 32), num_classes=10, optimizer="adamw", batches=DEFAULT_BATCHES,
        device=device,
    )


def run_stage(
    base: dict[str, Any], store: Path, name: str, stage: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    recipe = copy.deepcopy(base)
    recipe["stages"] = {k: v for k, v in recipe["stages"].items() if k in ("fmnist", "data", "images")}
    recipe["stages"][name] = stage
    recipe["targets"] = [name]
    r = recipe_from_dict(recipe)
    ctx = RunContext(catalog=Catalog(store), recipe_name=r.name, progress=Progress(quiet=True),
                     device=str(device))
    start = time.perf_counter()
    try:
        metrics = next(rep for rep in Runner(r, ctx).run() if rep.name == name).metrics
    except StageError as exc:
        return {"runs": False, "error": str(exc).split(": ", 3)[-1]}
    return {"runs": True, "wall_seconds": time.perf_counter() - start, **metrics}


def summarize(rows: list[dict[str, Any]], first: str) -> dict[str, Any]:
    """The comparisons a reader wants from the rows of one run (a pure function of them)."""

    def pick(arch: str, budget: str, method: str) -> dict[str, Any]:
        return next(r for r in rows if (r["arch"], r["budget"], r["method"]) == (arch, budget, method))

    comparisons = []
    for r in rows:
        if r["method"] != "neuroflux" or not r["runs"]:
            continue
        bp = pick(r["arch"], r["budget"], "backprop")
        row = {
            "arch": r["arch"],
            "budget": r["budget"],
            "budget_mib": r["budget_mib"],
            "plan": r.get("plan", "blocks"),
            "bp_runs": bp["runs"],
            "nf_accuracy": r["accuracy"],
            "nf_train_seconds": r["train_seconds"],
            "nf_time_to_target_s": r["time_to_target_s"],
            "parameter_compression": r["parameter_compression"],
            "exit_layer": r["exit_layer"],
        }
        if bp["runs"]:
            row.update(
                bp_accuracy=bp["accuracy"],
                bp_train_seconds=bp["train_seconds"],
                bp_batch=bp["batch_size"],
                speedup_train_time=bp["train_seconds"] / r["train_seconds"],
                speedup_time_to_target=(bp["time_to_target_s"] / r["time_to_target_s"])
                if bp["time_to_target_s"] and r["time_to_target_s"]
                else None,
                accuracy_minus_bp=r["accuracy"] - bp["accuracy"],
            )
            # Never slower than backprop: where the planner picked backprop it is the same training (its
            # time ratio is run-to-run noise); where it trained blocks, they must reach the target (or end,
            # where neither reaches it) no later than backprop does.
            ratio = row["speedup_time_to_target"] or row["speedup_train_time"]
            row["never_slower_than_bp"] = row["plan"] == "backprop" or ratio >= 1.0
        comparisons.append(row)
    exits = []  # the exit rule at other tolerances, from the candidates' validation accuracy
    for r in rows:
        if not (r["method"].startswith("neuroflux") and r["runs"] and r.get("exit_candidates")):
            continue
        bp = pick(r["arch"], r["budget"], "backprop")
        cands = [ExitCandidate(c["layer"], c["val_acc"], c["parameters"]) for c in r["exit_candidates"]]
        test = {c["layer"]: c["test_acc"] for c in r["exit_candidates"]}
        for tol in TOLERANCES:
            chosen = choose_exit(cands, tolerance=tol)
            exits.append(
                {
                    "arch": r["arch"],
                    "budget": r["budget"],
                    "method": r["method"],
                    "tolerance": tol,
                    "exit_layer": chosen.layer,
                    "parameter_compression": r["full_parameters"] / chosen.parameters,
                    "test_acc": test[chosen.layer],
                    "test_acc_minus_bp": test[chosen.layer] - bp["accuracy"] if bp["runs"] else None,
                }
            )
    # Every exit's size and test accuracy against the full network as NeuroFlux trains it: every layer and
    # the last layer's head (the last exit). The network's own classifier never trains under local learning,
    # so the last exit is the full model whose accuracy an exit is compared with, and its parameters are the
    # ones an exit saves. ``parameter_compression`` (against the network with its own classifier, as the
    # stage reports it) is kept beside it.
    frontier = []
    for r in rows:
        if not (r["method"].startswith("neuroflux") and r["runs"] and r.get("exit_candidates")):
            continue
        cands = r["exit_candidates"]
        full, full_parameters = cands[-1]["test_acc"], cands[-1]["parameters"]
        points = [{"layer": c["layer"], "fewer_than_full": full_parameters / c["parameters"],
                   "parameter_compression": r["full_parameters"] / c["parameters"],
                   "test_acc": c["test_acc"], "minus_full_points": 100 * (c["test_acc"] - full)}
                  for c in cands]
        # The exits fine-tuned by the stage's search (exit_finetune_epochs), smallest first; the exit last.
        tuned = [{"layer": t["layer"], "fewer_than_full": full_parameters / cands[t["layer"]]["parameters"],
                  "parameter_compression": r["full_parameters"] / cands[t["layer"]]["parameters"],
                  "val_acc_before": t["val_acc_before"], "val_acc": t["val_acc"], "test_acc": t["test_acc"],
                  "minus_full_points": 100 * (t["test_acc"] - full), "accepted": t["accepted"],
                  "batch_size": t["batch_size"], "seconds": t["seconds"]}
                 for t in r.get("exit_finetune", [])]
        within = [p for p in points + tuned if p["minus_full_points"] >= -1.0]
        exit_point = {"layer": r["exit_layer"], "finetuned": bool(tuned),
                      "fewer_than_full": full_parameters / r["compact_parameters"],
                      "test_acc": r["accuracy"], "minus_full_points": 100 * (r["accuracy"] - full),
                      "search_seconds": r.get("exit_seconds")}
        exit_point["10x_within_1pt"] = (exit_point["fewer_than_full"] >= 10
                                        and exit_point["minus_full_points"] >= -1)
        frontier.append({
            "arch": r["arch"], "budget": r["budget"], "method": r["method"], "full_test_acc": full,
            "full_parameters": full_parameters, "points": points, "finetuned": tuned, "exit": exit_point,
            "max_fewer_within_1pt_of_full": max(p["fewer_than_full"] for p in within),
            "max_compression_within_1pt_of_full": max(p["parameter_compression"] for p in within),
        })
    spill32, spill8 = pick(first, "bp16", "neuroflux_blocks"), pick(first, "bp16", "neuroflux_spill8")
    summary = {
        "comparisons": comparisons,
        "trains_where_bp_cannot": any(c["budget"] == "below_bp" and not c["bp_runs"] for c in comparisons),
        "never_slower_than_bp_at_every_budget": all(
            c["never_slower_than_bp"] for c in comparisons if c["bp_runs"]),
        "spill_over_dataset_uint8": {
            "float32": [s["over_dataset_uint8"] for s in spill32.get("spills", [])],
            "8bit": [s["over_dataset_uint8"] for s in spill8.get("spills", [])],
        },
        "profile_r2_min": min(r["profile_r2_min"] for r in rows if r.get("profile_r2_min") is not None),
        "exits_at_other_tolerances": exits,
        "exit_frontier": frontier,
        "max_parameter_compression_within_1pt_of_full": max(
            (f["max_compression_within_1pt_of_full"] for f in frontier), default=None),
        "max_fewer_parameters_than_the_full_model_within_1pt": max(
            (f["max_fewer_within_1pt_of_full"] for f in frontier), default=None),
        "runs_with_10x_fewer_within_1pt_of_the_full_model": sum(
            f["max_fewer_within_1pt_of_full"] >= 10 for f in frontier),
        # What the stage's own exit rule picked (from validation data alone), against the full model on test.
        "exits_10x_fewer_within_1pt_of_the_full_model": sum(f["exit"]["10x_within_1pt"] for f in frontier),
        "exit_runs": len(frontier),
        "max_parameter_compression_within_1pt_of_bp": max(
            (
                e["parameter_compression"]
                for e in exits
                if e["test_acc_minus_bp"] is not None and e["test_acc_minus_bp"] >= -0.01
            ),
            default=None,
        ),
    }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", nargs="+", default=["vgg11", "vgg16", "resnet18"])
    ap.add_argument("--budgets", nargs="+", default=list(BUDGETS), help="for the first arch")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--per-class", type=int, default=500)
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: budgets read from the CUDA allocator")
    ap.add_argument("--quick", action="store_true",
                    help="check the code path in minutes: vgg11 at bp16, 1 epoch, 20 images per class, "
                    "written to /tmp unless --output-dir is given")
    ap.add_argument("--val-fraction", type=float, help="of the official train split (default: the recipe's); "
                    "the result is written as neuroflux_valPERCENT.json beside the recipe's")
    ap.add_argument("--seed", type=int, help="the recipe's seed (default: its own, 0): the split, the "
                    "initial weights and the batch order; another seed is written as neuroflux_seedN.json")
    ap.add_argument("--output-dir", type=Path, help="write the result here instead of benchmarks/results")
    ap.add_argument(
        "--resummarize",
        action="store_true",
        help="recompute the summary of the existing result file from its rows (no training)",
    )
    args = ap.parse_args()
    if args.resummarize:
        path = RESULTS_DIR / "neuroflux.json"
        data = json.loads(path.read_text())
        data["summary"] = summarize(data["rows"], data["settings"]["archs"][0])
        path.write_text(json.dumps(data, indent=2, default=float) + "\n")
        print(yaml.safe_dump(data["summary"], sort_keys=False))
        return
    device = require_device(args.device)
    if args.quick:
        args.archs, args.budgets, args.epochs, args.per_class = args.archs[:1], ["bp16"], 1, 20
        args.output_dir = args.output_dir or Path(tempfile.gettempdir()) / "bench-quick"
    torch.set_num_threads(args.threads)
    base = yaml.safe_load(RECIPE.read_text())
    base["stages"]["data"]["per_class"] = args.per_class
    if args.quick:  # 400 images of the official test split are enough to see the path run
        base["stages"]["data"].update(use_official_test=False, test_fraction=0.2)
    train = {**base["stages"]["neuroflux"]["train"], "epochs": args.epochs}
    # How the recipe picks and fine-tunes the exit (its neuroflux stage), for every local-learning method.
    exit_settings = {k: v for k, v in base["stages"]["neuroflux"].items() if k.startswith("exit_")}
    if args.val_fraction is not None:
        base["stages"]["data"]["val_fraction"] = args.val_fraction
    if args.seed is not None:
        base["seed"] = args.seed
    rows: list[dict[str, Any]] = []
    profiles = {}
    with tempfile.TemporaryDirectory(prefix="bench-neuroflux-") as tmp:
        store = Path(tmp) / "store"
        for a, arch in enumerate(args.archs):
            fit = bp_profile(arch, args.width, device)
            profiles[arch] = fit.as_dict()
            budgets = args.budgets if a == 0 else ["bp16"]
            for label in budgets:
                scale, batch = BUDGETS[label]
                # A few bytes over the line, so rounding never costs backprop the batch the label names.
                mib = (scale * fit.bytes_at(batch) + 64) / MIB
                common = {
                    "input": "images",
                    "arch": arch,
                    "width_mult": args.width,
                    "memory_budget_mib": mib,
                    "train": train,
                    "target_accuracy": args.target,
                    # every method's epochs checked on the same subset of the validation split
                    **{k: v for k, v in base["stages"]["neuroflux"].items() if k == "val_per_epoch"},
                }
                local = {"type": "neuroflux", **exit_settings, **common}
                methods = {
                    "backprop": {"type": "backprop", **common},
                    "neuroflux": local,
                }
                if batch >= BACKPROP_FROM_BATCH:  # the planner picks backprop: what blocks cost, their exits
                    methods["neuroflux_blocks"] = {**local, "backprop_from_batch": None}
                if a == 0:
                    methods["classic_ll"] = {**local, "variant": "classic_ll"}
                    if label == "bp16":  # spill storage with quantization
                        methods["neuroflux_spill8"] = {**local, "spill": {"bits": 8},
                                                       "backprop_from_batch": None}
                for method, stage in methods.items():
                    result = run_stage(base, store, method, stage, device)
                    result.update(arch=arch, budget=label, budget_mib=mib, method=method)
                    rows.append(result)
                    shown = {
                        k: result.get(k)
                        for k in (
                            "runs",
                            "batch_size",
                            "train_seconds",
                            "accuracy",
                            "time_to_target_s",
                            "exit_layer",
                            "parameter_compression",
                        )
                    }
                    print(f"{arch} {label} {mib:.2f} MiB {method}: {shown}", flush=True)

    summary = summarize(rows, args.archs[0])
    print(yaml.safe_dump(summary, sort_keys=False))
    name = "neuroflux" if args.val_fraction is None else f"neuroflux_val{round(100 * args.val_fraction)}"
    if args.seed is not None and args.seed != yaml.safe_load(RECIPE.read_text()).get("seed", 0):
        name += f"_seed{args.seed}"
    path = write_result(
        result_name(name, device),
        {
            "question": "NeuroFlux vs backprop vs classic local learning at equal training-memory budgets: "
            "time, time to target, accuracy, early-exit compression, spill size, profiler fit",
            "device": device_info(device),
            "memory_measured_by": "torch.cuda.max_memory_allocated" if device.type == "cuda"
            else "training-memory meter",
            "settings": {
                **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "recipe": str(RECIPE.relative_to(RECIPE.parents[2])),
                "budgets": {k: f"{s} x backprop's memory at batch {b}" for k, (s, b) in BUDGETS.items()},
                "data": "Fashion-MNIST (Debian package): per_class x 10 train, "
                f"{100 * base['stages']['data']['val_fraction']:g}% of the official train split as "
                "validation (the exit chosen on all of it; each epoch checked on "
                f"{base['stages']['neuroflux'].get('val_per_epoch') or 'all'} of them), the official 10000 "
                "test images",
                "seed": base.get("seed", 0),
            },
            "backprop_profiles": profiles,
            "rows": rows,
            "summary": summary,
        },
        directory=args.output_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
