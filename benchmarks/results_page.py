"""One results page: ``benchmarks/README.md`` and its plots, built from every JSON in ``benchmarks/results/``.

Usage: python -m benchmarks.results_page [--results DIR] [--output FILE] [--plots DIR] [--strict]

Every result file is written by ``benchmarks._meta.write_result``, so each carries ``name``, ``created``,
``git_commit``, ``machine`` and ``command`` beside its own payload. Known result types (by ``name``) get
a renderer that picks their main numbers, a headline and plots; any other JSON (a new benchmark whose
structure this module has never seen) is rendered generically: its scalars, its ``targets``/``findings``
and every list of records as a table. A new benchmark can set a top-level ``"headline"`` string to fill
its line of the headline table without touching this module.

The page is deterministic: files are processed in sorted order, tables keep each result's own row
order, PNGs carry no timestamp or software stamp, and files are only rewritten when their bytes
change, so rerunning without new results leaves ``git status`` clean.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

# The page is built headless (CI, SSH sessions); pin the non-interactive backend before anything draws.
matplotlib.use("Agg")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_RESULTS = BENCH_DIR / "results"
DEFAULT_OUTPUT = BENCH_DIR / "README.md"
PLOTS_SUBDIR = "plots"

# Fields every result has (written by _meta.write_result) or that are rendered in their own block.
META_KEYS = ("name", "created", "git_commit", "machine", "command", "question", "headline")
CHECK_KEYS = ("targets", "bar", "findings")
DASH = "–"


# --------------------------------------------------------------------------------------------- formatting


def sig(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits in fixed notation (no 1.59e+03 in a table)."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(x)))
    if magnitude < -4:
        return f"{x:.{digits}g}"
    decimals = max(0, digits - 1 - magnitude)
    text = f"{x:.{decimals}f}"
    # Rounding can carry into a new digit (9.996 -> "10.00"); one decimal fewer keeps 3 significant digits.
    if decimals and len(text.replace("-", "").replace(".", "").lstrip("0")) > digits:
        text = f"{x:.{decimals - 1}f}"
    # A value that is exact at this precision (a threshold of 50, a k of 0.01) reads better without
    # padding zeros; measured values keep them, so a column of them lines up.
    if "." in text and float(text) == x:
        text = text.rstrip("0").rstrip(".")
    return text


def num(x: Any) -> str:
    """Any scalar for a table cell: ints exact (grouped), floats to 3 significant digits."""
    if x is None:
        return DASH
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}" if abs(x) >= 10_000 else str(x)
    if isinstance(x, float):
        return sig(x)
    return cell(x)


def nbytes(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return num(n)
    value, unit = float(n), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, next_unit
    if unit == "B":
        return f"{int(n)} B" if float(n).is_integer() else f"{sig(value)} B"
    return f"{sig(value)} {unit}"


def pct(fraction: Any) -> str:
    return f"{sig(100 * fraction)}%" if isinstance(fraction, (int, float)) else num(fraction)


def acc(mean: Any, std: Any = None) -> str:
    """Accuracy in percent with two decimals: rows of Table 4 differ by tenths of a point, so 3 significant
    digits (91.5) would hide the differences the table exists to show."""
    if not isinstance(mean, (int, float)):
        return num(mean)
    text = f"{100 * mean:.2f}"
    if isinstance(std, (int, float)):
        text += f" ± {100 * std:.2f}"
    return text


def times(x: Any) -> str:
    return f"{sig(x)}×" if isinstance(x, (int, float)) and not isinstance(x, bool) else num(x)


def cell(x: Any, limit: int = 80) -> str:
    """A value that is not a plain number, as compact single-line text safe inside a Markdown table."""
    if isinstance(x, (dict, list)):
        if not x:
            text = "(none)"
        elif isinstance(x, list) and all(
            isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in x
        ):
            text = ", ".join(num(v) if not isinstance(v, str) else v for v in x)
        else:
            text = json.dumps(x, sort_keys=True, default=str)
    else:
        text = str(x)
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def by_key(key: str, value: Any, limit: int = 80) -> str:
    """Format a value of an unknown result from its key name: sizes as bytes, accuracies as percent."""
    lowered = key.lower()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "bytes" in lowered and "per_element" not in lowered:
            return nbytes(value)
        if "accuracy" in lowered and 0 <= value <= 1:
            return pct(value)
    return num(value) if not isinstance(value, (str, dict, list)) else cell(value, limit)


def looks_numeric(text: str) -> bool:
    return text == DASH or (bool(text) and (text[0].isdigit() or (text[0] in "-+" and text[1:2].isdigit())))


def table(header: list[str], rows: Iterable[list[str]], align: list[str] | None = None) -> list[str]:
    """A Markdown table; ``align`` per column is 'l' or 'r'. By default a column is right-aligned when
    all its cells are numbers, so digits line up and text stays readable."""
    rows = list(rows)
    if align is None:
        align = [
            "r"
            if rows and all(looks_numeric(r[i]) for r in rows) and any(r[i] != DASH for r in rows)
            else "l"
            for i in range(len(header))
        ]
    lines = [
        "| " + " | ".join(h.replace("|", "\\|") for h in header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dicts as dotted keys; lists and scalars are leaves."""
    if isinstance(value, dict):
        items: list[tuple[str, Any]] = []
        for key, sub in value.items():
            items += flatten(sub, f"{prefix}.{key}" if prefix else str(key))
        return items
    return [(prefix, value)]


