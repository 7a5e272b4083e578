"""Where to cut: the partition search's pick vs the empirically best cut (the paper's Figure 3 procedure).

For each backbone recipe in recipes/mixed_precision/ (ResNet-18, SqueezeNet 1.1 on the Fashion-MNIST
transfer task), through the real pipeline and one store, for every seed:
1. the ``partition`` stage with that seed (NSGA-II over per-layer bits on the source task, then the
   transfer probe over the int8-feasible cuts and the δ rule): its pick, its score for every cut
   (the probe's target validation accuracy), the source accuracy of every cut's bottom at int8 (what
   the quantization search alone sees), wall time and evaluations;
2. the exhaustive procedure: at every candidate cut, the deployed combination (int8 bottom from the
   recipe's ``int8_features``, bf16 top trained like the recipe's ``mixed``, with that seed) retrained
   and tested on the official test split;
3. at the pick, int8 bottom + bf16 top against bf16-only and fp32 (the recipe's three trainers).
The agreement per seed: the pick's retrained accuracy against the best cut's, in points; also the cut
the quantization search alone would take (the highest int8-feasible one). Writes
benchmarks/results/mixed_precision_cut.json, a Markdown table (.md) and a Figure-3-style plot (.png).
Trained results are store entries: a rerun with the same store retrains nothing.

Usage: python -m benchmarks.bench_mixed_precision_cut [--archs resnet18 squeezenet1_1] [--store DIR]
       [--seeds 0 1 2] [--epochs N] [--threads N] [--replot]
"""

from __future__ import annotations

import argparse
import copy
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
AGREEMENT_POINTS = 1.0  # the pick must be within this many points of the best cut's accuracy
FINAL = ("mixed", "bf16_only", "fp32")

THREADS: list[int] = []  # --threads, when given, wins over the recipe's run.threads


def run(data: dict[str, Any], store: Path, targets: list[str], quiet: bool) -> tuple[Runner, dict[str, Any]]:
    recipe = recipe_from_dict({**data, "targets": targets}, source=data.get("name", "<bench>"))
    threads = recipe.run.threads if isinstance(recipe.run.threads, int) else torch.get_num_threads()
    torch.set_num_threads(THREADS[0] if THREADS else threads)
    runner = Runner(
        recipe,
        RunContext(
            catalog=Catalog(store), seed=recipe.seed, recipe_name=recipe.name, progress=Progress(quiet=quiet)
        ),
    )
    return runner, {r.name: r for r in runner.run()}


def recipe_for(arch: str, seed: int, epochs: int | None) -> dict[str, Any]:
    """The recipe with the search's and the trainers' seed set, and ``epochs`` (when given) for the
    probe and every trainer alike: the probe measures the retraining it predicts."""
    data = yaml.safe_load(RECIPE_FILES[arch].read_text())
    stages = data["stages"]
    stages["partition"]["seed"] = seed
    for name in (*FINAL, "cache4"):
        stages[name]["seed"] = seed
    if epochs:
        trainers = (*FINAL, "cache4")
        for train in (stages["partition"]["probe"]["train"], *(stages[n]["train"] for n in trainers)):
            train["epochs"] = epochs
    return data


def cut_stages(data: dict[str, Any], tlb: int) -> dict[str, Any]:
    """The recipe's deployed combination at cut ``tlb``: its ``int8_features`` bottom and its ``mixed``
    trainer (same settings and seed), so the retraining at the pick is the recipe's own ``mixed``
    (one store entry, trained once)."""
    stages = data["stages"]
    k = f"c{tlb}"
    return {
        f"{k}_int8": {**copy.deepcopy(stages["int8_features"]), "train_last_blocks": tlb},
        f"{k}_float": {**stages["int8_float"], "input": f"{k}_int8"},
        f"{k}_cache": {**stages["int8_cache"], "input": f"{k}_float"},
        f"{k}_read": {**stages["int8_read"], "input": f"{k}_cache"},
        f"{k}_mixed": {**copy.deepcopy(stages["mixed"]), "features": f"{k}_read"},
    }


