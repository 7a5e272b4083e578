"""The results page's section for ``cache_reuse_epoch_time*.json`` (``benchmarks/bench_cache_reuse.py``):
epoch time single-stage vs two-stage vs the compute limit, and the cache build against a bare forward."""

from __future__ import annotations

from pathlib import Path

from .common import (
    DASH,
    Rendered,
    Result,
    grouped_bars,
    nbytes,
    new_figure,
    num,
    rows_of,
    span,
    table,
    times,
)

# *_intel_xeon: the same run on the Intel Xeon, the other CPU this machine kind comes with
RESULTS = ("cache_reuse_epoch_time", "cache_reuse_epoch_time_malloc_defaults",
           "cache_reuse_epoch_time_top_switches", "cache_reuse_epoch_time_top_switches_intel_xeon")
# Its GPU counterpart, still to be measured where no *_cuda.json is committed (the headline says so).
GPU_COMMANDS = {
    "cache_reuse_epoch_time": "python -m benchmarks.bench_cache_reuse --device cuda"
    " --samples 512 --epochs 3 --batches 32 128 --cuts 1 4 7 --compile"
}


def render(result: Result, results_dir: Path) -> Rendered:
    data = result.data
    rows = rows_of(data)
    body = table(
        [
            "trained blocks",
            "cached feature",
            "single-stage s/epoch",
            "two-stage s/epoch",
            "compute limit s/epoch",
            "two-stage / limit",
            "paired median",
            "fastest repeats",
            "from storage: paired median",
            "speedup",
            "cache build img/s",
            "bare forward img/s",
            "build / bare",
            "paired median",
            "fastest repeats",
            "cache size",
        ],
        [
            [
                num(r["train_last_blocks"]),
                "×".join(map(str, r.get("feature_shape", []))) or DASH,
                num(r["single_stage_epoch_s"]),
                num(r["two_stage_epoch_s"]),
                num(r["compute_limit_epoch_s"]),
                times(r["two_stage_over_compute_limit"]),
                times(r.get("two_stage_over_compute_limit_median")),
                times(r.get("two_stage_over_compute_limit_best")),
                times(r.get("two_stage_from_storage_over_compute_limit_median")),
                times(r["speedup_two_vs_single"]),
                num(r.get("cache_build_images_per_s")),
                num(r.get("bare_forward_images_per_s")),
                times(r.get("build_over_bare_forward")),
                times(r.get("build_over_bare_forward_median")),
                times(r.get("build_over_bare_forward_best")),
                nbytes(r.get("cache_bytes")),
            ]
            for r in rows
        ],
    )
    fig = new_figure()
    ax = fig.add_subplot()
    grouped_bars(
        ax,
        [f"last {r['train_last_blocks']} blocks" for r in rows],
        [
            ("single-stage", [r["single_stage_epoch_s"] for r in rows]),
            ("two-stage (from cache)", [r["two_stage_epoch_s"] for r in rows]),
            ("compute limit", [r["compute_limit_epoch_s"] for r in rows]),
        ],
        log=True,
    )
    ax.set_ylabel("seconds per epoch (log)")
    settings = data.get("settings", {})
    ax.set_title(
        f"Epoch time, {settings.get('arch', '')} {settings.get('resolution', '')}px".strip(), fontsize=10
    )
    speedups = [r["speedup_two_vs_single"] for r in rows]
    ratios = [r.get("two_stage_over_compute_limit_median", r["two_stage_over_compute_limit"]) for r in rows]
    headline = (
        f"two-stage {span(speedups, times)} faster per epoch than single-stage; "
        f"{span(ratios, times)} the compute limit"
    )
    fast = [r for r in rows if r.get("top_settings")]
    if fast:  # --top-set: the two-stage epoch with the top's speed switches, against the eager loop
        body += ["", "With the top's speed switches (a fourth pass of each paired repeat, same cache):", ""]
        body += table(
            ["trained blocks", "train settings", "two-stage / eager loop: paired median", "pairs"],
            [[num(r["train_last_blocks"]),
              ", ".join(f"{k}: {v}" for k, v in r["top_settings"].items()),
              times(r["fast_two_stage_over_compute_limit_median"]),
              span(r["fast_two_stage_over_compute_limit_paired"], times)] for r in fast],
        )
        fast_ratios = [r["fast_two_stage_over_compute_limit_median"] for r in fast]
        headline += f"; with the top's speed switches {span(fast_ratios, times)} the eager loop"
    return Rendered(
        title="Cache & Reuse: epoch time, single-stage vs two-stage vs compute limit"
        + (f" ({settings['malloc']})" if "glibc" in settings.get("malloc", "") else "")
        + (" (with the top's speed switches)" if fast else ""),
        headline=headline,
        body=body,
        figures=[("epoch_seconds", "Seconds per epoch (log scale)", fig)],
    )
