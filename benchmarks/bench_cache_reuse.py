"""Epoch time: single-stage baseline vs training from the cache vs the compute limit (issue: the main job).

MobileNetV2 at 224x224, training the last 1, 4 and 7 blocks (Cache & Reuse, Table 2
settings), all in one process and one run through the real pipeline (recipes built
in code, a real zarr store in a temporary directory):

- single-stage: decode -> input augmentation -> frozen bottom (no grad) -> top fwd+bwd, every epoch;
- two-stage: read cache -> dequantize -> feature augmentation -> top fwd+bwd;
- compute limit: top fwd+bwd (same optimizer, batch size, sample count) on tensors already in memory;
- cache build throughput vs the bare frozen forward on tensors already in memory.

Data: the toolkit's synthetic images, generated once per run and written as JPEG
files (quality 90, 224x224) to a class-per-folder tree in a temporary directory,
read back by the ``image_folder`` source. The build then costs what it costs on a
real dataset: read + decode stored images, frozen forward, quantize, write. (The
``synthetic`` source generates pixels on demand, on the same cores as the
forward and at a cost comparable to it: a build from it measures the generator,
not the pipeline.)

Fair comparisons, all in one process and one run:
- bare forward: the same frozen bottom (same weights), fed the same decoded
  batches the build feeds it (same images, batch size and thread count), timed
  in two passes, one before and one after the build; the faster pass is the
  reference (the stricter choice for the build/bare ratio);
- two-stage vs compute limit: both as the mean of the epochs after the first
  (the first pays one-off allocation and file-cache costs); the compute limit is
  also timed in two passes, before and after the pipeline run, and the faster
  one is the reference. The min-over-epochs ratio is reported beside it. The bar uses
  the median of ``--repeats`` paired repeats, each a compute-limit pass and a two-stage pass
  from the stored cache back to back (which one goes first alternates from pair to pair, so
  neither always runs in the state the other leaves): a shared host's speed swings between
  time windows by more than the 10% the bar tests, and a pair taken close together
  cancels most of that; each pass of a pair runs at least ``--pair-seconds`` of
  epochs after the first (more epochs than ``--epochs`` when an epoch is short). The build
  bar is taken the same way: ``--repeats`` pairs of a bare-forward pass and a fresh build
  (new store) back to back, order alternating, median ratio; these builds are of a separate
  dataset of ``--build-images`` JPEGs, large enough that the build's one-off costs (creating
  the entry, commit) weigh on its throughput as they would on a real dataset's.

Weights are random. Timing can depend on values, not only on shapes: random MobileNetV2 weights
give features that are almost all zero, so the top's weight gradients are mostly zero, and torch's
for-loop Adam/AdamW takes the square root of zero second moments far slower than of others (a
visible share of a 1-block epoch). The trainer's optimizer is fused (pipeline/methods/trainer.py), and
the compute limit uses the same one, on which an epoch over the cached features takes as long as one
over ``randn`` tensors (numbers in the README's Cache & Reuse notes); the limit keeps its ``randn`` tensors.

The cached splits are small enough to stay in memory after their first read (the cache stage's
``keep_in_memory_bytes``), which is what a run does by default; each paired repeat
also runs the two-stage pass with ``keep_in_memory_bytes: 0`` (every epoch reads, checks and
decompresses the chunks again), reported beside the bar as ``two_stage_from_storage_*``.
Usage: python -m benchmarks.bench_cache_reuse [--samples 512] [--epochs 3] [--bits 2] [--build-images 1024]

On a GPU: ``--device cuda [--batches 32 128] [--compile]`` runs :mod:`benchmarks.cache_reuse_cuda`
instead (writes ``cache_reuse_epoch_time_cuda.json``; refuses, exit 2, without CUDA). ``--device cpu
--quick`` runs that GPU benchmark's code on this CPU, briefly, as a check, writing to a temporary folder.
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks import cache_reuse_cuda
from benchmarks._meta import write_result
from pipeline.codec import native
from pipeline.context import RunContext
from pipeline.data.sources import synthetic
from pipeline.methods.trainer import TrainConfig, make_optimizer
from pipeline.models.fold import fold_batch_norms
from pipeline.models.zoo import build_backbone, split_at
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from pipeline.switches import KEEP_HEAP, apply_process_settings
from stores.catalog import Catalog

JPEG_QUALITY = 90


def num_images(samples: int) -> int:
    """Images in the dataset so that the train split (80%) holds about ``samples``."""
    return int(samples / 0.8) + 8


def write_image_folder(root: Path, count: int, *, num_classes: int = 10, size: int = 224) -> int:
    """Write ``count`` synthetic images as JPEG files in ``root/<class>/``; returns bytes written.

    Done once, outside every timed section, so the build reads stored images like it
    would from a real dataset instead of paying for pixel generation.
    """
    images = synthetic(count, num_classes, size, seed=0)["train"]
    written = 0
    for start in range(0, count, 64):
        idx = np.arange(start, min(start + 64, count))
        for i, pixels in zip(idx, images.load(idx), strict=True):
            folder = root / images.class_names[int(images.labels[i])]
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{int(i):06d}.jpg"
            Image.fromarray(pixels).save(path, quality=JPEG_QUALITY)
            written += path.stat().st_size
    return written


def recipe(samples: int, n: int, bits: int, epochs: int, batch: int, images: Path) -> dict:
    train = {"epochs": epochs, "lr": 0.001, "optimizer": "adamw", "schedule": "cosine"}
    return {
        "name": f"bench-cache-reuse-n{n}",
        "seed": 0,
        "stages": {
            "data": {"type": "image_folder", "root": str(images)},
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


def compute_limit(n: int, samples: int, batch: int, epochs: int) -> tuple[list[float], tuple[int, ...]]:
    """Seconds of each epoch of top fwd+bwd+step on in-memory feature tensors, and the feature shape."""
    net = build_backbone("mobilenet_v2", 10)
    bottom, top = split_at(net, n)
    with torch.inference_mode():
        shape = tuple(bottom(torch.zeros(1, 3, 224, 224)).shape[1:])
    feats = torch.randn(samples, *shape).clamp(0, 6)
    labels = torch.randint(0, 10, (samples,))
    opt = make_optimizer(list(top.parameters()), TrainConfig(lr=1e-3, optimizer="adamw"))  # the trainer's
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
    return times, shape


def top_settings(pairs: list[str], n: int) -> dict[str, str]:
    """The ``--top-set [CUT:]KEY=VALUE`` settings that apply at cut ``n`` (no CUT: every cut)."""
    out = {}
    for item in pairs:
        cut, _, setting = item.rpartition(":")
        key, sep, value = setting.partition("=")
        if not sep or (cut and not cut.isdigit()):
            raise SystemExit(f"--top-set {item!r}: expected [CUT:]KEY=VALUE, "
                             "e.g. 7:memory_format=channels_last")
        if not cut or int(cut) == n:
            out[key] = value
    return out


def steady(times: list[float]) -> float:
    """Mean seconds of the epochs after the first (the trainer's ``epoch_seconds_steady``)."""
    rest = times[1:] or times
    return sum(rest) / len(rest)


def decoded_batches(runner: Runner) -> list[torch.Tensor]:
    """Every split's decoded image batches, exactly as the cache build's frozen forward receives them."""
    images = runner.output("images")
    return [b["x"] for split in images.spec.splits for b in images.open(split)]


def bare_forward(bottom: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """Images/s of the frozen bottom alone on already-decoded batches (after one warm-up batch)."""
    bottom.eval()
    with torch.inference_mode():
        bottom(batches[0])
        t0 = time.perf_counter()
        for x in batches:
            bottom(x)
    return sum(len(x) for x in batches) / (time.perf_counter() - t0)


def measure_cut(n: int, args: argparse.Namespace, images_dir: Path, build_dir: Path) -> dict:
    """One row of the table: build, two-stage, single-stage, compute limit and bare forward for cut ``n``.

    ``build_dir`` holds the ``--build-images`` images the paired build repeats build a cache of.
    """
    with tempfile.TemporaryDirectory() as store:
        ctx = RunContext(catalog=Catalog(Path(store)), seed=0, recipe_name=f"bench-n{n}")
        runner = Runner(
            recipe_from_dict(recipe(args.samples, n, args.bits, args.epochs, args.batch, images_dir)), ctx
        )
        t0 = time.perf_counter()
        batches = decoded_batches(runner)
        decode_ips = sum(len(x) for x in batches) / (time.perf_counter() - t0)
        # The bottom as the frozen forward runs it: frozen, batch norms folded into the convolutions.
        bottom = fold_batch_norms(split_at(runner.output("model").build(), n)[0].requires_grad_(False))
        train_samples = runner.specs["images"].splits["train"].num_samples
        total = sum(s.num_samples for s in runner.specs["images"].splits.values())
        fwd_before = bare_forward(bottom, batches)
        limit_before, shape = compute_limit(n, train_samples, args.batch, args.epochs)
        reports = {r.name: r for r in runner.run()}
        fwd_after = bare_forward(bottom, batches)
        limit_after, _ = compute_limit(n, train_samples, args.batch, args.epochs)
        build = reports["cache"]
        del batches
        # Paired repeats for the build bar too: a bare-forward pass next to a fresh build of a cache (a
        # new store, so every image is decoded, forwarded, quantized and written again), of a dataset
        # large enough (--build-images) that the build's one-off costs weigh on its throughput as little
        # as in a real dataset's; the pipeline run above is the small-dataset figure.
        build_paired, bare_s, build_s = [], [], []
        build_only = recipe(args.samples, n, args.bits, args.epochs, args.batch, build_dir)
        build_only["targets"] = ["cache"]
        with tempfile.TemporaryDirectory() as scratch:
            scratch_ctx = RunContext(catalog=Catalog(Path(scratch)), seed=0, recipe_name=f"bench-n{n}")
            build_runner = Runner(recipe_from_dict(build_only), scratch_ctx)
            build_batches = decoded_batches(build_runner)
            build_bottom = fold_batch_norms(
                split_at(build_runner.output("model").build(), n)[0].requires_grad_(False)
            )
        build_total = sum(len(x) for x in build_batches)

        def rebuild() -> float:
            with tempfile.TemporaryDirectory() as fresh:
                fresh_ctx = RunContext(catalog=Catalog(Path(fresh)), seed=0, recipe_name=f"bench-n{n}")
                rebuilt = {r.name: r for r in Runner(recipe_from_dict(build_only), fresh_ctx).run()}
            assert rebuilt["cache"].status == "computed"
            return rebuilt["cache"].seconds

        for i in range(args.repeats):
            # Alternate which of the pair runs first, so that neither side is always the one after
            # the other (a heap or cache state one leaves behind, a drift in the host's speed).
            if i % 2 == 0:
                fwd_r = bare_forward(build_bottom, build_batches)
                build_r = rebuild()
            else:
                build_r = rebuild()
                fwd_r = bare_forward(build_bottom, build_batches)
            build_paired.append(build_total / build_r / fwd_r)
            bare_s.append(build_total / fwd_r)
            build_s.append(build_r)
        del build_batches
        # Paired repeats: a compute-limit pass next to a two-stage pass (from the stored cache), first one
        # then the other in turn, so each ratio compares two measurements taken close together; the
        # median resists this host's speed swings between time windows.
        paired, limit_s, two_s, storage_paired, storage_s = [], [], [], [], []
        # Each paired pass runs enough epochs for --pair-seconds of steady epochs (at least --epochs):
        # at 1 block an epoch is short, and two of them are too short a window to time on a shared host.
        pair_epochs = max(args.epochs, 1 + math.ceil(args.pair_seconds / steady(limit_before)))
        two_only = recipe(args.samples, n, args.bits, pair_epochs, args.batch, images_dir)
        two_only["targets"] = ["two_stage"]
        from_storage = copy.deepcopy(two_only)
        from_storage["stages"]["cache"]["keep_in_memory_bytes"] = 0  # same entry: a reading knob

        def two_stage_pass(spec: dict) -> float:
            return {r.name: r for r in Runner(recipe_from_dict(spec), ctx).run()}["two_stage"].metrics[
                "epoch_seconds_steady"
            ]

        passes = {
            "limit": lambda: steady(compute_limit(n, train_samples, args.batch, pair_epochs)[0]),
            "two": lambda: two_stage_pass(two_only),
            "storage": lambda: two_stage_pass(from_storage),
        }
        fast_settings = top_settings(args.top_set, n)
        fast_paired: list[float] = []
        if fast_settings:
            # The same two-stage pass with the top's speed switches (train.*): a new training stage
            # (its fingerprint names them) reading the same cache entry, which must be reused.
            fast = copy.deepcopy(two_only)
            fast["stages"]["two_stage"]["train"].update(fast_settings)

            def fast_pass() -> float:
                reports = {r.name: r for r in Runner(recipe_from_dict(fast), ctx).run()}
                assert reports["cache"].status == "reused", "the fast pass must read the same cache bytes"
                return float(reports["two_stage"].metrics["epoch_seconds_steady"])

            passes["fast"] = fast_pass
        for i in range(args.repeats):
            order = list(passes) if i % 2 == 0 else list(passes)[::-1]
            took = {name: passes[name]() for name in order}
            if "fast" in took:
                fast_paired.append(took["fast"] / took["limit"])
            paired.append(took["two"] / took["limit"])
            storage_paired.append(took["storage"] / took["limit"])
            limit_s.append(took["limit"])
            two_s.append(took["two"])
            storage_s.append(took["storage"])
    # The faster pass is the reference for both bars: the stricter choice, and robust to the
    # machine being slower for a while during one of the passes.
    limit_times = min(limit_before, limit_after, key=steady)
    limit = steady(limit_times)
    fwd_ips = max(fwd_before, fwd_after)
    two = reports["two_stage"].metrics
    one = reports["single_stage"].metrics
    build_ips = total / build.seconds
    row = {
        "train_last_blocks": n,
        "feature_shape": list(shape),
        "train_samples": train_samples,
        "single_stage_epoch_s": one["epoch_seconds_steady"],
        "two_stage_epoch_s": two["epoch_seconds_steady"],
        "two_stage_epoch_s_all": two["epoch_seconds_all"],
        "compute_limit_epoch_s": limit,
        "compute_limit_epoch_s_all": limit_times,
        "compute_limit_epoch_s_passes": [steady(limit_before), steady(limit_after)],
        "speedup_two_vs_single": one["epoch_seconds_steady"] / two["epoch_seconds_steady"],
        "two_stage_over_compute_limit": two["epoch_seconds_steady"] / limit,
        "two_stage_over_compute_limit_min": min(two["epoch_seconds_all"][1:] or two["epoch_seconds_all"])
        / min(limit_times[1:] or limit_times),
        "two_stage_over_compute_limit_paired": paired,
        "paired_pass_epochs": pair_epochs,
        "two_stage_over_compute_limit_median": float(np.median(paired))
        if paired
        else two["epoch_seconds_steady"] / limit,
        "two_stage_from_storage_over_compute_limit_paired": storage_paired,
        "two_stage_from_storage_over_compute_limit_median": float(np.median(storage_paired))
        if storage_paired
        else None,
        "cache_build_s": build.seconds,
        "cache_build_images": total,
        "cache_build_images_per_s": build_ips,
        "bare_forward_images_per_s": fwd_ips,
        "bare_forward_images_per_s_passes": [fwd_before, fwd_after],
        "decode_images_per_s": decode_ips,
        "build_over_bare_forward": build_ips / fwd_ips,
        "build_over_bare_forward_paired": build_paired,
        "paired_build_images": build_total,
        "build_over_bare_forward_median": float(np.median(build_paired))
        if build_paired
        else build_ips / fwd_ips,
        # Raw seconds of every repeat, and the ratio of the fastest repeat of each side: noise on this
        # host only adds time, so each side's fastest repeat is its least disturbed one (timeit's
        # reasoning). Reported beside the paired medians; the bars use the paired medians.
        "repeats_bare_forward_s": bare_s,
        "repeats_build_s": build_s,
        "repeats_compute_limit_epoch_s": limit_s,
        "repeats_two_stage_epoch_s": two_s,
        "repeats_two_stage_from_storage_epoch_s": storage_s,
        "build_over_bare_forward_best": min(bare_s) / min(build_s) if build_s else None,
        "two_stage_over_compute_limit_best": min(two_s) / min(limit_s) if two_s else None,
        "cache_bytes": two["cache_bytes"],
        "bits": two["bits"],
    }
    if fast_settings:
        row.update({
            "top_settings": fast_settings,
            "fast_two_stage_over_compute_limit_paired": fast_paired,
            "fast_two_stage_over_compute_limit_median": float(np.median(fast_paired)),
        })
    print(
        f"N={n}: single {row['single_stage_epoch_s']:.2f}s  two-stage {row['two_stage_epoch_s']:.3f}s  "
        f"limit {limit:.3f}s  (two/limit {row['two_stage_over_compute_limit']:.2f}, paired median "
        f"{row['two_stage_over_compute_limit_median']:.2f}, from storage "
        f"{row['two_stage_from_storage_over_compute_limit_median'] or float('nan'):.2f}, "
        f"speedup {row['speedup_two_vs_single']:.1f}x)  "
        f"build {build_ips:.1f} img/s vs bare fwd {fwd_ips:.1f} img/s "
        f"({row['build_over_bare_forward']:.2f}, paired median {row['build_over_bare_forward_median']:.2f}); "
        f"decode alone {decode_ips:.0f} img/s",
        flush=True,
    )
    return row


def measure_cut_isolated(n: int, args: argparse.Namespace, images_dir: Path, build_dir: Path) -> dict:
    """:func:`measure_cut` in a spawned process, set up as the CLI sets up a run."""
    apply_process_settings()
    torch.set_num_threads(2)
    return measure_cut(n, args, images_dir, build_dir)


def main() -> None:
    # As the CLI does: the heap keeps freed buffers unless ONDEVICE_TL_KEEP_HEAP=0 (pipeline/heap.py);
    # an opted-out run writes its own result file, so both configurations stay on record.
    keep_heap = apply_process_settings()[KEEP_HEAP]
    # And cached features are dequantized by the compiled kernel when it can be built here
    # (pipeline/codec/native.py); ONDEVICE_TL_NATIVE=0 measures the torch ops instead.
    kernel = native.kernel() is not None
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=512, help="training samples per epoch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cuts", type=int, nargs="+", default=[1, 4, 7])
    ap.add_argument(
        "--build-images",
        type=int,
        default=1024,
        help="images in the dataset the paired build repeats (the build bar) build a cache of",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="paired (compute limit, two-stage) repeats for the median ratio",
    )
    ap.add_argument(
        "--pair-seconds",
        type=float,
        default=2.0,
        help="steady-epoch seconds each paired two-stage / compute-limit pass runs at least",
    )
    ap.add_argument(
        "--top-set", action="append", default=[], metavar="[CUT:]KEY=VALUE",
        help="a train setting (e.g. precision=bf16, 7:memory_format=channels_last) of a fourth paired "
        "pass: the two-stage epoch with the top's speed switches, whose median ratio is the 0.85 bar",
    )
    ap.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="write the JSON here instead of benchmarks/results (a trial run must not replace a result)",
    )
    ap.add_argument(
        "--device", default="cpu",
        help="cpu (this benchmark) or cuda / cuda:N (the GPU one: benchmarks/cache_reuse_cuda.py)",
    )
    cache_reuse_cuda.add_arguments(ap)
    args = ap.parse_args()
    if args.device != "cpu" or args.quick:
        if args.quick:
            cache_reuse_cuda.quick(args)
        cache_reuse_cuda.run(args, write_image_folder, num_images)
        return
    del args.device, args.batches, args.compile, args.quick  # the GPU run's options
    results_dir = args.results_dir
    del args.results_dir  # where the result goes is not a setting of the measurement
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-cache-reuse-images-") as tmp:
        images_dir = Path(tmp)
        count = num_images(args.samples)
        image_bytes = write_image_folder(images_dir / "train", count)
        build_dir = images_dir / "build"
        write_image_folder(build_dir, args.build_images)
        for n in args.cuts:
            # A fresh process per cut: one cut's training and builds leave the heap (and its page
            # faults) in a state that would otherwise skew the next cut's measurements.
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                job = pool.submit(measure_cut_isolated, n, args, images_dir / "train", build_dir)
                rows.append(job.result())
    targets = {
        **({"fast_two_stage_at_most_85pct_of_eager_loop": all(
            r["fast_two_stage_over_compute_limit_median"] <= 0.85 for r in rows)} if args.top_set else {}),
        # The median of paired repeats: robust to the host's speed changing between passes.
        "two_stage_within_10pct_of_compute_limit": all(
            r["two_stage_over_compute_limit_median"] <= 1.10 for r in rows
        ),
        "cache_build_at_least_90pct_of_bare_forward": all(
            r["build_over_bare_forward_median"] >= 0.90 for r in rows
        ),
    }
    path = write_result(
        "cache_reuse_epoch_time"
        + ("_top_switches" if args.top_set else "")  # the result without them stays on record
        + ("" if keep_heap else "_malloc_defaults")
        + ("" if kernel else "_torch_dequantize"),
        {
            "question": "per-epoch time single-stage vs two-stage (from cache) vs compute limit; "
            "cache build throughput",
            "command": ("" if keep_heap else "ONDEVICE_TL_KEEP_HEAP=0 ")
            + ("" if kernel else "ONDEVICE_TL_NATIVE=0 ")
            + "python -m benchmarks.bench_cache_reuse "
            + " ".join(
                f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ' '.join(map(str, v))}"
                for k, v in vars(args).items() if k != "top_set"
            )
            + "".join(f" --top-set {item}" for item in args.top_set),
            "settings": {
                **vars(args),
                "arch": "mobilenet_v2",
                "resolution": 224,
                "weights": "random init",
                "data": f"{count} synthetic 224x224 images (10 classes) pre-written as JPEG quality "
                f"{JPEG_QUALITY} ({image_bytes / count / 1024:.1f} KiB/image) in a temporary folder, read "
                "by the image_folder source (80/10/10 split); the cache build decodes them",
                "bare_forward": "same bottom and weights on the same decoded batches as the build, "
                "faster of two passes (before and after the build)",
                "epoch_statistic": "mean of epochs after the first, for two-stage and compute limit alike; "
                "compute limit: faster of two passes (before and after the pipeline run)",
                "two_stage_over_limit_bar": f"median over {args.repeats} paired repeats, each a "
                "compute-limit pass, a two-stage pass from the stored cache (its splits kept in memory "
                "after the first epoch, the default) and one reading from storage every epoch "
                "(keep_in_memory_bytes: 0) back to back (in that order in even repeats, reversed in odd "
                f"ones), each pass at least {args.pair_seconds} s of epochs after the first "
                "(paired_pass_epochs); the bar is on the default pass",
                "optimizer": "AdamW, fused (the trainer's make_optimizer) for the two-stage pass and the "
                "compute limit alike",
                "build_over_bare_bar": f"median over {args.repeats} paired repeats, each a bare-forward "
                f"pass and a fresh build in a new store back to back (bare first in even repeats, build "
                f"first in odd ones), of a cache of {args.build_images} other images written the same way "
                "(repeats_* fields); the pipeline run's build (build_over_bare_forward) is of the "
                f"{count} images above",
                "chunking": "each split's chunks about chunk_bytes (1 MiB) of its own samples",
                "torch_threads": 2,
                "isolation": "each cut measured in a fresh (spawned) process",
                "malloc": "keep_freed_heap (the default)"
                if keep_heap
                else "glibc defaults (ONDEVICE_TL_KEEP_HEAP=0)",
                "dequantize": "compiled kernel, pipeline/codec/native.py (the default)"
                if kernel
                else "torch ops (ONDEVICE_TL_NATIVE=0 or no C compiler)",
                "kernel_threads": native.threading_kind(),
            },
            "rows": rows,
            "targets": targets,
        },
        results_dir,
    )
    print(f"targets: {targets}\nwrote {path}")


if __name__ == "__main__":
    main()