def anchor(text: str) -> str:
    """GitHub's heading anchor for a heading made only of ``text``."""
    return "".join(c for c in text.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def list_of_records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def keyed_records(value: Any) -> bool:
    """A dict of dicts ({"local": {...}, "dask_1x1": {...}}): one record per key, best read as a table."""
    return (
        isinstance(value, dict) and len(value) >= 2 and all(isinstance(v, dict) and v for v in value.values())
    )


# ---------------------------------------------------------------------------------------------- model


@dataclass
class Result:
    path: Path
    data: dict[str, Any]

    @property
    def key(self) -> str:
        # The file name, not the "name" field: file names are unique in a directory, names need not be.
        return self.path.stem

    @property
    def name(self) -> str:
        name = self.data.get("name")
        return name if isinstance(name, str) and name else self.key


@dataclass
class Check:
    name: str
    value: Any
    kind: str  # "target" (a bar the benchmark must meet) or "finding" (a claim from a paper, checked)


@dataclass
class Rendered:
    """What a renderer returns; provenance, checks and plot files are added by the page builder."""

    title: str
    headline: str
    body: list[str]
    question: str | None = None
    figures: list[tuple[str, str, Figure]] = field(default_factory=list)  # (file suffix, caption, figure)
    images: list[tuple[str, Path]] = field(default_factory=list)  # existing image files to show
    checks: list[Check] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)  # extra commands (beside the top-level one)


def checks_of(data: dict[str, Any]) -> list[Check]:
    """``targets`` and ``bar`` are the issue's bars; ``findings`` are paper claims the benchmark checks."""
    checks = []
    for key in CHECK_KEYS:
        block = data.get(key)
        if isinstance(block, dict):
            kind = "finding" if key == "findings" else "target"
            checks += [Check(name, value, kind) for name, value in flatten(block)]
        elif isinstance(block, bool):
            checks.append(Check(key, block, "target"))
    return checks


def status(checks: list[Check]) -> str:
    targets = [c.value for c in checks if c.kind == "target" and isinstance(c.value, bool)]
    findings = [c.value for c in checks if c.kind == "finding" and isinstance(c.value, bool)]
    if targets:
        met = sum(targets)
        return (
            f"met ({met}/{len(targets)})"
            if met == len(targets)
            else f"**not met** ({met}/{len(targets)} met)"
        )
    if findings:
        return f"findings hold: {sum(findings)}/{len(findings)}"
    return "no target"


def new_figure(width: float = 7.0, height: float = 3.6) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def rows_of(data: dict[str, Any], key: str = "rows") -> list[dict[str, Any]]:
    rows = data.get(key)
    if not list_of_records(rows):
        raise ValueError(f"expected a non-empty list of records in {key!r}")
    return rows


