"""Epoch time: single-stage baseline vs training from the cache vs the compute limit (issue: the main job).

MobileNetV2 at 224x224, training the last 1, 4 and 7 blocks (Cache & Reuse, Table 2
settings), all in one process and one run through the real pipeline (recipes built
in code, a real zarr store in a temporary directory):

- single-stage: decode -> input augmentation -> frozen bottom (no grad) -> top fwd+bwd, every epoch;
- two-stage: read cache -> dequantize -> feature augmentation -> top fwd+bwd;
- compute limit: top fwd+bwd (same optimizer, batch size, sample count) on tensors already in memory;
- cache build throughput vs the bare frozen forward on tensors already in memory.

Weights are random (timing does not depend on them); images are synthetic 224x224.
Usage: python benchmarks/bench_cache_reuse.py [--samples 512] [--epochs 3] [--bits 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._meta import write_result
from pipeline.context import RunContext
from pipeline.models.zoo import build_backbone, split_at
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog


def recipe(samples: int, n: int, bits: int, epochs: int, batch: int) -> dict:
    train = {"epochs": epochs, "lr": 0.001, "optimizer": "adamw", "schedule": "cosine"}
    return {
        "name": f"bench-cache-reuse-n{n}",
        "seed": 0,
        "stages": {
            "data": {
                "type": "synthetic",
                "num_samples": int(samples / 0.8) + 8,
                "num_classes": 10,
                "size": 224,
            },
            "split": {"type": "split", "input": "data", "val_fraction": 0.1, "test_fraction": 0.1},
            "model": {"type": "backbone", "arch": "mobilenet_v2", "num_classes": 10},
            "images": {"type": "decode", "input": "split", "resolution": 224, "batch_size": batch},
            "aug_images": {
                "type": "decode",
                "input": "split",
                "resolution": 224,
                "batch_size": batch,
                "augment": {"crop_padding": 16, "hflip": 0.5},
            },
            "features": {
                "type": "frozen_forward",
                "input": "images",
                "model": "model",
                "train_last_blocks": n,
            },
            "quantized": {"type": "quantize", "input": "features", "bits": bits},
            "cache": {"type": "cache", "input": "quantized"},
            "deq": {"type": "dequantize", "input": "cache"},
            "faug": {"type": "feature_aug", "input": "deq", "crop_padding": 1, "hflip": 0.5},
            "two_stage": {
                "type": "finetune",
                "mode": "two_stage",
                "model": "model",
                "features": "faug",
                "batch_size": batch,
                "train": train,
            },
            "single_stage": {
                "type": "finetune",
                "mode": "single_stage",
                "model": "model",
                "images": "aug_images",
                "train_last_blocks": n,
                "batch_size": batch,
                "train": train,
            },
        },
        "targets": ["two_stage", "single_stage"],
    }


def compute_limit(n: int, samples: int, batch: int, epochs: int) -> tuple[float, tuple[int, ...]]:
    """Seconds per epoch of top fwd+bwd+step on in-memory feature tensors."""
    net = build_backbone("mobilenet_v2", 10)
    bottom, top = split_at(net, n)
    with torch.inference_mode():
        shape = tuple(bottom(torch.zeros(1, 3, 224, 224)).shape[1:])
    feats = torch.randn(samples, *shape).clamp(0, 6)
    labels = torch.randint(0, 10, (samples,))
    opt = torch.optim.AdamW(top.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    top.train()
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        for s in range(0, samples, batch):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(top(feats[s : s + batch]), labels[s : s + batch])
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
    return min(times), shape


def bare_forward(n: int, samples: int, batch: int) -> float:
    """Images/s of the frozen bottom alone, inputs already decoded in memory."""
    bottom, _ = split_at(build_backbone("mobilenet_v2", 10), n)
    bottom.eval()
    x = torch.randn(batch, 3, 224, 224)
    with torch.inference_mode():
        bottom(x)
        t0 = time.perf_counter()
        for _ in range(0, samples, batch):
            bottom(x)
    return (samples // batch * batch) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=512, help="training samples per epoch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cuts", type=int, nargs="+", default=[1, 4, 7])
    args = ap.parse_args()
    rows = []
    for n in args.cuts:
        with tempfile.TemporaryDirectory() as store:
            ctx = RunContext(catalog=Catalog(Path(store)), seed=0, recipe_name=f"bench-n{n}")
            runner = Runner(
                recipe_from_dict(recipe(args.samples, n, args.bits, args.epochs, args.batch)), ctx
            )
            reports = {r.name: r for r in runner.run()}
            train_samples = runner.specs["images"].splits["train"].num_samples
            build = reports["cache"]
        limit, shape = compute_limit(n, train_samples, args.batch, args.epochs)
        fwd_ips = bare_forward(n, max(train_samples, 256), args.batch)
        total = sum(s.num_samples for s in runner.specs["images"].splits.values())
        two = reports["two_stage"].metrics
        one = reports["single_stage"].metrics
        row = {
            "train_last_blocks": n,
            "feature_shape": list(shape),
            "train_samples": train_samples,
            "single_stage_epoch_s": one["epoch_seconds_steady"],
            "two_stage_epoch_s": two["epoch_seconds_steady"],
            "compute_limit_epoch_s": limit,
            "speedup_two_vs_single": one["epoch_seconds_steady"] / two["epoch_seconds_steady"],
            "two_stage_over_compute_limit": two["epoch_seconds_steady"] / limit,
            "cache_build_s": build.seconds,
            "cache_build_images_per_s": total / build.seconds,
            "bare_forward_images_per_s": fwd_ips,
            "build_over_bare_forward": (total / build.seconds) / fwd_ips,
            "cache_bytes": two["cache_bytes"],
            "bits": two["bits"],
        }
        rows.append(row)
        print(
            f"N={n}: single {row['single_stage_epoch_s']:.2f}s  two-stage {row['two_stage_epoch_s']:.3f}s  "
            f"limit {limit:.3f}s  (two/limit {row['two_stage_over_compute_limit']:.2f}, "
            f"speedup {row['speedup_two_vs_single']:.1f}x)  "
            f"build {row['cache_build_images_per_s']:.1f} img/s "
            f"vs bare fwd {fwd_ips:.1f} img/s ({row['build_over_bare_forward']:.2f})"
        )
    targets = {
        "two_stage_within_10pct_of_compute_limit": all(
            r["two_stage_over_compute_limit"] <= 1.10 for r in rows
        ),
        "cache_build_at_least_90pct_of_bare_forward": all(r["build_over_bare_forward"] >= 0.90 for r in rows),
    }
    path = write_result(
        "cache_reuse_epoch_time",
        {
            "question": "per-epoch time single-stage vs two-stage (from cache) vs compute limit; "
            "cache build throughput",
            "command": "python benchmarks/bench_cache_reuse.py "
            + " ".join(
                f"--{k} {v if not isinstance(v, list) else ' '.join(map(str, v))}"
                for k, v in vars(args).items()
            ),
            "settings": {
                **vars(args),
                "arch": "mobilenet_v2",
                "resolution": 224,
                "weights": "random init",
                "data": "synthetic 224x224",
                "torch_threads": torch.get_num_threads(),
            },
            "rows": rows,
            "targets": targets,
        },
    )
    print(f"targets: {targets}\nwrote {path}")


if __name__ == "__main__":
    main()
