"""The results page's section for ``cache_reuse_fashion_table4.json`` (``bench_fashion_table4.py``):
Cache & Reuse accuracy in the structure of the paper's Table 4."""

from __future__ import annotations

import math
from pathlib import Path

from .common import DASH, Rendered, Result, acc, cell, nbytes, new_figure, num, rows_of, table

RESULTS = ("cache_reuse_fashion_table4", "cache_reuse_fashion_table4_96px_cuda")
# Its GPU counterpart, still to be measured where no *_cuda.json is committed (the headline says so).
GPU_COMMANDS = {
    "cache_reuse_fashion_table4": "python -m benchmarks.bench_fashion_table4"
    " --device cuda --resolution 96"
}


def render(result: Result, results_dir: Path) -> Rendered:
    rows = rows_of(result.data)
    body = table(
        ["row", "bits", "mode", "test accuracy % (mean ± std)", "per seed %", "s/epoch", "cache size"],
        [
            [
                cell(r["row"]),
                num(r.get("bits")),
                cell(r.get("mode", DASH)),
                acc(r["accuracy_mean"], r.get("accuracy_std")),
                ", ".join(f"{100 * a:.2f}" for a in r.get("accuracies", [])) or DASH,
                num(r.get("epoch_seconds_steady")),
                nbytes(r["cache_bytes"]) if r.get("cache_bytes") else DASH,
            ]
            for r in rows
        ],
    )
    fig = new_figure()
    ax = fig.add_subplot()
    labels = [str(r["row"]) for r in rows]
    ax.bar(
        labels,
        [100 * r["accuracy_mean"] for r in rows],
        yerr=[100 * r.get("accuracy_std", 0) for r in rows],
        capsize=3,
        color="tab:blue",
    )
    low = min(100 * (r["accuracy_mean"] - r.get("accuracy_std", 0)) for r in rows)
    ax.set_ylim(max(0, math.floor(low / 5) * 5 - 5), 100)
    ax.set_ylabel("test accuracy (%)")
    ax.tick_params(axis="x", labelsize=8)
    for label in ax.get_xticklabels():
        label.set(rotation=20, ha="right")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("Table 4 rows: test accuracy, mean ± std over seeds", fontsize=10)
    figures = [("accuracy", "Test accuracy per row (error bars: std over seeds)", fig)]

    cached = [r for r in rows if r.get("cache_bytes")]
    if cached:
        fig = new_figure()
        ax = fig.add_subplot()
        ax.bar(
            [f"{r['row']}\n{r.get('bits')} bit" for r in cached],
            [r["cache_bytes"] / 2**20 for r in cached],
            color="tab:green",
        )
        ax.set_ylabel("cache size (MiB)")
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.set_title("Cache size by bits (train n-bit + val/test fp16)", fontsize=10)
        figures.append(("cache_size", "Cache size per row", fig))

    named = {r["row"]: r for r in rows}
    base = named.get("baseline") or next((r for r in rows if r.get("mode") == "single_stage"), None)
    pick = named.get("bits_2") or max(rows, key=lambda r: r["accuracy_mean"])
    headline = f"{pick['row']}: {acc(pick['accuracy_mean'], pick.get('accuracy_std'))}%"
    if pick.get("cache_bytes"):
        headline += f" (cache {nbytes(pick['cache_bytes'])})"
    if base is not None and base is not pick:
        headline += f" vs {base['row']} {acc(base['accuracy_mean'], base.get('accuracy_std'))}%"
    return Rendered(
        title="Cache & Reuse: accuracy in the structure of Table 4 (Fashion-MNIST transfer)",
        headline=headline,
        body=body,
        figures=figures,
    )
