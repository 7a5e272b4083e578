"""Feature codec on a GPU: quantize + pack, and unpack + dequantize (+ crop/flip), per 96x14x14 map, batched.

The same functions the pipeline runs (``pipeline.codec.quantile``; the crop/flip of
``pipeline.codec.moves`` as stage B's fused decode applies it), on CUDA tensors, timed with CUDA events
over whole batches (per map = batch time / batch size; minimum and median over ``--repeats``). Beside
them, what crosses the bus: copying a batch's packed codes + float16 lo/scale to the GPU (pinned,
``non_blocking``) against copying its float32 maps, and ``torch.compile`` of the dequantize (torch ops
fused by Inductor into one kernel), to say which of the two stage B should use. Every GPU result is
checked bit for bit against the CPU's (the claim of ``tests/test_cuda_data.py``).

Writes ``benchmarks/results/codec_cuda.json`` naming the GPU; refuses (exit 2) without CUDA.
``--device cpu`` runs the same code on the CPU as a check, written to a temporary folder.

Usage: python -m benchmarks.bench_codec_cuda [--batches 32 128 1024] [--repeats 50] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._device import require_device
from benchmarks._meta import write_result
from pipeline.codec.moves import CropFlip
from pipeline.codec.quantile import QuantizedBatch, dequantize, quantize

SHAPE = (96, 14, 14)
BITS = (1, 2, 4, 8)


def feature_maps(batch: int, seed: int) -> torch.Tensor:
    """Post-ReLU6-like maps with a fifth of the channels dead (all zero), as bench_codec uses."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, *SHAPE, generator=g) * 2).clamp_(0, 6)
    x[torch.rand(batch, SHAPE[0], generator=g) < 0.2] = 0.0
    return x


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 5) -> list[float]:
    """Seconds of each of ``repeats`` calls (CUDA events on a GPU, so only the device's time counts)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def per_map_us(seconds: list[float], batch: int) -> dict[str, float]:
    return {"min": min(seconds) / batch * 1e6, "median": statistics.median(seconds) / batch * 1e6}


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


def measure(batch: int, bits: int, device: torch.device, repeats: int, compiled: Any) -> dict[str, Any]:
    x_cpu = feature_maps(batch, bits)
    x = x_cpu.to(device)
    q = quantize(x, bits)
    ref = quantize(x_cpu, bits)
    same_codes = all(torch.equal(getattr(q, k).cpu(), getattr(ref, k)) for k in ("codes", "lo", "scale"))
    u = np.random.default_rng(bits).random((batch, 3))
    crop = CropFlip.draw(batch, SHAPE[1], SHAPE[2], 1, 0.5, u)
    source = crop.source_on(device)

    def dequantize_moved() -> torch.Tensor:
        return crop.zero_padding(dequantize(q, source))

    want = crop.zero_padding(dequantize(ref, crop.source))
    same_maps = torch.equal(bits_of(dequantize_moved()), bits_of(want))
    row: dict[str, Any] = {
        "batch": batch,
        "bits": bits,
        "compress_us_per_map": per_map_us(timed(lambda: quantize(x, bits), device, repeats), batch),
        "decompress_us_per_map": per_map_us(timed(lambda: dequantize(q), device, repeats), batch),
        "decompress_crop_flip_us_per_map": per_map_us(timed(dequantize_moved, device, repeats), batch),
        "gpu_equals_cpu_bits": {"quantize": same_codes, "dequantize_crop_flip": same_maps},
        "stored_bytes_per_map": q.nbytes / batch,
        "float32_bytes_per_map": x.numel() * 4 / batch,
    }
    if device.type == "cuda":
        # What stage B moves over the bus per batch: the stored payload, against float32 maps.
        payload = [t.cpu().pin_memory() for t in (q.codes, q.lo, q.scale)]
        maps = x_cpu.pin_memory()
        row["copy_stored_us_per_map"] = per_map_us(
            timed(lambda: [t.to(device, non_blocking=True) for t in payload], device, repeats), batch)
        row["copy_float32_us_per_map"] = per_map_us(
            timed(lambda: maps.to(device, non_blocking=True), device, repeats), batch)
    if compiled is not None:
        try:
            fn = compiled(bits)
            got = fn(q.codes, q.lo, q.scale)
            row["decompress_compiled_us_per_map"] = per_map_us(
                timed(lambda: fn(q.codes, q.lo, q.scale), device, repeats), batch)
            same = torch.equal(bits_of(got), bits_of(dequantize(ref)))
            row["gpu_equals_cpu_bits"]["dequantize_compiled"] = same
        except Exception as exc:  # noqa: BLE001  no compiler toolchain: recorded, not fatal
            row["decompress_compiled_error"] = f"{type(exc).__name__}: {exc}"
    return row


def compile_dequantize() -> Callable[[int], Any]:
    """``torch.compile`` of :func:`dequantize` at a fixed bit width: one fused kernel, maybe."""
    cache: dict[int, Any] = {}

    def make(bits: int) -> Any:
        if bits not in cache:
            def plain(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
                return dequantize(QuantizedBatch(codes=codes, lo=lo, scale=scale, bits=bits, shape=SHAPE))

            cache[bits] = torch.compile(plain, dynamic=False)
        return cache[bits]

    return make


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", help="cuda / cuda:N (the measurement) or cpu (a check)")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 1024])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the dequantize")
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    device = require_device(args.device)
    compiled = compile_dequantize() if args.compile else None
    rows = []
    for batch in args.batches:
        for bits in BITS:
            row = measure(batch, bits, device, args.repeats, compiled)
            rows.append(row)
            print(f"batch {batch:5d}  {bits} bit: quantize+pack "
                  f"{row['compress_us_per_map']['min']:.2f} us/map, "
                  f"unpack+dequantize {row['decompress_us_per_map']['min']:.2f} us/map "
                  f"(+crop/flip {row['decompress_crop_flip_us_per_map']['min']:.2f}); "
                  f"same bits as the CPU: {row['gpu_equals_cpu_bits']}", flush=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    directory = args.results_dir
    if device.type != "cuda":
        directory = directory or Path(tempfile.mkdtemp(prefix="bench-codec-cuda-check-"))
    compress = max(r["compress_us_per_map"]["min"] for r in rows)
    decompress = max(r["decompress_crop_flip_us_per_map"]["min"] for r in rows)
    same = all(all(r["gpu_equals_cpu_bits"].values()) for r in rows)
    bits_note = "the CPU's bits" if same else "NOT the CPU's bits"
    path = write_result("codec_cuda", {
        "headline": f"{gpu or device}: quantize+pack ≤ {compress:.2f} µs, unpack+dequantize+crop/flip ≤ "
        f"{decompress:.2f} µs per 96x14x14 map (batches {', '.join(map(str, args.batches))}); "
        f"{bits_note}",
        "question": "codec on the GPU: quantize + pack, unpack + dequantize (+ crop/flip) per 96x14x14 map, "
        "batched; bus bytes of stored codes vs float32 maps; torch ops vs torch.compile",
        "device": str(device),
        "gpu": gpu,
        "cuda": torch.version.cuda,
        "settings": {**{k: v for k, v in vars(args).items() if k != "results_dir"}, "shape": list(SHAPE),
                     "maps": "clamp(randn * 2, 0, 6), 20% of channels all zero", "k": 1,
                     "timing": "CUDA events around each full-batch call; per map = batch time / batch size"},
        "rows": rows,
    }, directory)
    print(f"gpu: {gpu}\nwrote {path}")


if __name__ == "__main__":
    main()
