"""The results page's section for ``neuroflux.json`` (``benchmarks/bench_neuroflux.py``):
NeuroFlux against backpropagation and classic local learning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import (
    DASH,
    Check,
    Rendered,
    Result,
    acc,
    cell,
    new_figure,
    num,
    pct,
    rows_of,
    span,
    table,
    times,
)

# neuroflux_val10: the same run with a validation split five times the recipe's (--val-fraction 0.1);
# neuroflux_seedN: the same run at another seed (--seed N: another split, initial weights and batch order);
# neuroflux_amd_epyc: the recipe's seed on the AMD EPYC, the other CPU this machine kind comes with
RESULTS = ("neuroflux", "neuroflux_cuda", "neuroflux_val10", "neuroflux_seed1", "neuroflux_seed2",
           "neuroflux_amd_epyc")
# Its GPU counterpart, still to be measured where no *_cuda.json is committed (the headline says so).
GPU_COMMANDS = {"neuroflux": "python -m benchmarks.bench_neuroflux --device cuda --threads 16"}


def _nf_batches(r: dict[str, Any]) -> str:
    """How a method used the budget: its batch (backprop) or its blocks as 'layers: batch'."""
    if not r.get("runs"):
        return "cannot run"
    if r.get("blocks"):
        return ", ".join(
            f"{b['layers'][0]}–{b['layers'][-1]}: {b['batch_size']}"
            if len(b["layers"]) > 1
            else f"{b['layers'][0]}: {b['batch_size']}"
            for b in r["blocks"]
        )
    return f"batch {r.get('batch_size')}"


def render(result: Result, results_dir: Path) -> Rendered:
    data = result.data
    rows = rows_of(data)

    def find(arch: str, budget: str, method: str) -> dict[str, Any] | None:
        return next(
            (r for r in rows if (r["arch"], r["budget"], r["method"]) == (arch, budget, method)), None
        )

    body = table(
        [
            "model",
            "budget",
            "method",
            "batch / blocks (layers: batch)",
            "train s",
            "time to target s",
            "test acc",
            "exit layer",
            "fewer parameters",
            "spill / dataset (uint8)",
        ],
        [
            [
                cell(r["arch"]),
                f"{r['budget']} ({num(r['budget_mib'])} MiB)",
                cell(r["method"]),
                _nf_batches(r),
                num(r.get("train_seconds")),
                num(r.get("time_to_target_s")),
                acc(r.get("accuracy")),
                num(r.get("exit_layer")),
                times(r.get("parameter_compression")),
                ", ".join(f"{s['over_dataset_uint8']:.2f}×" for s in r.get("spills", [])) or DASH,
            ]
            for r in rows
        ],
    )
    pairs = [
        (r, find(r["arch"], r["budget"], "backprop"))
        for r in rows
        if r["method"] == "neuroflux" and r.get("runs")
    ]
    both = [(nf, bp) for nf, bp in pairs if bp is not None and bp.get("runs")]
    speedups = [bp["train_seconds"] / nf["train_seconds"] for nf, bp in both]
    gaps = [nf["accuracy"] - bp["accuracy"] for nf, bp in both]
    comparable = [
        (r, find(r["arch"], r["budget"], "backprop"))
        for r in rows
        if r.get("runs") and r.get("parameter_compression")
    ]
    compression_ok = [
        r["parameter_compression"]
        for r, bp in comparable
        if bp is not None and bp.get("runs") and r["accuracy"] >= bp["accuracy"] - 0.01
    ]
    exits = data.get("summary", {}).get("exits_at_other_tolerances") or []
    compression_ok += [
        e["parameter_compression"]
        for e in exits
        if e.get("test_acc_minus_bp") is not None and e["test_acc_minus_bp"] >= -0.01
    ]
    # The bench's own verdict (time to target; where the planner trained by backpropagation, the same
    # training as the backprop row); results written before the planner had one: training time.
    never_slower = data.get("summary", {}).get("never_slower_than_bp_at_every_budget")
    checks = [
        Check(
            "neuroflux_never_slower_than_bp_at_every_budget_both_run",
            bool(never_slower) if never_slower is not None else bool(speedups) and min(speedups) >= 1,
            "target",
        ),
        Check("neuroflux_accuracy_within_1pt_of_bp", bool(gaps) and min(gaps) >= -0.01, "target"),
        Check(
            "trains_where_bp_cannot",
            any(bp is not None and not bp.get("runs") for _, bp in pairs),
            "target",
        ),
        Check("exit_10x_fewer_parameters_within_1pt_of_bp", max(compression_ok, default=0) >= 10, "target"),
    ]
    summary = data.get("summary", {})
    frontier = summary.get("exit_frontier") or []
    if frontier and "max_fewer_within_1pt_of_full" in frontier[0]:
        best_full = summary.get("max_fewer_parameters_than_the_full_model_within_1pt") or 0
        checks.append(Check("exit_10x_fewer_parameters_within_1pt_of_the_full_model", best_full >= 10,
                            "target"))
        if "exit" in frontier[0]:
            checks.append(Check("exit_rule_picks_10x_fewer_within_1pt_of_the_full_model_in_every_run",
                                summary.get("exits_10x_fewer_within_1pt_of_the_full_model")
                                == summary.get("exit_runs"), "target"))
        body += ["", "Every exit against the full model as NeuroFlux trains it (every layer and the last "
                 "layer's head): how many times fewer parameters, and the difference in test accuracy "
                 "(points); then the exits the stage's search fine-tuned (`exit_finetune_epochs`, smallest "
                 "first) and the exit its rule picked from validation data:", ""]

        def points(ps: list[dict[str, Any]]) -> str:
            shown = ", ".join(f"{p['fewer_than_full']:.1f}×: {p['minus_full_points']:+.1f}" for p in ps)
            return shown or DASH

        def chosen(e: dict[str, Any] | None) -> str:
            if e is None:
                return DASH
            return (f"layer {e['layer']}, {e['fewer_than_full']:.1f}×: {e['minus_full_points']:+.1f}"
                    + (f" ({e['search_seconds']:.1f} s)" if e.get("finetuned") else ""))

        body += table(
            ["model", "budget", "method", "full model: parameters, test acc", "exits as trained (fewer: pt)",
             "fine-tuned", "the rule's exit", "most fewer within 1 pt"],
            [[cell(f["arch"]), cell(f["budget"]), cell(f["method"]),
              f"{f['full_parameters']:,}, {acc(f['full_test_acc'])}", points(f["points"]),
              points(f.get("finetuned", [])), chosen(f.get("exit")),
              times(f["max_fewer_within_1pt_of_full"])] for f in frontier],
        )
    r2 = summary.get("profile_r2_min")
    body += ["", f"Profiler fit: lowest R² over every layer of every run {num(r2)}."]
    if exits:
        body += [
            "",
            "The exit rule at other tolerances (chosen on validation accuracy; test accuracy reported):",
            "",
        ]
        body += table(
            [
                "model",
                "budget",
                "method",
                "tolerance",
                "exit layer",
                "fewer parameters",
                "test acc",
                "vs backprop",
            ],
            [
                [
                    cell(e["arch"]),
                    cell(e["budget"]),
                    cell(e["method"]),
                    pct(e["tolerance"]),
                    num(e["exit_layer"]),
                    times(e["parameter_compression"]),
                    acc(e["test_acc"]),
                    DASH if e.get("test_acc_minus_bp") is None else f"{100 * e['test_acc_minus_bp']:+.1f} pt",
                ]
                for e in exits
            ],
        )
    curves = [(r, find(r["arch"], r["budget"], "backprop")) for r in rows if r["method"] == "neuroflux"]
    curves = [(nf, bp) for nf, bp in curves if nf.get("runs") and nf.get("val_curve")]
    figures = []
    if curves:
        cols = min(3, len(curves))
        rows_n = -(-len(curves) // cols)
        fig = new_figure(width=3.4 * cols, height=3.0 * rows_n)
        for k, (nf, bp) in enumerate(curves):
            ax = fig.add_subplot(rows_n, cols, k + 1)
            for r in (nf, bp, find(nf["arch"], nf["budget"], "classic_ll")):
                if r is not None and r.get("runs") and r.get("val_curve"):
                    ax.plot(
                        [t for t, _ in r["val_curve"]],
                        [a for _, a in r["val_curve"]],
                        marker=".",
                        label=r["method"],
                    )
            ax.set_title(f"{nf['arch']} {nf['budget']} ({nf['budget_mib']:.1f} MiB)", fontsize=9)
            ax.set_xlabel("seconds", fontsize=8)
            ax.grid(alpha=0.3)
            if k % cols == 0:
                ax.set_ylabel("best val accuracy so far", fontsize=8)
            ax.legend(fontsize=7)
        fig.tight_layout()
        figures.append(("time_to_accuracy", "Validation accuracy over training time at each budget", fig))
    parts = []
    planned_bp = [nf for nf, _ in both if nf.get("plan") == "backprop"]
    block_speedups = [bp["train_seconds"] / nf["train_seconds"] for nf, bp in both
                      if nf.get("plan", "blocks") == "blocks"]
    if planned_bp:
        parts.append(f"the planner trains by backprop at {len(planned_bp)} of {len(both)} budgets")
    if block_speedups:
        parts.append(f"training in blocks {span(block_speedups, times)} faster than backprop, equal budgets")
    block_to_target = [bp["time_to_target_s"] / nf["time_to_target_s"] for nf, bp in both
                       if nf.get("plan", "blocks") == "blocks" and nf.get("time_to_target_s")
                       and bp.get("time_to_target_s")]
    if block_to_target:
        parts.append(f"time to target {span(block_to_target, times)} shorter")
    if gaps:
        parts.append(
            f"test accuracy {span([100 * g for g in gaps], lambda x: f'{x:+.1f}')} points vs backprop"
        )
    headline = "; ".join(parts) or "see section"
    return Rendered(
        title="NeuroFlux vs backpropagation vs classic local learning at equal memory budgets",
        headline=headline,
        body=body,
        figures=figures,
        checks=checks,
    )
