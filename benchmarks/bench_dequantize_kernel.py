"""Does the compiled dequantize kernel pay for itself beside the torch ops it replaces?

Where training runs it: dequantize plus the feature_aug stage's crop and flip of one training batch
(``AugmentWhileDequantizing``), for the map shapes the Cache & Reuse benchmark caches at its cuts, at 2
bits. The compiled kernel (``pipeline.codec.native.dequantize_moved``, one pass) against the fused torch
ops that give the same bits (move the codes, convert, scale, shift, zero the padding), checked equal.

The two paths alternate within each round (their order swapped every round), so a slower spell of a
shared machine hits both alike; the statistic is the median of the per-round ratios (torch ops time /
kernel time), beside the time saved per map. Each path's time for an epoch of the Cache & Reuse
benchmark's training samples is also set against the compute limit's epoch at the same cut, timed in
the same run: the share each path adds to the two-stage/limit ratio that benchmark's bar (1.10) is on.

Usage: python -m benchmarks.bench_dequantize_kernel [--rounds 15] [--calls 20] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._meta import write_result
from benchmarks.bench_cache_reuse import compute_limit, steady
from pipeline.codec import native
from pipeline.codec.quantile import dequantize, quantize
from pipeline.stages.feature_aug import CropFlip, sample_uniforms

# Trained blocks of MobileNetV2 -> the (C, H, W) maps its frozen bottom stores: the Cache & Reuse cuts.
CUT_SHAPES = {1: (320, 7, 7), 4: (160, 7, 7), 7: (96, 14, 14)}
BATCH = 32  # the Cache & Reuse benchmark's training batch
BITS = 2


def paths(shape: tuple[int, int, int], seed: int) -> dict[str, Callable[[int], torch.Tensor]]:
    """The kernel and the torch ops, each making one batch's augmented maps for a given epoch's crops."""
    _, h, w = shape
    g = torch.Generator().manual_seed(seed)
    q = quantize((torch.randn(BATCH, *shape, generator=g) * 2).clamp_(0, 6), BITS, 1)
    ids = torch.arange(BATCH)
    threads = torch.get_num_threads()

    def draw(epoch: int) -> CropFlip:  # a new crop per batch, as every epoch draws one
        return CropFlip.draw(BATCH, h, w, 1, 0.5, sample_uniforms(ids, seed, epoch, 3))

    def with_kernel(epoch: int) -> torch.Tensor:
        x = native.dequantize_moved(q.codes, q.lo, q.scale, BITS, shape, draw(epoch).move, threads=threads)
        if x is None:
            raise SystemExit("bench_dequantize_kernel: the kernel cannot be built here (no C compiler?)")
        return x

    def with_torch_ops(epoch: int) -> torch.Tensor:
        crop = draw(epoch)
        return crop.zero_padding(dequantize(q, crop.source))

    return {"kernel": with_kernel, "torch_ops": with_torch_ops}


def measure(shape: tuple[int, int, int], rounds: int, calls: int, seed: int) -> dict[str, Any]:
    fns = paths(shape, seed)
    bits_of = {name: [fn(e).view(torch.int32) for e in range(4)] for name, fn in fns.items()}
    same = all(torch.equal(a, b) for a, b in zip(bits_of["kernel"], bits_of["torch_ops"], strict=True))
    for fn in fns.values():  # warm up both
        for e in range(3):
            fn(e)
    ms: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in sorted(fns, reverse=bool(r % 2)):
            t0 = time.perf_counter()
            for e in range(calls):
                fns[name](r * calls + e)
            ms[name].append((time.perf_counter() - t0) / calls * 1e3)
    ratios = [t / k for t, k in zip(ms["torch_ops"], ms["kernel"], strict=True)]
    saved = [(t - k) * 1e3 / BATCH for t, k in zip(ms["torch_ops"], ms["kernel"], strict=True)]
    return {
        "shape": list(shape),
        "kernel_ms_per_batch": statistics.median(ms["kernel"]),
        "torch_ops_ms_per_batch": statistics.median(ms["torch_ops"]),
        "torch_ops_over_kernel_median": statistics.median(ratios),
        "torch_ops_over_kernel_min": min(ratios),
        "torch_ops_over_kernel_max": max(ratios),
        "saved_us_per_map_median": statistics.median(saved),
        "same_bits": same,
    }


def limit_share(row: dict[str, Any], trained: int, samples: int) -> dict[str, Any]:
    """Each path's time per epoch of ``samples`` maps against the compute limit's epoch at this cut.

    The compute limit (the trained top's forward, backward and step on features already in memory,
    as the Cache & Reuse benchmark times it) is what a two-stage epoch is measured against: the data
    path's share of it is what the path adds to the two-stage/limit ratio. Timed in this run, under
    the same load as the paths, faster of two passes.
    """
    limit = min(steady(compute_limit(trained, samples, BATCH, 3)[0]) for _ in range(2))
    batches = samples / BATCH
    return {
        "epoch_samples": samples,
        "compute_limit_epoch_s": limit,
        "kernel_share_of_limit_epoch": row["kernel_ms_per_batch"] * batches / 1e3 / limit,
        "torch_ops_share_of_limit_epoch": row["torch_ops_ms_per_batch"] * batches / 1e3 / limit,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="alternating rounds per shape")
    ap.add_argument("--calls", type=int, default=20, help="batches per path per round")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (and the kernel's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epoch-samples", type=int, default=268,
                    help="training samples per epoch (the Cache & Reuse benchmark's train split)")
    ap.add_argument("--results-dir", type=Path, default=None,
                    help="write the JSON here instead of benchmarks/results (a trial run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native.kernel() is None:
        raise SystemExit("bench_dequantize_kernel: the kernel cannot be built here (no C compiler?)")
    rows = []
    for trained, shape in CUT_SHAPES.items():
        row = {"train_last_blocks": trained, **measure(shape, args.rounds, args.calls, args.seed)}
        row.update(limit_share(row, trained, args.epoch_samples))
        rows.append(row)
        shares = (row["kernel_share_of_limit_epoch"], row["torch_ops_share_of_limit_epoch"])
        print(f"{trained} trained blocks, {BATCH} maps of {tuple(shape)} at {BITS} bits: kernel "
              f"{row['kernel_ms_per_batch']:.2f} ms, torch ops {row['torch_ops_ms_per_batch']:.2f} ms "
              "per batch; "
              f"torch ops / kernel {row['torch_ops_over_kernel_median']:.2f} (rounds "
              f"{row['torch_ops_over_kernel_min']:.2f}-{row['torch_ops_over_kernel_max']:.2f}); saves "
              f"{row['saved_us_per_map_median']:.1f} us/map"
              + f"; per epoch {100 * shares[0]:.1f}% vs {100 * shares[1]:.1f}% of the compute limit's"
              + f"; same bits: {row['same_bits']}")
    ratios = [r["torch_ops_over_kernel_median"] for r in rows]
    one = rows[0]
    headline = (f"fused torch ops take {min(ratios):.2f}–{max(ratios):.2f}× the kernel's time; at "
                f"{one['train_last_blocks']} trained block(s) an epoch's maps take "
                f"{100 * one['kernel_share_of_limit_epoch']:.1f}% of the compute limit's epoch with the "
                "kernel, "
                f"{100 * one['torch_ops_share_of_limit_epoch']:.1f}% with torch ops")
    path = write_result("dequantize_kernel", {
        "question": "dequantize + crop/flip of a training batch: compiled kernel vs the fused torch ops",
        "headline": headline,
        "settings": {"batch": BATCH, "bits": BITS, "threads": args.threads, "rounds": args.rounds,
                     "calls_per_round": args.calls, "seed": args.seed, "epoch_samples": args.epoch_samples,
                     "crop_padding": 1, "hflip": 0.5, "kernel_threads": native.threading_kind(),
                     "statistic": "median over rounds; the two paths alternate within each round, order "
                                  "swapped every round; ratio = torch ops / kernel per round"},
        "rows": rows,
    }, args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
