"""Where to cut: the partition search's pick vs the empirical best cut (the paper's Figure 3 procedure).

For each backbone recipe in recipes/mixed_precision/ (ResNet-18, SqueezeNet 1.1 on the
Fashion-MNIST transfer task), through the real pipeline and one store:
1. the ``partition`` stage (NSGA-II + δ rule; stored, so a rerun reuses it): its cut,
   wall time and number of evaluations;
2. the exhaustive procedure: freeze the layers below every candidate cut in turn and
   retrain the rest, once with an fp32 top and once with a bf16 top (fp32 frozen
   features from a float cache; same optimizer, epochs and seed for every cut). The
   highest cut is "cut before the classifier" (only the classifier trains);
3. at the selected cut, the deployed combination, int8 bottom + bf16 top, against the
   bf16-only model (bf16 bottom + bf16 top) and fp32, over ``--seeds``.
Writes benchmarks/results/mixed_precision_cut.json, a Markdown table (.md) and a
Figure-3-style plot (.png).

Usage: python -m benchmarks.bench_mixed_precision_cut [--archs resnet18 squeezenet1_1] [--store DIR]
       [--seeds 0 1 2] [--epochs N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks._meta import RESULTS_DIR, command, write_result
from pipeline.context import RunContext
from pipeline.progress import Progress
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "mixed_precision"
RECIPE_FILES = {
    "resnet18": RECIPES / "resnet18_fashion.yaml",
    "squeezenet1_1": RECIPES / "squeezenet_fashion.yaml",
}
SHARED = ("fmnist", "source", "target", "backbone", "source_images", "partition", "target_images")


THREADS: list[int] = []  # --threads, when given, wins over the recipe's run.threads


def run(data: dict[str, Any], store: Path, targets: list[str], quiet: bool) -> tuple[Runner, dict[str, Any]]:
    recipe = recipe_from_dict({**data, "targets": targets}, source=data.get("name", "<bench>"))
    torch.set_num_threads(THREADS[0] if THREADS else recipe.run.threads or torch.get_num_threads())
    runner = Runner(
        recipe,
        RunContext(
            catalog=Catalog(store), seed=recipe.seed, recipe_name=recipe.name, progress=Progress(quiet=quiet)
        ),
    )
    return runner, {r.name: r for r in runner.run()}


def exhaustive_stages(base: dict[str, Any], tlb: int, epochs: int | None) -> dict[str, Any]:
    train = dict(base["stages"]["fp32"]["train"])
    if epochs:
        train["epochs"] = epochs
    k = f"c{tlb}"
    return {
        f"{k}_ff": {
            "type": "frozen_forward",
            "input": "target_images",
            "model": "backbone",
            "train_last_blocks": tlb,
        },
        f"{k}_q": {"type": "quantize", "input": f"{k}_ff", "bits": 32, "eval_bits": 32},
        f"{k}_cache": {"type": "cache", "input": f"{k}_q"},
        f"{k}_read": {"type": "dequantize", "input": f"{k}_cache"},
        f"{k}_fp32": {
            "type": "finetune",
            "model": "backbone",
            "features": f"{k}_read",
            "batch_size": 32,
            "train": train,
        },
        f"{k}_bf16": {
            "type": "finetune_mixed",
            "top_precision": "bf16",
            "model": "backbone",
            "features": f"{k}_read",
            "batch_size": 32,
            "train": train,
        },
    }


def within(accs: dict[int, float], delta: float) -> int:
    """Highest cut (fewest trained blocks) whose accuracy is within relative delta of the best."""
    best = max(accs.values())
    return min(t for t, a in accs.items() if a >= (1 - delta) * best)


def bench_arch(arch: str, store: Path, seeds: list[int], epochs: int | None, quiet: bool) -> dict[str, Any]:
    base = yaml.safe_load(RECIPE_FILES[arch].read_text())
    delta = base["stages"]["partition"].get("delta", 0.01)
    t0 = time.perf_counter()
    runner, reports = run(base, store, ["partition"], quiet)
    part = runner.output("partition")
    print(
        f"[{arch}] partition ({reports['partition'].status}): cut after {part['cut_layer']} "
        f"(train_last_blocks {part['train_last_blocks']}), {part['evaluations']} evaluations, "
        f"{part['seconds']:.0f}s"
    )
    # --- exhaustive freeze-one-by-one ----------------------------------------------------------
    shared = {k: v for k, v in base["stages"].items() if k in SHARED}
    rows = []
    for cut in part["cuts"]:
        tlb = cut["train_last_blocks"]
        stages = {**shared, **exhaustive_stages(base, tlb, epochs)}
        k = f"c{tlb}"
        _, rep = run({**base, "stages": stages}, store, [f"{k}_fp32", f"{k}_bf16"], quiet)
        feature_s = rep[f"{k}_cache"].seconds if rep[f"{k}_cache"].status == "computed" else 0.0
        row = {
            "train_last_blocks": tlb,
            "cut_layer": cut["layer"],
            "layers_below": cut["layers_below"],
            "fp32_accuracy": rep[f"{k}_fp32"].metrics["accuracy"],
            "bf16_accuracy": rep[f"{k}_bf16"].metrics["accuracy"],
            "fp32_train_seconds": rep[f"{k}_fp32"].seconds,
            "bf16_train_seconds": rep[f"{k}_bf16"].seconds,
            "feature_seconds": feature_s,
            "trainable_parameters": rep[f"{k}_fp32"].metrics["trainable_parameters"],
        }
        rows.append(row)
        print(
            f"[{arch}] cut after {cut['layer']:<24} tlb {tlb:>2}: fp32 {row['fp32_accuracy']:.4f}  "
            f"bf16 {row['bf16_accuracy']:.4f}  ({row['fp32_train_seconds']:.0f}s + "
            f"{row['bf16_train_seconds']:.0f}s)"
        )
    fp32_acc = {r["train_last_blocks"]: r["fp32_accuracy"] for r in rows}
    bf16_acc = {r["train_last_blocks"]: r["bf16_accuracy"] for r in rows}
    # --- the deployed combination at the selected cut, over seeds -------------------------------
    tlb = part["train_last_blocks"]
    final: dict[str, list[Any]] = {name: [] for name in ("mixed", "bf16_only", "fp32")}
    statuses = {}
    for seed in seeds:
        data = yaml.safe_load(RECIPE_FILES[arch].read_text())
        for ff in ("int8_features", "bf16_features", "fp32_features"):
            data["stages"][ff]["train_last_blocks"] = tlb
        for name in final:
            data["stages"][name]["seed"] = seed
            if epochs:
                data["stages"][name]["train"] = {**data["stages"][name]["train"], "epochs": epochs}
        r, rep = run(data, store, list(final), quiet)
        for name in final:
            final[name].append(rep[name].metrics["accuracy"])
        statuses[seed] = {n: rep[n].metrics.get("bottom_precision", "fp32") for n in final}
        print(f"[{arch}] seed {seed} at tlb {tlb}: " + "  ".join(f"{n} {final[n][-1]:.4f}" for n in final))
    means = {n: statistics.fmean(v) for n, v in final.items()}
    exhaustive_s = sum(r["fp32_train_seconds"] + r["bf16_train_seconds"] + r["feature_seconds"] for r in rows)
    return {
        "arch": arch,
        "recipe": str(RECIPE_FILES[arch].relative_to(RECIPES.parents[1])),
        "delta": delta,
        "partition": {
            k: part[k]
            for k in (
                "cut_layer",
                "cut_node",
                "train_last_blocks",
                "quantized_layers",
                "float_accuracy",
                "best_accuracy",
                "evaluations",
                "samples_evaluated",
                "seconds",
                "eval_samples",
                "precision",
                "robustness",
            )
        },
        "selected_scheme": part["selected"],
        "pareto_front": part["front"],
        "exhaustive": rows,
        "empirical": {
            "best_fp32_cut": max(fp32_acc, key=lambda t: (fp32_acc[t], -t)),
            "best_bf16_cut": max(bf16_acc, key=lambda t: (bf16_acc[t], -t)),
            "highest_fp32_cut_within_delta": within(fp32_acc, delta),
            "highest_bf16_cut_within_delta": within(bf16_acc, delta),
            "cut_before_classifier_fp32": fp32_acc.get(0),
            "cut_before_classifier_bf16": bf16_acc.get(0),
            "bf16_accuracy_at_selected_cut": bf16_acc.get(tlb),
        },
        "final": {
            "seeds": seeds,
            "accuracies": final,
            "mean": means,
            "bottom_precision": statuses,
            "int8_within_delta_of_bf16_only": means["mixed"] >= (1 - delta) * means["bf16_only"],
        },
        "cost": {
            "search_seconds": part["seconds"],
            "search_evaluations": part["evaluations"],
            "exhaustive_seconds": exhaustive_s,
            "exhaustive_trainings": 2 * len(rows),
            "exhaustive_epochs": sum(2 * (epochs or base["stages"]["fp32"]["train"]["epochs"]) for _ in rows),
            "wall_seconds_this_run": time.perf_counter() - t0,
        },
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.6), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        rows = sorted(res["exhaustive"], key=lambda r: r["layers_below"])
        x = [r["layers_below"] for r in rows]
        ax.plot(x, [r["fp32_accuracy"] for r in rows], "o-", label="retrain top in fp32")
        ax.plot(x, [r["bf16_accuracy"] for r in rows], "s--", label="retrain top in bf16")
        head = next((r for r in rows if r["train_last_blocks"] == 0), None)
        if head is not None:
            ax.axhline(head["bf16_accuracy"], color="gray", ls=":", label="cut before the classifier (bf16)")
        sel = res["partition"]["quantized_layers"]
        ax.axvline(sel, color="red", ls="-.", label=f"algorithm's cut ({res['partition']['cut_layer']})")
        mixed = res["final"]["mean"]["mixed"]
        ax.plot([sel], [mixed], "r*", ms=14, label="int8 bottom + bf16 top (mean over seeds)")
        ax.set_xticks(x)
        ax.set_xticklabels(
            [r["cut_layer"].replace("blocks.", "b") for r in rows], rotation=60, ha="right", fontsize=7
        )
        ax.set_xlabel("cut after layer (everything below frozen)")
        ax.set_ylabel("test accuracy (Fashion-MNIST classes 5-9)")
        ax.set_title(f"{res['arch']}: accuracy vs cut")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | cut (algorithm) | layers int8 | search: evals / s | exhaustive: trainings / s | "
        "empirical best cut fp32 / bf16 | highest cut within δ fp32 / bf16 | int8+bf16 | bf16-only | fp32 | "
        "cut before classifier (bf16) |",
        "|" + "---|" * 11,
    ]
    for r in results:
        p, e, f, c = r["partition"], r["empirical"], r["final"]["mean"], r["cost"]
        lines.append(
            f"| {r['arch']} | {p['cut_layer']} (tlb {p['train_last_blocks']}) | {p['quantized_layers']} | "
            f"{c['search_evaluations']} / {c['search_seconds']:.0f} | {c['exhaustive_trainings']} / "
            f"{c['exhaustive_seconds']:.0f} | tlb {e['best_fp32_cut']} / {e['best_bf16_cut']} | "
            f"tlb {e['highest_fp32_cut_within_delta']} / {e['highest_bf16_cut_within_delta']} | "
            f"{f['mixed']:.4f} | {f['bf16_only']:.4f} | {f['fp32']:.4f} | "
            f"{e['cut_before_classifier_bf16']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=list(RECIPE_FILES), choices=list(RECIPE_FILES))
    ap.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=None, help="override the transfer epochs (default: recipe)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the recipe's)")
    ap.add_argument("--replot", action="store_true", help="only redo the table and plot from the last JSON")
    args = ap.parse_args()
    if args.threads:
        THREADS.append(args.threads)
    import tempfile

    tmp = None
    if args.store:
        store = Path(args.store)
        store.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="mpcut-")
        store = Path(tmp.name)
    results = (
        [] if args.replot else [bench_arch(a, store, args.seeds, args.epochs, args.quiet) for a in args.archs]
    )
    for r in results:  # per arch, so that merged results keep how each was measured
        r["settings"] = {
            "seeds": args.seeds,
            "epochs": args.epochs or "recipe",
            "threads": args.threads or "recipe",
            "torch_threads": torch.get_num_threads(),
            "command": command(),
        }
    # Archs not rerun keep their last measured rows (trainings are not stored, so a rerun would retrain).
    previous = RESULTS_DIR / "mixed_precision_cut.json"
    if previous.exists():
        old = json.loads(previous.read_text())
        kept = [r for r in old.get("results", []) if args.replot or r["arch"] not in args.archs]
        results = sorted(kept + results, key=lambda r: list(RECIPE_FILES).index(r["arch"]))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = RESULTS_DIR / "mixed_precision_cut.png"
    plot(results, png)
    md = table(results)
    (RESULTS_DIR / "mixed_precision_cut.md").write_text(
        "# Mixed-precision partitioning: algorithm's cut vs exhaustive freeze-one-by-one\n\n"
        "Fashion-MNIST, pretrain on classes 0-4 (1000/class), transfer to 5-9 (100 train images/class, "
        "official test split: 5000 images), 32x32 inputs; tlb = train_last_blocks (0 = only the "
        "classifier trains).\n\n" + md + f"\n![accuracy vs cut]({png.name})\n"
    )
    print(md)
    if args.replot:
        print(f"rewrote {png} and {png.with_suffix('.md')}")
        return
    path = write_result(
        "mixed_precision_cut",
        {
            "question": "does the partition search pick the cut the exhaustive procedure finds, at lower "
            "cost, and "
            "does int8 bottom + bf16 top stay within delta of bf16-only?",
            "settings": {
                "archs": args.archs,
                "seeds": args.seeds,
                "epochs_override": args.epochs,
                "threads_override": args.threads,
                "torch_threads": torch.get_num_threads(),
                "reduced": "32x32 inputs, 1000 source images/class, 100 target images/class; exhaustive "
                "curve with one seed (0), final comparison over the seeds",
            },
            "results": results,
        },
    )
    print(f"wrote {path}, {png}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
