"""The results page's section for ``int8_bottom.json`` (``benchmarks/bench_int8_bottom.py``):
the int8 frozen bottom against fp32."""

from __future__ import annotations

from pathlib import Path

from .common import (
    DASH,
    Rendered,
    Result,
    cell,
    list_of_records,
    new_figure,
    num,
    pct,
    rows_of,
    span,
    table,
    times,
)

RESULTS = ("int8_bottom",)


def render(result: Result, results_dir: Path) -> Rendered:
    data = result.data
    kernels = rows_of(data, "kernels")
    body = table(
        [
            "model",
            "trained blocks",
            "batch",
            "precision used",
            "fp32 s/batch",
            "int8 s/batch",
            "speedup",
            "relative L2 error",
        ],
        [
            [
                f"{r['arch']} @ {r.get('resolution', '?')}px",
                num(r.get("train_last_blocks")),
                num(r.get("batch")),
                cell(r.get("precision_used", DASH)),
                num(r["fp32_seconds"]),
                num(r["int8_seconds"]),
                times(r["speedup"]),
                pct(r.get("relative_l2_error")),
            ]
            for r in kernels
        ],
    )
    builds = data.get("cache_build")
    if list_of_records(builds):
        body += ["", "Cache build through the pipeline (decode included):", ""]
        body += table(
            ["bottom precision", "samples", "build s", "images/s", "forward s", "forward images/s"],
            [
                [
                    cell(b.get("precision", DASH)),
                    num(b.get("samples")),
                    num(b.get("cache_build_seconds")),
                    num(b.get("images_per_second")),
                    num(b.get("forward_seconds")),
                    num(b.get("forward_images_per_second")),
                ]
                for b in builds
            ],
        )
    fig = new_figure()
    ax = fig.add_subplot()
    labels = [f"{r['arch']}\n{r.get('resolution', '?')}px" for r in kernels]
    ax.bar(labels, [r["speedup"] for r in kernels], color="tab:purple")
    ax.axhline(3, color="black", ls="--", lw=1, label="bar: 3×")
    ax.set_ylabel("int8 speedup over fp32 (×)")
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Frozen bottom: int8 vs fp32 on this CPU", fontsize=10)
    headline = f"int8 bottom {span([r['speedup'] for r in kernels], times)} faster than fp32"
    ratio = data.get("cache_build_throughput_ratio")
    if isinstance(ratio, (int, float)):
        headline += f"; cache build {times(ratio)}"
    return Rendered(
        title="Mixed precision: int8 frozen bottom vs fp32",
        headline=headline,
        body=body,
        figures=[("speedup", "int8 speedup per model (dashed: the 3× bar)", fig)],
    )
