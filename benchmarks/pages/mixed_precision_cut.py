"""The results page's section for ``mixed_precision_cut.json`` (``benchmarks/bench_mixed_precision_cut.py``):
the partition search's pick against the best cut, retrained, per recipe and seed, and the agreement plot
(the search's score of every cut against that cut's retrained accuracy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from .common import (
    DASH,
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


def _points(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else DASH


def _at_delta(d: Any) -> str:
    if not isinstance(d, dict):
        return DASH
    return f"{num(d.get('train_last_blocks'))} / {_points(d.get('gap_points'))}"


def agreement_plot(results: list[dict[str, Any]]) -> Figure:
    """Per recipe: every cut of every seed as (search score, retrained accuracy); the pick starred."""
    fig = new_figure(4.6 * len(results), 4.2)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for i, r in enumerate(results):
        ax = fig.add_subplot(1, len(results), i + 1)
        lo, hi = 100.0, 0.0
        for j, s in enumerate(r["seeds"]):
            color = colors[j % len(colors)]
            rows = [c for c in s["cuts"] if isinstance(c.get("probe_score"), (int, float))]
            xs = [100 * c["probe_score"] for c in rows]
            ys = [100 * c["retrained_accuracy"] for c in rows]
            ax.scatter(xs, ys, s=18, color=color, label=f"seed {s['seed']}")
            for c, x, y in zip(rows, xs, ys, strict=True):
                ax.annotate(str(c["train_last_blocks"]), (x, y), fontsize=6, xytext=(3, -3),
                            textcoords="offset points", color=color)
            pick = next((c for c in rows if c["train_last_blocks"] == s["pick"]["train_last_blocks"]), None)
            if pick is not None:
                ax.scatter([100 * pick["probe_score"]], [100 * pick["retrained_accuracy"]], marker="*", s=170,
                           color=color, edgecolors="black", linewidths=0.6, zorder=3)
            lo, hi = min([lo, *xs, *ys]), max([hi, *xs, *ys])
        ax.plot([lo, hi], [lo, hi], color="grey", ls=":", lw=1, label="score = accuracy")
        ax.set_xlabel("search score: probe's target val accuracy (%)")
        ax.set_ylabel("retrained test accuracy, int8 + bf16 (%)")
        ax.set_title(f"{r['arch']}: score vs retrained, per cut (★ pick)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def render(result: Result, results_dir: Path) -> Rendered:
    data = result.data
    results = rows_of(data, "results")
    summary = []
    commands = []
    for r in results:
        for s in r["seeds"]:
            q, f, part = s["quantization_only"], s["final"], s["partition"]
            summary.append(
                [
                    cell(r["arch"]),
                    num(s["seed"]),
                    num(s["pick"]["train_last_blocks"]),
                    acc(s["pick"]["retrained_accuracy"]),
                    num(s["best"]["train_last_blocks"]),
                    acc(s["best"]["retrained_accuracy"]),
                    _points(s["gap_points"]),
                    f"{num(q['train_last_blocks'])} / {_points(q['gap_points'])}",
                    _at_delta(s.get("probe_at_search_delta")),
                    num(s.get("rank_correlation")),
                    acc(f["mixed"]),
                    acc(f["bf16_only"]),
                    acc(f["fp32"]),
                    f"{num(part.get('quantization_seconds'))} + {num(part.get('probe_seconds'))}",
                ]
            )
        command = r.get("settings", {}).get("command")
        if isinstance(command, str):
            commands.append(command)
    body = table(
        [
            "model",
            "seed",
            "pick (tlb)",
            "pick %",
            "best cut (tlb)",
            "best %",
            "points apart",
            "quantization alone: tlb / points apart",
            "probe with the search's δ: tlb / points apart",
            "rank corr. score vs retrained",
            "int8+bf16 % at pick",
            "bf16-only %",
            "fp32 %",
            "search s (NSGA-II + probe)",
        ],
        summary,
    )
    for r in results:
        seeds = r["seeds"]
        if not seeds or not list_of_records(seeds[0].get("cuts")):
            continue
        by_cut: dict[int, list[dict[str, Any]]] = {}
        for s in seeds:
            for c in s["cuts"]:
                by_cut.setdefault(c["train_last_blocks"], []).append(c)
        body += ["", f"Every cut, {r['arch']} (search score = the probe's target val accuracy; retrained = "
                 "int8 bottom + bf16 top, test accuracy; per seed " + ", ".join(str(s["seed"]) for s in seeds)
                 + "):", ""]
        body += table(
            ["trained blocks", "cut layer", "layers below", "source acc., bottom int8 % (seed 0)",
             "search score %", "retrained %"],
            [
                [
                    num(t),
                    cell(cs[0].get("cut_layer", DASH)),
                    num(cs[0].get("layers_below")),
                    acc(cs[0].get("source_accuracy_int8")),
                    " / ".join(acc(c.get("probe_score")) for c in cs),
                    " / ".join(acc(c.get("retrained_accuracy")) for c in cs),
                ]
                for t, cs in sorted(by_cut.items())
            ],
        )
    figures = []
    if all(list_of_records(s.get("cuts")) for r in results for s in r["seeds"]):
        figures.append(("agreement", "Search score vs retrained accuracy, every cut",
                        agreement_plot(results)))
    existing = results_dir / f"{result.key}.png"
    images = [("Accuracy vs cut (drawn by the benchmark)", existing)] if existing.is_file() else []
    headline = "pick vs best cut, points apart: " + "; ".join(
        f"{r['arch']} " + " / ".join(_points(s["gap_points"]) for s in r["seeds"]) for r in results
    )
    return Rendered(
        title="Mixed precision: where to cut (partition search vs every cut retrained)",
        headline=headline,
        body=body,
        figures=figures,
        images=images,
        commands=commands,
    )