def rank_correlation(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rho (average ranks for ties); None when either side is constant."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for t in range(i, j + 1):
                out[order[t]] = (i + j) / 2
            i = j + 1
        return out

    if len(xs) < 2 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(ranks(xs), ranks(ys))


def _at_delta(part: Any, acc: dict[int, float], delta: float) -> dict[str, Any] | None:
    """The cut the probe's stored scores give under tolerance ``delta``, and its retrained accuracy."""
    from pipeline.methods.mixed_precision.transfer import select_cut

    records = (part.get("probe") or {}).get("cuts")
    if not records:
        return None
    tlb = select_cut(records, delta)["train_last_blocks"]
    best = max(acc.values())
    return {"delta": delta, "train_last_blocks": tlb, "retrained_accuracy": acc.get(tlb),
            "gap_points": 100 * (best - acc[tlb]) if tlb in acc else None}


def bench_seed(arch: str, seed: int, store: Path, epochs: int | None, quiet: bool) -> dict[str, Any]:
    data = recipe_for(arch, seed, epochs)
    runner, reports = run(data, store, ["partition"], quiet)
    part = runner.output("partition")
    print(f"[{arch}] seed {seed}: partition ({reports['partition'].status}): {part.summary()}", flush=True)
    probe = {r["train_last_blocks"]: r for r in (part.get("probe") or {}).get("cuts", [])}
    shared = {k: v for k, v in data["stages"].items() if k in SHARED}
    rows = []
    for cut in part["cuts"]:
        tlb = cut["train_last_blocks"]
        k = f"c{tlb}"
        _, rep = run({**data, "stages": {**shared, **cut_stages(data, tlb)}}, store, [f"{k}_mixed"], quiet)
        m = rep[f"{k}_mixed"]
        p = probe.get(tlb)
        row = {
            "train_last_blocks": tlb,
            "cut_layer": cut["layer"],
            "layers_below": cut["layers_below"],
            "source_accuracy_int8": cut.get("source_accuracy_int8"),
            "int8_within_delta": cut.get("int8_within_delta"),
            "probe_score": p["score"] if p else None,
            "probe_best_epoch": p["best_epoch"] if p else None,
            "probe_seconds": p["seconds"] if p else None,
            "retrained_accuracy": m.metrics["accuracy"],
            "retrained_best_val_accuracy": m.metrics["best_val_accuracy"],
            # the stored build's epoch times: right also when this run reused the training
            "retrain_seconds": sum(m.metrics.get("epoch_seconds_all") or []) or m.seconds,
            "retrain_status": m.status,
            "trainable_parameters": m.metrics["trainable_parameters"],
        }
        rows.append(row)
        print(
            f"[{arch}] seed {seed} tlb {tlb:>2} ({cut['layer']}): probe "
            f"{row['probe_score'] if p else float('nan'):.4f}  retrained {row['retrained_accuracy']:.4f}"
            f"  ({m.status}, {m.seconds:.0f}s)",
            flush=True,
        )
    acc = {r["train_last_blocks"]: r["retrained_accuracy"] for r in rows}
    best = max(acc, key=lambda t: (acc[t], -t))  # ties: the higher cut (fewer trained blocks)
    pick = part["train_last_blocks"]
    q_cut = next((c for c in part["cuts"] if c["layers_below"] == part.get("int8_quantized_layers")), None)
    q_tlb = q_cut["train_last_blocks"] if q_cut else None
    # the deployed combination and its baselines at the pick (mixed is the exhaustive row: reused)
    final_data = copy.deepcopy(data)
    for ff in ("int8_features", "bf16_features", "fp32_features"):
        final_data["stages"][ff]["train_last_blocks"] = pick
    _, rep = run(final_data, store, list(FINAL), quiet)
    final = {n: rep[n].metrics["accuracy"] for n in FINAL}
    scored = [r for r in rows if r["probe_score"] is not None]
    out: dict[str, Any] = {
        "seed": seed,
        "partition": {
            k: part.get(k)
            for k in (
                "cut_layer",
                "train_last_blocks",
                "quantized_layers",
                "int8_quantized_layers",
                "float_accuracy",
                "best_accuracy",
                "evaluations",
                "samples_evaluated",
                "quantization_seconds",
                "seconds",
                "eval_samples",
            )
        }
        | {
            "probe_seconds": (part.get("probe") or {}).get("seconds"),
            "probe_epochs": (part.get("probe") or {}).get("epochs"),
            "status": reports["partition"].status,
        },
        "cuts": rows,
        "pick": {"train_last_blocks": pick, "retrained_accuracy": acc.get(pick)},
        "best": {"train_last_blocks": best, "retrained_accuracy": acc[best]},
        "gap_points": 100 * (acc[best] - acc[pick]) if pick in acc else None,
        "quantization_only": {
            "train_last_blocks": q_tlb,
            "retrained_accuracy": acc.get(q_tlb) if q_tlb is not None else None,
            "gap_points": 100 * (acc[best] - acc[q_tlb]) if q_tlb in acc else None,
        },
        # the probe's scores under the search's δ instead of probe.delta (Definition 7's tolerance)
        "probe_at_search_delta": _at_delta(part, acc, delta=data["stages"]["partition"].get("delta", 0.01)),
        "rank_correlation": rank_correlation(
            [r["probe_score"] for r in scored], [r["retrained_accuracy"] for r in scored]
        ),
        "final": final,
    }
    out["within_agreement"] = out["gap_points"] is not None and out["gap_points"] <= AGREEMENT_POINTS + 1e-9
    print(
        f"[{arch}] seed {seed}: pick tlb {pick} {acc.get(pick, float('nan')):.4f} vs best tlb {best} "
        f"{acc[best]:.4f} ({out['gap_points']:.2f} points); quantization alone: tlb {q_tlb}; at the pick "
        + "  ".join(f"{n} {v:.4f}" for n, v in final.items()),
        flush=True,
    )
    return out


def bench_arch(arch: str, store: Path, seeds: list[int], epochs: int | None, quiet: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    base = yaml.safe_load(RECIPE_FILES[arch].read_text())
    delta = base["stages"]["partition"].get("delta", 0.01)
    per_seed = [bench_seed(arch, s, store, epochs, quiet) for s in seeds]
    means = {n: statistics.fmean(s["final"][n] for s in per_seed) for n in FINAL}
    gaps = [s["gap_points"] for s in per_seed]
    return {
        "arch": arch,
        "recipe": str(RECIPE_FILES[arch].relative_to(RECIPES.parents[1])),
        "delta": delta,
        "epochs": epochs or base["stages"]["mixed"]["train"]["epochs"],
        "seeds": per_seed,
        "agreement": {
            "points": AGREEMENT_POINTS,
            "all_within": all(s["within_agreement"] for s in per_seed),
            "max_gap_points": max(gaps),
            "quantization_only_max_gap_points": max(
                (s["quantization_only"]["gap_points"] for s in per_seed
                 if s["quantization_only"]["gap_points"] is not None),
                default=None,
            ),
        },
        "final_mean": means,
        "int8_within_delta_of_bf16_only": means["mixed"] >= (1 - delta) * means["bf16_only"],
        "cost": {
            "search_seconds_mean": statistics.fmean(s["partition"]["seconds"] for s in per_seed),
            "quantization_seconds_mean": statistics.fmean(
                s["partition"]["quantization_seconds"] for s in per_seed
            ),
            "probe_seconds_mean": statistics.fmean(s["partition"]["probe_seconds"] or 0.0 for s in per_seed),
            "search_evaluations_mean": statistics.fmean(s["partition"]["evaluations"] for s in per_seed),
            "exhaustive_seconds_mean": statistics.fmean(
                sum(r["retrain_seconds"] for r in s["cuts"]) for s in per_seed
            ),
            "exhaustive_trainings_per_seed": len(per_seed[0]["cuts"]),
            "wall_seconds_this_run": time.perf_counter() - t0,
        },
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, res in zip(axes[0], results, strict=True):
        for i, s in enumerate(res["seeds"]):
            c = colors[i % len(colors)]
            rows = sorted(s["cuts"], key=lambda r: r["layers_below"])
            x = [r["layers_below"] for r in rows]
            ax.plot(x, [100 * r["retrained_accuracy"] for r in rows], "o-", color=c,
                    label=f"seed {s['seed']}: retrained (test)")
            scored = [r for r in rows if r["probe_score"] is not None]
            ax.plot([r["layers_below"] for r in scored], [100 * r["probe_score"] for r in scored], "x--",
                    color=c, alpha=0.7, label=f"seed {s['seed']}: search score (probe, val)")
            pick = next(r for r in rows if r["train_last_blocks"] == s["pick"]["train_last_blocks"])
            ax.plot([pick["layers_below"]], [100 * pick["retrained_accuracy"]], "*", color=c, ms=16, mec="k")
        first = sorted(res["seeds"][0]["cuts"], key=lambda r: r["layers_below"])
        ax.plot([r["layers_below"] for r in first], [100 * (r["source_accuracy_int8"] or 0) for r in first],
                "s:", color="gray", label="source accuracy, bottom at int8 (quantization signal)")
        ax.set_xticks([r["layers_below"] for r in first])
        ax.set_xticklabels(
            [f"{r['cut_layer'].replace('blocks.', 'b')}\n(tlb {r['train_last_blocks']})" for r in first],
            rotation=60, ha="right", fontsize=7,
        )
        ax.set_xlabel("cut after layer (everything below frozen, int8); ★ = the search's pick")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"{res['arch']}: accuracy vs cut")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | seed | pick (tlb) | pick % | best cut (tlb) | best % | points apart | quantization alone "
        "(tlb) / points apart | probe with the search's δ (tlb) / points apart | rank corr. score vs "
        "retrained | int8+bf16 | bf16-only | fp32 | search s |",
        "|" + "---|" * 14,
    ]
    for r in results:
        for s in r["seeds"]:
            q, f = s["quantization_only"], s["final"]
            rho = s["rank_correlation"]
            d = s.get("probe_at_search_delta") or {}
            lines.append(
                f"| {r['arch']} | {s['seed']} | {s['pick']['train_last_blocks']} | "
                f"{100 * s['pick']['retrained_accuracy']:.2f} | {s['best']['train_last_blocks']} | "
                f"{100 * s['best']['retrained_accuracy']:.2f} | {s['gap_points']:.2f} | "
                f"{q['train_last_blocks']} / {q['gap_points']:.2f} | "
                f"{d.get('train_last_blocks', '–')} / {d.get('gap_points', float('nan')):.2f} | "
                f"{'–' if rho is None else f'{rho:.2f}'} | {100 * f['mixed']:.2f} | "
                f"{100 * f['bf16_only']:.2f} | {100 * f['fp32']:.2f} | {s['partition']['seconds']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=list(RECIPE_FILES), choices=list(RECIPE_FILES))
    ap.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=None,
                    help="transfer epochs for the probe and every trainer (default: the recipe's)")
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
    # Archs not rerun keep their last measured rows.
    previous = RESULTS_DIR / "mixed_precision_cut.json"
    if previous.exists():
        old = json.loads(previous.read_text())
        kept = [
            r for r in old.get("results", [])
            if (args.replot or r["arch"] not in args.archs) and "seeds" in r and isinstance(r["seeds"], list)
        ]
        results = sorted(kept + results, key=lambda r: list(RECIPE_FILES).index(r["arch"]))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = RESULTS_DIR / "mixed_precision_cut.png"
    plot(results, png)
    md = table(results)
    (RESULTS_DIR / "mixed_precision_cut.md").write_text(
        "# Mixed-precision partitioning: the search's pick vs the best cut, retrained\n\n"
        "Fashion-MNIST, pretrain on classes 0-4 (1000/class), transfer to 5-9 (100 train images/class, "
        "val 120/class, official test split: 5000 images), 32x32 inputs; tlb = train_last_blocks (0 = only "
        "the classifier trains). Retrained: int8 bottom + bf16 top at every cut, test accuracy. Points "
        "apart: best cut's accuracy minus the pick's. Quantization alone: the highest cut whose int8 bottom "
        "is within δ on the source task (the search without the transfer probe).\n\n"
        + md
        + f"\n![accuracy vs cut]({png.name})\n"
    )
    print(md)
    if args.replot:
        print(f"rewrote {png} and {png.with_suffix('.md')}")
        return
    targets = {}
    for r in results:
        for s in r["seeds"]:
            name = (f"{r['arch']} seed {s['seed']}: the search's pick within {AGREEMENT_POINTS:g} point of "
                    "the best cut, retrained")
            targets[name] = s["within_agreement"]
        targets[f"{r['arch']}: int8 bottom + bf16 top within δ={r['delta']} of bf16-only at the pick"] = r[
            "int8_within_delta_of_bf16_only"
        ]
    path = write_result(
        "mixed_precision_cut",
        {
            "question": "does the partition search pick a cut whose retrained accuracy is within 1 point of "
            "the best cut's (Figure 3), for every seed, and does int8 bottom + bf16 top stay within delta of "
            "bf16-only there?",
            "settings": {
                "archs": [r["arch"] for r in results],
                "seeds": args.seeds,
                "epochs_override": args.epochs,
                "threads_override": args.threads,
                "torch_threads": torch.get_num_threads(),
                "reduced": "32x32 inputs, 1000 source images/class, 100 target train images/class; every "
                "seed searches and retrains every cut",
            },
            "targets": targets,
            "results": results,
        },
    )
    print(f"wrote {path}, {png}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
