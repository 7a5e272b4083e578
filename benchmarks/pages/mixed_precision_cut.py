"""The results page's section for ``mixed_precision_cut.json`` (``benchmarks/bench_mixed_precision_cut.py``):
the mixed-precision robustness search and cut."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from .common import (
    DASH,
    Check,
    Rendered,
    Result,
    acc,
    cell,
    list_of_records,
    new_figure,
    num,
    rows_of,
    table,
)

RESULTS = ("mixed_precision_cut",)


def _mp_plot(results: list[dict[str, Any]]) -> Figure:
    fig = new_figure(4 * len(results), 3.4)
    for i, r in enumerate(results):
        ax = fig.add_subplot(1, len(results), i + 1)
        curve = sorted(r["exhaustive"], key=lambda e: e["layers_below"])
        xs = [e["layers_below"] for e in curve]
        ax.plot(xs, [100 * e["fp32_accuracy"] for e in curve], "o-", label="fp32 top")
        ax.plot(xs, [100 * e["bf16_accuracy"] for e in curve], "s-", label="bf16 top")
        chosen = r.get("empirical", {}).get("bf16_accuracy_at_selected_cut")
        if isinstance(chosen, (int, float)):
            ax.axhline(100 * chosen, color="grey", ls="--", lw=1, label="at selected cut")
        ax.set_xlabel("frozen layers below the cut")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(r["arch"], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def render(result: Result, results_dir: Path) -> Rendered:
    data = result.data
    results = rows_of(data, "results")
    summary = []
    checks = []
    commands = []
    for r in results:
        part, emp, fin, cost = r["partition"], r.get("empirical", {}), r.get("final", {}), r.get("cost", {})
        mean = fin.get("mean", {})
        summary.append(
            [
                cell(r["arch"]),
                f"{cell(part['cut_layer'])} (tlb {num(part.get('train_last_blocks'))})",
                num(part.get("quantized_layers")),
                f"{num(cost.get('search_evaluations'))} / {num(cost.get('search_seconds'))}",
                f"{num(cost.get('exhaustive_trainings'))} / {num(cost.get('exhaustive_seconds'))}",
                f"tlb {num(emp.get('best_fp32_cut'))} / {num(emp.get('best_bf16_cut'))}",
                acc(mean.get("mixed")),
                acc(mean.get("bf16_only")),
                acc(mean.get("fp32")),
                acc(emp.get("cut_before_classifier_bf16")),
            ]
        )
        if isinstance(fin.get("int8_within_delta_of_bf16_only"), bool):
            checks.append(
                Check(
                    f"{r['arch']}: int8 bottom + bf16 top within δ={num(r.get('delta'))} of bf16-only",
                    fin["int8_within_delta_of_bf16_only"],
                    "target",
                )
            )
        command = r.get("settings", {}).get("command")
        if isinstance(command, str):
            commands.append(command)
    body = table(
        [
            "model",
            "cut (algorithm)",
            "layers int8",
            "search evals / s",
            "exhaustive trainings / s",
            "empirical best cut fp32 / bf16",
            "int8+bf16 %",
            "bf16-only %",
            "fp32 %",
            "cut before classifier %",
        ],
        summary,
    )
    for r in results:
        if not list_of_records(r.get("exhaustive")):
            continue
        body += ["", f"Exhaustive freeze-one-by-one, {r['arch']} (one seed):", ""]
        body += table(
            [
                "trained blocks",
                "cut layer",
                "layers below",
                "fp32 %",
                "bf16 %",
                "fp32 train s",
                "bf16 train s",
            ],
            [
                [
                    num(e.get("train_last_blocks")),
                    cell(e.get("cut_layer", DASH)),
                    num(e.get("layers_below")),
                    acc(e.get("fp32_accuracy")),
                    acc(e.get("bf16_accuracy")),
                    num(e.get("fp32_train_seconds")),
                    num(e.get("bf16_train_seconds")),
                ]
                for e in r["exhaustive"]
            ],
        )
    # The benchmark draws its own Figure-3 plot next to the JSON; show that one rather than a second
    # version of it, and only draw one here when it is missing.
    existing = results_dir / f"{result.key}.png"
    images, figures = [], []
    if existing.is_file():
        images.append(("Accuracy vs cut (drawn by the benchmark)", existing))
    elif all(list_of_records(r.get("exhaustive")) for r in results):
        figures.append(("accuracy_vs_cut", "Accuracy vs cut", _mp_plot(results)))
    headline = "int8+bf16 vs bf16-only: " + ", ".join(
        f"{r['arch']} {acc(r.get('final', {}).get('mean', {}).get('mixed'))} / "
        f"{acc(r.get('final', {}).get('mean', {}).get('bf16_only'))}%"
        for r in results
    )
    return Rendered(
        title="Mixed precision: where to cut (partition search vs exhaustive)",
        headline=headline,
        body=body,
        figures=figures,
        images=images,
        checks=checks,
        commands=commands,
    )