def grouped_bars(
    ax: Any, groups: list[str], series: list[tuple[str, list[float]]], log: bool = False
) -> None:
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks(range(len(groups)), groups)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(series), frameon=False)


# ------------------------------------------------------------------------------------- known renderers


def render_cache_reuse_epoch_time(result: Result) -> Rendered:
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
    return Rendered(
        title="Cache & Reuse: epoch time, single-stage vs two-stage vs compute limit"
        + (f" ({settings['malloc']})" if "glibc" in settings.get("malloc", "") else ""),
        headline=headline,
        body=body,
        figures=[("epoch_seconds", "Seconds per epoch (log scale)", fig)],
    )


def span(values: list[float], fmt: Callable[[Any], str]) -> str:
    low, high = min(values), max(values)
    return fmt(low) if fmt(low) == fmt(high) else f"{fmt(low).rstrip('×%')}–{fmt(high)}"


def render_cache_reuse_fashion_table4(result: Result) -> Rendered:
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


def _min_median(value: Any) -> tuple[Any, Any]:
    return (value.get("min"), value.get("median")) if isinstance(value, dict) else (value, None)


def render_codec(result: Result) -> Rendered:
    data = result.data
    rows = rows_of(data)
    body = table(
        [
            "bits",
            "compress µs/map (min / median)",
            "decompress µs/map (min / median)",
            "code bits/el",
            "lo+scale bits/el",
            "stored B/el (ideal)",
            "after zstd B/el",
            "RMSE",
            "targets met",
        ],
        [
            [
                num(r["bits"]),
                " / ".join(num(v) for v in _min_median(r["compress_us_per_map"])),
                " / ".join(num(v) for v in _min_median(r["decompress_us_per_map"])),
                num(r.get("code_bits_per_element")),
                num(r.get("lo_scale_bits_per_element")),
                f"{num(r.get('stored_bytes_per_element'))} ({num(r.get('ideal_bytes_per_element'))})",
                num(r.get("zstd3_bytes_per_element")),
                num(r.get("rmse")),
                num(bool(r.get("compress_target_met")) and bool(r.get("decompress_target_met"))),
            ]
            for r in rows
        ],
    )
    if list_of_records(data.get("k_sensitivity")):
        body += ["", "Clipping sensitivity (quantile clipping instead of min/max):", ""]
        body += table(
            ["k", "bits", "compress µs/map (min / median)"],
            [
                [
                    num(r.get("k")),
                    num(r.get("bits")),
                    " / ".join(num(v) for v in _min_median(r.get("compress_us_per_map"))),
                ]
                for r in data["k_sensitivity"]
            ],
        )
    bits = [r["bits"] for r in rows]
    fig = new_figure()
    ax = fig.add_subplot()
    ax.plot(bits, [r["stored_bytes_per_element"] for r in rows], "o-", label="stored (codes + lo/scale)")
    if all("ideal_bytes_per_element" in r for r in rows):
        ax.plot(bits, [r["ideal_bytes_per_element"] for r in rows], "k--", label="ideal bits/8")
    if all("zstd3_bytes_per_element" in r for r in rows):
        ax.plot(bits, [r["zstd3_bytes_per_element"] for r in rows], "s-", label="after zstd")
    for dtype, size in sorted(data.get("reference_bytes_per_element", {}).items()):
        ax.axhline(size, color="grey", lw=0.8, ls=":")
        ax.annotate(dtype, (bits[0], size), fontsize=8, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xticks(bits, [str(b) for b in bits])
    ax.set_xlabel("bits per value")
    ax.set_ylabel("bytes per feature value (log)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Cache size per feature value: bits vs bytes", fontsize=10)

    fig2 = new_figure()
    ax = fig2.add_subplot()
    compress = [_min_median(r["compress_us_per_map"])[0] for r in rows]
    decompress = [_min_median(r["decompress_us_per_map"])[0] for r in rows]
    grouped_bars(ax, [f"{b} bit" for b in bits], [("compress", compress), ("decompress", decompress)])
    targets = data.get("targets", {})
    for key, color in (("compress_us_per_map", "tab:blue"), ("decompress_us_per_map", "tab:orange")):
        if isinstance(targets.get(key), (int, float)):
            ax.axhline(targets[key], color=color, ls="--", lw=1)
    ax.set_ylabel("µs per map (min over repeats)")
    ax.set_title("Codec time per map (dashed: targets)", fontsize=10)
    headline = f"compress ≤ {sig(max(compress))} µs, decompress ≤ {sig(max(decompress))} µs per map"
    if isinstance(targets.get("compress_us_per_map"), (int, float)):
        bars = f"{num(targets['compress_us_per_map'])} / {num(targets.get('decompress_us_per_map'))}"
        headline += f" (targets {bars} µs)"
    return Rendered(
        title="Feature codec: quantile quantization + bit-packing",
        question="how long do compression and decompression of one feature map take, and how many bytes "
        "per feature value are stored, at 1, 2, 4 and 8 bits?",
        headline=headline,
        body=body,
        figures=[
            ("bytes_per_element", "Bytes per feature value vs bits", fig),
            ("time", "Compression / decompression time per map", fig2),
        ],
    )


def signed_pct(fraction: Any) -> str:
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool):
        return num(fraction)
    return ("+" if fraction >= 0 else "") + pct(fraction)


