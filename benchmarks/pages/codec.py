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

RESULTS = ("codec",)
# Its GPU counterpart, still to be measured where no *_cuda.json is committed (the headline says so).
GPU_COMMANDS = {"codec": "python -m benchmarks.bench_codec_cuda --batches 32 128 1024 --repeats 50 --compile"}


def _min_median(value: Any) -> tuple[Any, Any]:
    return (value.get("min"), value.get("median")) if isinstance(value, dict) else (value, None)


def render(result: Result, results_dir: Path) -> Rendered:
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
