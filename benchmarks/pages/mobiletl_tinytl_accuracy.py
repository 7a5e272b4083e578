"""The results page's section for ``mobiletl_tinytl_accuracy.json``
(``benchmarks/bench_mobiletl_tinytl_accuracy.py``): MobileTL and TinyTL accuracy."""

from __future__ import annotations

from pathlib import Path

from .common import DASH, Rendered, Result, acc, cell, nbytes, new_figure, num, rows_of, table

RESULTS = ("mobiletl_tinytl_accuracy",)


def render(result: Result, results_dir: Path) -> Rendered:
    rows = rows_of(result.data)
    body = table(
        [
            "row",
            "method",
            "lr",
            "test accuracy % (mean ± std)",
            "s/epoch",
            "trainable params",
            "activations analytic / measured",
            "training memory",
        ],
        [
            [
                cell(r["row"]),
                cell(r.get("method", DASH)),
                num(r.get("lr")),
                acc(r["accuracy_mean"], r.get("accuracy_std")),
                num(r.get("epoch_seconds_steady")),
                num(r.get("trainable_parameters")),
                f"{nbytes(r.get('activation_bytes'))} / {nbytes(r.get('activation_bytes_measured'))}",
                nbytes(r.get("total_bytes")),
            ]
            for r in rows
        ],
    )
    figures = []
    # Accuracy and memory side by side on shared rows: the trade-off the methods exist for, readable at a
    # glance (a scatter of nine close points made the labels collide).
    fig = new_figure(8, 0.4 * len(rows) + 1.2)
    labels = [str(r["row"]) for r in rows]
    ax = fig.add_subplot(1, 2, 1)
    ax.barh(
        labels,
        [100 * r["accuracy_mean"] for r in rows],
        xerr=[100 * r.get("accuracy_std", 0) for r in rows],
        capsize=3,
        color="tab:blue",
    )
    ax.invert_yaxis()
    ax.set_xlabel("test accuracy (%)")
    ax.grid(axis="x", alpha=0.3)
    ax.tick_params(axis="y", labelsize=8)
    if all(isinstance(r.get("total_bytes"), (int, float)) for r in rows):
        ax2 = fig.add_subplot(1, 2, 2, sharey=ax)
        ax2.barh(labels, [r["total_bytes"] / 2**20 for r in rows], color="tab:red")
        ax2.set_xlabel("training memory, analytic (MiB)")
        ax2.grid(axis="x", alpha=0.3)
        ax2.tick_params(axis="y", labelleft=False)
    fig.suptitle("Test accuracy and training memory per method", fontsize=10)
    figures.append(("accuracy_vs_memory", "Test accuracy (mean ± std over seeds) and training memory", fig))
    named = {r["row"]: r for r in rows}
    parts = []
    for key, label in (
        ("mobiletl", "MobileTL"),
        ("vanilla", "vanilla"),
        ("tinytl_lb", "TinyTL-L+B"),
        ("ft_last", "FT-Last"),
    ):
        if key in named:
            parts.append(f"{label} {acc(named[key]['accuracy_mean'], named[key].get('accuracy_std'))}%")
    if not parts:
        best = max(rows, key=lambda r: r["accuracy_mean"])
        parts.append(f"best {best['row']} {acc(best['accuracy_mean'], best.get('accuracy_std'))}%")
    return Rendered(
        title="MobileTL and TinyTL: accuracy on the Fashion-MNIST transfer task",
        headline=", ".join(parts),
        body=body,
        figures=figures,
    )
