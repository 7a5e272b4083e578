"""The results page's section for ``prefetch_sdcard*.json`` (``benchmarks/bench_prefetch.py``):
epoch time from a slow (SD-card-like) store, with and without prefetching."""

from __future__ import annotations

from pathlib import Path

from .common import (
    Rendered,
    Result,
    cell,
    grouped_bars,
    nbytes,
    new_figure,
    num,
    rows_of,
    span,
    table,
    times,
)

# prefetch_sdcard_hdf5_amd_epyc: the HDF5 run on the AMD EPYC CPU (prefetch_sdcard_hdf5: Intel Xeon)
RESULTS = ("prefetch_sdcard", "prefetch_sdcard_hdf5", "prefetch_sdcard_hdf5_amd_epyc")


def render(result: Result, results_dir: Path) -> Rendered:
    rows = rows_of(result.data)
    body = table(
        [
            "setting",
            "compute s",
            "I/O s (bytes / bandwidth)",
            "max(compute, I/O) s",
            "sum s",
            "epoch with prefetch s",
            "epoch without s",
            "prefetch / max",
            "without / sum",
            "speedup",
            "reader peak",
            "reader budget",
        ],
        [
            [
                cell(r["setting"]),
                num(r["compute_s"]),
                num(r["io_s_bytes_over_bandwidth"]),
                num(r["bound_max_s"]),
                num(r["sum_s"]),
                num(r["epoch_s_prefetch"]),
                num(r["epoch_s_no_prefetch"]),
                times(r.get("prefetch_over_bound")),
                times(r.get("no_prefetch_over_sum")),
                times(r.get("speedup")),
                nbytes(r.get("peak_reader_bytes_prefetch")),
                nbytes(r.get("reader_budget_bytes")),
            ]
            for r in rows
        ],
    )
    fig = new_figure()
    ax = fig.add_subplot()
    grouped_bars(
        ax,
        [str(r["setting"]) for r in rows],
        [
            ("max(compute, I/O)", [r["bound_max_s"] for r in rows]),
            ("with prefetch", [r["epoch_s_prefetch"] for r in rows]),
            ("compute + I/O", [r["sum_s"] for r in rows]),
            ("without prefetch", [r["epoch_s_no_prefetch"] for r in rows]),
        ],
    )
    ax.set_ylabel("seconds per epoch")
    settings = result.data.get("settings", {})
    profile = settings.get("profile", "")
    fmt = settings.get("format", "zarr")
    where = f"the simulated '{profile}' storage profile" if profile else "simulated slow storage"
    ax.set_title(f"Epoch time reading the cache through {where}", fontsize=10)
    speedups = [r["epoch_s_no_prefetch"] / r["epoch_s_prefetch"] for r in rows]
    bounds = [r["epoch_s_prefetch"] / r["bound_max_s"] for r in rows]
    return Rendered(
        title=f"SD-card storage ({fmt}): prefetch vs no prefetch",
        headline=f"prefetch {span(speedups, times)} faster than without; epoch {span(bounds, times)} "
        "max(compute, I/O)",
        body=body,
        figures=[("epoch_seconds", "Epoch time with and without prefetch, against the bounds", fig)],
    )
