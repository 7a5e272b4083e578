"""The results page's section for ``memory.json`` (``benchmarks/bench_memory.py``):
the memory meter's estimates against measured peaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import (
    DASH,
    Rendered,
    Result,
    cell,
    grouped_bars,
    list_of_records,
    nbytes,
    new_figure,
    num,
    pct,
    table,
    times,
)

RESULTS = ("memory",)


def _training_memory_table(rows: list[dict[str, Any]]) -> list[str]:
    saving = next((k for k in rows[0] if k.startswith("total_saving_vs_")), None)
    header = [
        "row",
        "method",
        "trainable params",
        "activations analytic / measured",
        "weights",
        "gradients",
        "optimizer",
        "total analytic",
        "total measured",
        "step ms",
    ]
    if saving:
        header.append("less memory than " + saving.removeprefix("total_saving_vs_"))
    out = []
    for r in rows:
        line = [
            cell(r["row"]),
            cell(r.get("method", DASH)),
            num(r.get("trainable_parameters")),
            f"{nbytes(r.get('activation_bytes'))} / {nbytes(r.get('measured_bytes'))}",
            nbytes(r.get("parameter_bytes")),
            nbytes(r.get("gradient_bytes")),
            nbytes(r.get("optimizer_bytes")),
            nbytes(r["total_bytes"]),
            nbytes(r.get("total_measured_bytes")),
            num(r.get("step_ms")),
        ]
        if saving:
            line.append(times(r.get(saving)))
        out.append(line)
    return table(header, out)


def render(result: Result, results_dir: Path) -> Rendered:
    data = result.data
    settings = data.get("settings", {})
    body: list[str] = []
    figures = []
    blocks = data.get("blocks")
    if list_of_records(blocks):
        body += [f"**Blocks** ({cell(settings.get('blocks', ''), 200)}):", ""]
        # results written before the meter's map convention have no map columns
        maps = all("activation_bytes_map" in b for b in blocks)
        header = ["block", "expansion", "method", "activations analytic", "measured", "measured / analytic"]
        if maps:
            header[3:6] = [
                "activations analytic (mask)",
                "analytic (map)",
                "measured",
                "measured / mask",
                "measured / map",
            ]
        header += ["parameters", "step ms", "reduction vs vanilla"] + (["reduction (map)"] if maps else [])
        rows = []
        for b in blocks:
            row = [
                cell(b["block"]),
                num(b.get("expansion")),
                cell(b["method"]),
                nbytes(b["activation_bytes"]),
            ]
            row += [nbytes(b["activation_bytes_map"])] if maps else []
            row += [nbytes(b.get("measured_bytes")), times(b.get("measured_over_analytic"))]
            row += [times(b["measured_over_map"])] if maps else []
            row += [num(b.get("parameters")), num(b.get("step_ms")), pct(b.get("reduction_vs_vanilla"))]
            row += [pct(b["reduction_vs_vanilla_map"])] if maps else []
            rows.append(row)
        body += table(header, rows)
        fig = new_figure(10, 4.4)
        ax = fig.add_subplot()
        labels = [
            f"{b['block']} t={b['expansion']}\n{b['method'].removeprefix('mobiletl:')}"
            if b.get("expansion") is not None
            else f"{b['block']}\n{b['method']}"
            for b in blocks
        ]
        series = [
            ("analytic (mask)" if maps else "analytic", [b["activation_bytes"] / 2**20 for b in blocks])
        ]
        series += [("analytic (map)", [b["activation_bytes_map"] / 2**20 for b in blocks])] if maps else []
        series += [("measured", [(b.get("measured_bytes") or 0) / 2**20 for b in blocks])]
        grouped_bars(ax, labels, series)
        ax.tick_params(axis="x", labelsize=7, rotation=90)
        # The rotated labels take the space below the axes: keep the legend inside, where bars are low.
        ax.legend(fontsize=8, loc="upper left")
        ax.set_ylabel("saved activations (MiB)")
        ax.set_title("Activation memory per block: vanilla vs MobileTL variants", fontsize=10)
        fig.tight_layout()
        figures.append(("blocks", "Activation memory of one block, analytic vs measured", fig))

    stacked = [(key, data[key]) for key in ("imagenet", "fashion") if list_of_records(data.get(key))]
    for key, rows in stacked:
        body += ["", f"**{key}** ({cell(settings.get(key, ''), 200)}):", ""]
        body += _training_memory_table(rows)
    if stacked:
        fig = new_figure(8, 3.2 * len(stacked))
        parts = [
            ("weights", "parameter_bytes"),
            ("gradients", "gradient_bytes"),
            ("optimizer", "optimizer_bytes"),
            ("activations", "activation_bytes"),
        ]
        for i, (key, rows) in enumerate(stacked):
            ax = fig.add_subplot(len(stacked), 1, i + 1)
            labels = [str(r["row"]) for r in rows]
            left = [0.0] * len(rows)
            for label, field_name in parts:
                widths = [(r.get(field_name) or 0) / 2**20 for r in rows]
                ax.barh(labels, widths, left=left, label=label)
                left = [a + b for a, b in zip(left, widths, strict=True)]
            ax.invert_yaxis()
            ax.tick_params(axis="y", labelsize=8)
            ax.set_xlabel("training memory, analytic (MiB)")
            ax.set_title(key, fontsize=10)
            ax.grid(axis="x", alpha=0.3)
            if i == 0:
                ax.legend(fontsize=8)
        fig.tight_layout()
        figures.append(
            ("training_total", "Total training memory by part (weights, grads, AdamW, activations)", fig)
        )

    findings = data.get("findings", {})
    parts_text = []
    for kind, label in (("v2", "V2"), ("v3", "V3")):
        if isinstance(findings.get(f"{kind}_t6_reduction"), (int, float)):
            parts_text.append(f"{pct(findings[f'{kind}_t6_reduction'])} ({label})")
    headline = ""
    if parts_text:
        headline = "MobileTL block activations " + " / ".join(parts_text) + " smaller at t=6"
    if isinstance(findings.get("tinytl_lb_saving_vs_ft_full"), (int, float)):
        headline += ("; " if headline else "") + (
            f"TinyTL-L+B {times(findings['tinytl_lb_saving_vs_ft_full'])} less training memory than FT-Full"
        )
    if not body:
        raise ValueError("no 'blocks', 'imagenet' or 'fashion' table")
    return Rendered(
        title="MobileTL and TinyTL: training memory",
        headline=headline or "see section",
        body=body,
        figures=figures,
    )
