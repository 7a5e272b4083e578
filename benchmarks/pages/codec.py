"""The results page's section for ``codec.json`` (``benchmarks/bench_codec.py``):
the feature codec's time per map and bytes per value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.ticker import FuncFormatter

from .common import (
    Rendered,
    Result,
    grouped_bars,
    list_of_records,
    new_figure,
    num,
    rows_of,
    sig,
    table,
)

# codec_amd_epyc: the same run on the other CPU this machine kind comes with (AMD EPYC; codec: Intel Xeon)
RESULTS = ("codec", "codec_amd_epyc")
# Its GPU counterpart, still to be measured where no *_cuda.json is committed (the headline says so).
GPU_COMMANDS = {"codec": "python -m benchmarks.bench_codec_cuda --batches 32 128 1024 --repeats 50 --compile"}


def _min_median(value: Any) -> tuple[Any, Any]:
    return (value.get("min"), value.get("median")) if isinstance(value, dict) else (value, None)


def _pair(value: Any) -> str:
    return " / ".join(num(v) for v in _min_median(value)) if value is not None else num(None)


def _both(row: dict[str, Any], key: str) -> tuple[Any, Any]:
    """(kernel, torch ops) timings of one direction: issue 31's fields, or the older single columns."""
    timed = row.get(key)
    if isinstance(timed, dict) and "torch" in timed:
        return timed.get("native"), timed.get("torch")
    if key == "quantize_us_per_map":
        return None, row.get("compress_us_per_map")
    if key == "dequantize_us_per_map":
        return row.get("decompress_kernel_us_per_map"), row.get("decompress_us_per_map")
    return None, None


def render(result: Result, results_dir: Path) -> Rendered:
    data = result.data
    rows = rows_of(data)
    directions = ("quantize_us_per_map", "dequantize_us_per_map", "dequantize_crop_flip_us_per_map")
    body = table(
        [
            "bits",
            "quantize µs/map, kernel (min / median)",
            "quantize, torch ops",
            "dequantize, kernel",
            "dequantize, torch ops",
            "dequantize + crop/flip, kernel",
            "dequantize + crop/flip, torch ops",
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
                *(_pair(t) for key in directions for t in _both(r, key)),
                num(r.get("code_bits_per_element")),
                num(r.get("lo_scale_bits_per_element")),
                f"{num(r.get('stored_bytes_per_element'))} ({num(r.get('ideal_bytes_per_element'))})",
                num(r.get("zstd3_bytes_per_element")),
                num(r.get("rmse")),
                num(bool(r.get("compress_target_met")) and bool(r.get("decompress_target_met"))
                    and all((r.get("faster_targets_met") or {}).values())),
            ]
            for r in rows
        ],
    )
    if list_of_records(data.get("k_sensitivity")):
        body += ["", "Clipping sensitivity (quantile clipping instead of min/max, ranges from torch.topk):",
                 ""]
        body += table(
            ["k", "bits", "quantize µs/map, kernel (min / median)", "quantize, torch ops"],
            [
                [num(r.get("k")), num(r.get("bits")),
                 *(_pair(t) for t in _both(r, "quantize_us_per_map"))]
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
    labels = {"quantize_us_per_map": "quantize", "dequantize_us_per_map": "dequantize",
              "dequantize_crop_flip_us_per_map": "dequantize + crop/flip"}
    series = []
    for key in directions:
        for which, name in ((0, "kernel"), (1, "torch ops")):
            values = [_min_median(_both(r, key)[which])[0] for r in rows]
            if all(isinstance(v, (int, float)) for v in values):
                series.append((f"{labels[key]}, {name}", values))
    grouped_bars(ax, [f"{b} bit" for b in bits], series)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    targets = data.get("targets", {})
    # the colours of the kernel's bars in each direction
    for key, color in (("quantize_us_per_map", "tab:blue"),
                       ("dequantize_crop_flip_us_per_map", "tab:purple")):
        if isinstance(targets.get(key), (int, float)):
            ax.axhline(targets[key], color=color, ls="--", lw=1)
    ax.set_ylabel("µs per map (min over rounds)")
    ax.set_title("Codec time per map (dashed: issue 31 targets for the kernels)", fontsize=10)

    def worst(key: str, which: int) -> str:
        values = [_min_median(_both(r, key)[which])[0] for r in rows]
        return sig(max(values)) if all(isinstance(v, (int, float)) for v in values) else num(None)

    headline = (f"quantize ≤ {worst('quantize_us_per_map', 0)} µs, dequantize + crop/flip ≤ "
                f"{worst('dequantize_crop_flip_us_per_map', 0)} µs per map with the kernels")
    if isinstance(targets.get("quantize_us_per_map"), (int, float)):
        headline += (f" (targets {num(targets['quantize_us_per_map'])} / "
                     f"{num(targets.get('dequantize_crop_flip_us_per_map'))} µs)")
    headline += (f"; torch ops {worst('quantize_us_per_map', 1)} / "
                 f"{worst('dequantize_crop_flip_us_per_map', 1)} µs; the same bytes")
    return Rendered(
        title="Feature codec: quantile quantization + bit-packing",
        question="how long do compression and decompression (with the training crop/flip) of one feature "
        "map take, with the compiled kernels and with torch ops, and how many bytes per feature value are "
        "stored, at 1, 2, 4 and 8 bits?",
        headline=headline,
        body=body,
        figures=[
            ("bytes_per_element", "Bytes per feature value vs bits", fig),
            ("time", "Compression / decompression time per map", fig2),
        ],
    )