def render_dask_build(result: Result) -> Rendered:
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
                label = f"{num(images)} images" if isinstance(images, int) else "the full dataset"
                ax.set_title(f"Extrapolated cache build time of {label}", fontsize=10)
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


def render_int8_bottom(result: Result) -> Rendered:
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


def render_memory(result: Result) -> Rendered:
    data = result.data
    settings = data.get("settings", {})
    body: list[str] = []
    figures = []
    blocks = data.get("blocks")
    if list_of_records(blocks):
        body += [f"**Blocks** ({cell(settings.get('blocks', ''), 200)}):", ""]
        body += table(
            [
                "block",
                "expansion",
                "method",
                "activations analytic",
                "measured",
                "measured / analytic",
                "parameters",
                "step ms",
                "reduction vs vanilla",
            ],
            [
                [
                    cell(b["block"]),
                    num(b.get("expansion")),
                    cell(b["method"]),
                    nbytes(b["activation_bytes"]),
                    nbytes(b.get("measured_bytes")),
                    times(b.get("measured_over_analytic")),
                    num(b.get("parameters")),
                    num(b.get("step_ms")),
                    pct(b.get("reduction_vs_vanilla")),
                ]
                for b in blocks
            ],
        )
        fig = new_figure(10, 4.4)
        ax = fig.add_subplot()
        labels = [
            f"{b['block']} t={b['expansion']}\n{b['method'].removeprefix('mobiletl:')}"
            if b.get("expansion") is not None
            else f"{b['block']}\n{b['method']}"
            for b in blocks
        ]
        grouped_bars(
            ax,
            labels,
            [
                ("analytic", [b["activation_bytes"] / 2**20 for b in blocks]),
                ("measured", [(b.get("measured_bytes") or 0) / 2**20 for b in blocks]),
            ],
        )
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


def render_mixed_precision_cut(result: Result, results_dir: Path) -> Rendered:
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


def render_mobiletl_tinytl_accuracy(result: Result) -> Rendered:
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


def render_prefetch_sdcard(result: Result) -> Rendered:
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


