"""The results page's section for ``dask_build.json`` (``benchmarks/bench_dask_build.py``):
a cache build on Dask against the local build."""

from __future__ import annotations

from pathlib import Path

from matplotlib.ticker import FuncFormatter

from .common import (
    DASH,
    Rendered,
    Result,
    by_key,
    cell,
    keyed_records,
    list_of_records,
    nbytes,
    new_figure,
    num,
    signed_pct,
    table,
)

RESULTS = ("dask_build",)


def render(result: Result, results_dir: Path) -> Rendered:
    data = result.data
    runs = data["runs"]
    if not keyed_records(runs):
        raise ValueError("expected 'runs' to map run names to records")
    identical = data.get("identical_to_local_build", {})
    starts = data.get("dask_cluster_start_s", {})
    rows = []
    for name, run in runs.items():
        executor = run.get("extra", {}).get("executor", {}) if isinstance(run.get("extra"), dict) else {}
        # Runs are named <executor>_..._torch<N>; each Dask run is compared with the local run that used
        # the same torch thread count, as the benchmark does for its overhead figure.
        local = runs.get("local_" + name.rsplit("_", 1)[-1]) if name.startswith("dask") else None
        overhead = run["build_s"] / local["build_s"] - 1 if local else None
        rows.append(
            [
                cell(name),
                cell(executor.get("type", "local")),
                num(executor.get("workers", 1)),
                num(executor.get("threads")) if executor else DASH,
                num(run.get("images")),
                num(run["build_s"]),
                num(run.get("images_per_s")),
                signed_pct(overhead) if overhead is not None else DASH,
                num(starts.get(name)),
                num(identical.get(name)) if name in identical else DASH,
                nbytes(run.get("cache_bytes")),
            ]
        )
    body = table(
        [
            "run",
            "executor",
            "workers",
            "threads (all workers)",
            "images",
            "build s",
            "images/s",
            "vs local, same torch threads",
            "cluster start s",
            "same bytes as local",
            "cache size",
        ],
        rows,
    )
    costs = data.get("per_image_cost_1_thread_s")
    if isinstance(costs, dict) and costs:
        body += ["", "Measured per-image costs the extrapolation rests on (1 torch thread):", ""]
        body += table(["cost", "ms per image"], [[cell(k), num(1000 * v)] for k, v in costs.items()])
    extrapolation = data.get("extrapolation_1_8M")
    figures = []
    fig = new_figure()
    ax = fig.add_subplot()
    names = list(runs)
    ax.bar(names, [runs[n].get("images_per_s", 0) for n in names], color="tab:cyan")
    ax.set_ylabel("cache build images/s")
    ax.tick_params(axis="x", labelsize=8)
    for label in ax.get_xticklabels():
        label.set(rotation=20, ha="right")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("Cache build throughput: local vs Dask (workers x threads, torch threads)", fontsize=10)
    figures.append(("throughput", "Cache build throughput per run", fig))
    headline_parts = []
    overhead_1 = data.get("dask_overhead_1_worker")
    if isinstance(overhead_1, dict) and isinstance(overhead_1.get("torch1"), (int, float)):
        headline_parts.append(f"Dask overhead at 1 worker {signed_pct(overhead_1['torch1'])} (target ≤ 10%)")
    if isinstance(extrapolation, dict):
        if isinstance(extrapolation.get("model"), str):
            body += ["", f"Extrapolation model: {cell(extrapolation['model'], 1000)}", ""]
        ext_rows = extrapolation.get("rows")
        if list_of_records(ext_rows):
            body += table(
                [cell(str(c)) for c in ext_rows[0]],
                [[by_key(str(c), v) for c, v in r.items()] for r in ext_rows],
            )
            if all(isinstance(r.get("workers"), (int, float)) for r in ext_rows):
                hours_key = "estimate_h_at_100MBps" if "estimate_h_at_100MBps" in ext_rows[0] else "compute_h"
                fig = new_figure()
                ax = fig.add_subplot()
                ax.plot([r["workers"] for r in ext_rows], [r[hours_key] for r in ext_rows], "o-")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.set_xlabel("workers")
                ax.set_ylabel(f"hours ({hours_key})")
                ax.grid(alpha=0.3)
                images = extrapolation.get("images")
                subject = f"{num(images)} images" if isinstance(images, int) else "the full dataset"
                ax.set_title(f"Extrapolated cache build time of {subject}", fontsize=10)
                figures.append(
                    ("extrapolation", "Extrapolated build time vs workers (from measured costs)", fig)
                )
                last = ext_rows[-1]
                count = f"{images / 1e6:g} M images" if isinstance(images, int) else "the dataset"
                headline_parts.append(
                    f"{num(last[hours_key])} h for {count} on {num(last['workers'])} workers"
                )
    return Rendered(
        title="Dask executor: cache build local vs Dask, and an extrapolation to a large dataset",
        headline="; ".join(headline_parts) or "see section",
        body=body,
        figures=figures,
    )