def render_neuroflux(result: Result) -> Rendered:
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
    to_target = [
        bp["time_to_target_s"] / nf["time_to_target_s"]
        for nf, bp in both
        if nf.get("time_to_target_s") and bp.get("time_to_target_s")
    ]
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
    checks = [
        Check(
            "neuroflux_faster_than_bp_at_every_budget_both_run",
            bool(speedups) and min(speedups) > 1,
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
    if speedups:
        parts.append(f"training {span(speedups, times)} faster than backprop at the same budget")
    if to_target:
        parts.append(f"time to target {span(to_target, times)} shorter")
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


RENDERERS: dict[str, Callable[..., Rendered]] = {
    "cache_reuse_epoch_time": render_cache_reuse_epoch_time,
    "cache_reuse_epoch_time_malloc_defaults": render_cache_reuse_epoch_time,
    "cache_reuse_fashion_table4": render_cache_reuse_fashion_table4,
    "codec": render_codec,
    "dask_build": render_dask_build,
    "int8_bottom": render_int8_bottom,
    "memory": render_memory,
    "mixed_precision_cut": render_mixed_precision_cut,
    "mobiletl_tinytl_accuracy": render_mobiletl_tinytl_accuracy,
    "neuroflux": render_neuroflux,
    "prefetch_sdcard": render_prefetch_sdcard,
    "prefetch_sdcard_hdf5": render_prefetch_sdcard,
}
NEEDS_RESULTS_DIR = {"mixed_precision_cut"}


# ------------------------------------------------------------------------------------- generic renderer


def render_generic(result: Result) -> Rendered:
    """Any result, whatever its structure: top-level scalars (and nested dicts of scalars) as one table,
    every list of records as its own table. Settings, checks and provenance are added by the caller."""
    data = result.data
    skip = set(META_KEYS) | set(CHECK_KEYS) | {"settings"}
    scalars = []
    record_lists = []
    for key, value in data.items():
        if key in skip:
            continue
        if list_of_records(value):
            record_lists.append((key, value))
        elif keyed_records(value):
            # Leaves flattened per record, so nested fields ("extra.executor.workers") become columns.
            record_lists.append((key, [{"": name, **dict(flatten(sub))} for name, sub in value.items()]))
        elif isinstance(value, dict):
            for sub, leaf in flatten(value, key):
                if list_of_records(leaf):
                    record_lists.append((sub, leaf))
                else:
                    scalars.append((sub, leaf))
        else:
            scalars.append((key, value))
    body: list[str] = []
    if scalars:
        body += table(["field", "value"], [[cell(k), by_key(k, v, 300)] for k, v in scalars])
    # "rows" is the conventional main table of a result: show it first, the others in file order.
    record_lists.sort(key=lambda item: item[0] != "rows")
    for key, records in record_lists:
        columns: list[str] = []
        for record in records:
            columns += [c for c in record if c not in columns]
        body += ["", f"`{key}` ({len(records)} rows):", ""]
        body += table(
            [str(c) for c in columns],
            [[by_key(str(c), r[c]) if c in r else DASH for c in columns] for r in records],
        )
    headline = data.get("headline")
    return Rendered(
        title=result.name,
        headline=headline if isinstance(headline, str) and headline else "see section",
        body=body or ["(no numbers in this result)"],
    )


# ------------------------------------------------------------------------------------------ the page


@dataclass
class Section:
    result: Result
    rendered: Rendered
    checks: list[Check]
    plots: list[tuple[str, Path]]  # (caption, png path)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def load_results(results_dir: Path) -> tuple[list[Result], list[tuple[Path, str]]]:
    """Every ``*.json`` in ``results_dir``, sorted by file name; malformed files come back as problems."""
    results, problems = [], []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            problems.append((path, f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"))
            continue
        except (OSError, UnicodeDecodeError) as exc:
            problems.append((path, f"cannot be read ({exc})"))
            continue
        if not isinstance(data, dict):
            problems.append((path, f"top level is a JSON {type(data).__name__}, expected an object"))
            continue
        results.append(Result(path, data))
    return results, problems


def render_result(result: Result, results_dir: Path) -> Rendered:
    renderer = RENDERERS.get(result.name)
    if renderer is not None:
        try:
            if result.name in NEEDS_RESULTS_DIR:
                return renderer(result, results_dir)
            return renderer(result)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as exc:
            # A result of a known type whose layout changed must still be published, not crash the page.
            warn(
                f"{result.path}: the {result.name!r} renderer could not read it "
                f"({type(exc).__name__}: {exc}); using the generic renderer"
            )
    return render_generic(result)


def save_png(fig: Figure, path: Path) -> None:
    buf = io.BytesIO()
    fig.tight_layout()
    # No "Software" stamp: a matplotlib upgrade alone should not change every committed plot.
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    write_if_changed(path, buf.getvalue())


def write_if_changed(path: Path, content: bytes) -> bool:
    """Atomic write, skipped when the bytes are identical, so reruns leave files (and mtimes) alone."""
    if path.is_file() and path.read_bytes() == content:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)
    return True


def machine_line(machine: Any) -> str:
    if not isinstance(machine, dict):
        return "not recorded"
    parts = [cell(machine.get("cpu", "unknown CPU"))]
    if isinstance(machine.get("cpu_count"), int):
        parts.append(f"{machine['cpu_count']} cores")
    if isinstance(machine.get("memory_bytes"), (int, float)):
        parts.append(f"{nbytes(machine['memory_bytes'])} memory")
    for key, label in (
        ("machine", ""),
        ("platform", ""),
        ("python", "Python "),
        ("torch_threads", "torch threads "),
    ):
        if machine.get(key) is not None:
            parts.append(f"{label}{cell(machine[key])}")
    return ", ".join(parts)


def versions_line(machine: Any) -> str:
    versions = machine.get("versions") if isinstance(machine, dict) else None
    if not isinstance(versions, dict) or not versions:
        return "not recorded"
    installed = [f"{name} {cell(v)}" for name, v in versions.items() if v is not None]
    return ", ".join(installed) or "not recorded"


def commands_of(section: Section) -> list[str]:
    command = section.result.data.get("command")
    commands = [command] if isinstance(command, str) and command else []
    return commands + [c for c in section.rendered.commands if c not in commands]


def rel(path: Path, base: Path) -> str:
    return Path(os.path.relpath(path, base)).as_posix()


def build_sections(results: list[Result], results_dir: Path, plots_dir: Path) -> list[Section]:
    sections = []
    for result in results:
        rendered = render_result(result, results_dir)
        plots = []
        for suffix, caption, fig in rendered.figures:
            path = plots_dir / f"{result.key}_{suffix}.png"
            save_png(fig, path)
            plots.append((caption, path))
        plots += rendered.images
        sections.append(Section(result, rendered, checks_of(result.data) + rendered.checks, plots))
    return sections


def section_markdown(section: Section, base: Path) -> list[str]:
    result, rendered = section.result, section.rendered
    data = result.data
    lines = [f"## {result.key}", "", f"**{cell(rendered.title, 200)}**", ""]
    question = data.get("question") if isinstance(data.get("question"), str) else rendered.question
    lines += [f"*Question:* {cell(question, 400) if question else 'not recorded'}", ""]
    lines += rendered.body + [""]
    for caption, path in section.plots:
        lines += [f"![{caption}]({rel(path, base)})", ""]
    targets = [c for c in section.checks if c.kind == "target"]
    findings = [c for c in section.checks if c.kind == "finding"]
    met = [c for c in targets if isinstance(c.value, bool)]
    if met:
        lines += [f"**Targets:** {status(targets)}", ""]
        lines += table(
            ["target", "result"],
            [[cell(c.name, 200), "met" if c.value else "**not met**"] for c in met],
            ["l", "l"],
        )
        lines.append("")
    thresholds = [c for c in targets if not isinstance(c.value, bool)]
    if thresholds:
        # Numbers inside "targets" are the bars themselves (or a paper's reference), not outcomes.
        lines += [
            "Thresholds and references: "
            + "; ".join(f"{cell(c.name)} = {by_key(c.name, c.value)}" for c in thresholds),
            "",
        ]
    if findings:
        lines += ["**Findings:**", ""]
        lines += table(
            ["finding", "result"],
            [
                [
                    cell(c.name, 200),
                    ("holds" if c.value else "**does not hold**")
                    if isinstance(c.value, bool)
                    else by_key(c.name, c.value),
                ]
                for c in findings
            ],
            ["l", "l"],
        )
        lines.append("")
    settings = data.get("settings")
    if isinstance(settings, dict) and settings:
        lines += ["<details><summary>Settings</summary>", ""]
        lines += table(
            ["setting", "value"], [[cell(k), by_key(k, v, 300)] for k, v in flatten(settings)], ["l", "l"]
        )
        lines += ["", "</details>", ""]
    commands = commands_of(section)
    lines += [
        f"- Machine: {machine_line(data.get('machine'))}",
        f"- Versions: {versions_line(data.get('machine'))}",
        f"- Date: {cell(data.get('created', 'not recorded'))}",
        f"- Git commit: {cell(data.get('git_commit') or 'not recorded')}",
    ]
    if commands:
        lines += ["- Command: " + "; ".join(f"`{c}`" for c in commands)]
    else:
        lines += ["- Command: not recorded"]
    lines += [f"- Source: [{result.path.name}]({rel(result.path, base)})", ""]
    return lines


def page(sections: list[Section], problems: list[tuple[Path, str]], results_dir: Path, output: Path) -> str:
    base = output.parent
    count = len(sections)
    lines = [
        "# Benchmark results",
        "",
        f"Generated from {count} result{'s' if count != 1 else ''} in "
        f"[`{rel(results_dir, base)}/`]({rel(results_dir, base)}/) by `python -m benchmarks.results_page`; "
        "do not edit by hand. Every number below is read from a JSON file that records the machine, library "
        "versions, date, git commit and the command that produced it.",
        "",
        "## Headline",
        "",
    ]
    lines += table(
        ["result", "key number", "targets", "date"],
        [
            [
                f"[{s.result.key}](#{anchor(s.result.key)})",
                cell(s.rendered.headline, 300),
                status(s.checks),
                cell(str(s.result.data.get("created", DASH))[:10]),
            ]
            for s in sections
        ],
        ["l", "l", "l", "l"],
    )
    lines += [
        "",
        "## Regenerate",
        "",
        "This page and its plots (in `" + rel(results_dir / PLOTS_SUBDIR, base) + "/`):",
        "",
        "```bash",
        "python -m benchmarks.results_page",
        "```",
        "",
        "Rerun a benchmark (each writes its JSON into the results directory), then regenerate:",
        "",
        "```bash",
    ]
    for s in sections:
        commands = commands_of(s)
        lines += [f"# {s.result.key}"] + (commands or ["# (command not recorded)"])
    lines += ["```", ""]
    if problems:
        lines += ["## Skipped files", ""]
        lines += [f"- `{path.name}`: {cell(reason, 300)}" for path, reason in problems]
        lines.append("")
    for section in sections:
        lines += section_markdown(section, base)
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def remove_stale_plots(plots_dir: Path, keep: set[Path]) -> None:
    """The plots directory belongs to this page: a plot whose result (or renderer) is gone is removed,
    so the committed directory always matches the page."""
    if not plots_dir.is_dir():
        return
    for png in sorted(plots_dir.glob("*.png")):
        if png.resolve() not in keep:
            png.unlink()


def generate(results_dir: Path, output: Path, plots_dir: Path) -> tuple[int, list[tuple[Path, str]]]:
    """Build the page; returns (number of results rendered, malformed files skipped)."""
    if not results_dir.is_dir():
        raise FileNotFoundError(f"results directory {results_dir} does not exist")
    results, problems = load_results(results_dir)
    for path, reason in problems:
        warn(f"skipping {path}: {reason}")
    sections = build_sections(results, results_dir, plots_dir)
    remove_stale_plots(plots_dir, {p.resolve() for s in sections for _, p in s.plots})
    write_if_changed(output, page(sections, problems, results_dir, output).encode("utf-8"))
    return len(sections), problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.results_page",
        description="Build benchmarks/README.md and its plots from every JSON in benchmarks/results/.",
    )
    parser.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS, help="directory of result JSON files"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="Markdown page to write")
    parser.add_argument(
        "--plots", type=Path, default=None, help=f"directory for PNG plots (default: RESULTS/{PLOTS_SUBDIR})"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 if any result file is malformed")
    args = parser.parse_args(argv)
    plots_dir = args.plots if args.plots is not None else args.results / PLOTS_SUBDIR
    try:
        count, problems = generate(args.results, args.output, plots_dir)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plural = "" if count == 1 else "s"
    print(f"wrote {args.output} from {count} result{plural} ({len(problems)} skipped), plots in {plots_dir}")
    return 1 if args.strict and problems else 0


if __name__ == "__main__":
    sys.exit(main())
