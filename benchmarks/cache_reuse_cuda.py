"""``bench_cache_reuse --device cuda``: Cache & Reuse's epoch times and cache build on a GPU.

MobileNetV2 at 224x224, last 1/4/7 blocks trained, batch 32 and 128 (issue 22), through the real
pipeline with ``run.device`` set, all in one process:

- single-stage: decode (CPU threads) -> input augmentation -> frozen bottom -> top fwd+bwd, every epoch;
- two-stage: cache (packed codes copied to the GPU a few batches ahead, or resident there after the
  first epoch) -> unpack + dequantize + feature crop/flip on the GPU -> top fwd+bwd;
- compute limit: top fwd+bwd+step on feature tensors already on the GPU (same optimizer, batch size,
  sample count), and the same with the top under ``torch.compile`` (does it raise the ceiling?);
- cache build throughput vs the bare GPU frozen forward on decoded batches already on the GPU;
- JPEG decoding: the pipeline's CPU threads (PIL, resize, normalize, pinned) vs
  ``torchvision.io.decode_jpeg(device="cuda")`` + resize + normalize on the GPU, images/s.

Every GPU time is taken with ``torch.cuda.synchronize()`` at its ends. The result names the GPU
(``torch.cuda.get_device_name()``) and is written as ``benchmarks/results/cache_reuse_epoch_time_cuda.json``.
``--device cpu`` runs the same code on the CPU, to check it where there is no GPU; that result goes to a
temporary folder (never over the CPU result files).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._device import require_device
from benchmarks._meta import write_result
from pipeline.context import RunContext
from pipeline.device import ieee_fp32
from pipeline.methods.amp import AmpPolicy
from pipeline.methods.graphed import StepGraph
from pipeline.methods.trainer import TrainConfig, make_optimizer
from pipeline.models.fold import fold_batch_norms
from pipeline.models.zoo import build_backbone, split_at
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from pipeline.stages.decode import IMAGENET_MEAN, IMAGENET_STD
from stores.catalog import Catalog

# What the GPU run measures with (bench_cache_reuse's CPU-run options are not used by it).
SETTINGS = ("device", "samples", "epochs", "bits", "cuts", "batches", "compile", "quick")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_limit(n: int, samples: int, batch: int, epochs: int, device: torch.device, *,
                  compiled: bool = False, graphed: bool = False) -> tuple[list[float], tuple[int, ...]]:
    """Seconds of each epoch of top fwd+bwd+step on feature tensors already on ``device``: the plain
    eager loop a user would write, or (``graphed``) the same step captured as a CUDA graph by the
    trainer's :class:`StepGraph`, each batch copied into the graph's inputs and replayed."""
    net = build_backbone("mobilenet_v2", 10)
    bottom, top = split_at(net, n)
    with torch.inference_mode():
        shape = tuple(bottom(torch.zeros(1, 3, 224, 224)).shape[1:])
    feats = torch.randn(samples, *shape).clamp(0, 6).to(device)
    labels = torch.randint(0, 10, (samples,)).to(device)
    top = top.to(device)
    opt = make_optimizer(list(top.parameters()), TrainConfig(lr=1e-3, optimizer="adamw"))  # the trainer's
    step_top: Any = torch.compile(top) if compiled else top
    loss_fn = torch.nn.CrossEntropyLoss()
    top.train()
    graph = None
    if graphed and device.type == "cuda":  # a CPU check of this script times the eager loop twice
        params = list(top.parameters())
        graph = StepGraph(top, opt, params, AmpPolicy("fp32", device), loss_fn, None, device)
    times = []
    for _ in range(epochs):
        sync(device)
        t0 = time.perf_counter()
        for s in range(0, samples, batch):
            if graph is not None:
                graph.step(feats[s : s + batch], labels[s : s + batch])
                continue
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(step_top(feats[s : s + batch]), labels[s : s + batch])
            loss.backward()
            opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, shape


def steady(times: list[float]) -> float:
    rest = times[1:] or times
    return sum(rest) / len(rest)


def bare_forward(bottom: torch.nn.Module, batches: list[torch.Tensor], device: torch.device) -> float:
    """Images/s of the frozen bottom alone on decoded batches already on ``device`` (after a warm-up)."""
    bottom.eval()
    with torch.inference_mode(), ieee_fp32(device):
        bottom(batches[0])
        sync(device)
        t0 = time.perf_counter()
        for x in batches:
            bottom(x)
        sync(device)
    return sum(len(x) for x in batches) / (time.perf_counter() - t0)


def gpu_jpeg_decode(images_dir: Path, batch: int, device: torch.device) -> dict[str, Any]:
    """Images/s of ``torchvision.io.decode_jpeg`` on ``device`` + resize to 224 + normalize, batched;
    the files' bytes are read first (storage is not what this measures)."""
    from torchvision.io import decode_jpeg, read_file

    files = sorted(images_dir.rglob("*.jpg"))
    data = [read_file(str(f)) for f in files]
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255

    def one_pass() -> float:
        sync(device)
        t0 = time.perf_counter()
        for s in range(0, len(data), batch):
            decoded = decode_jpeg(data[s : s + batch], device=device)
            x = torch.stack([F.interpolate(im[None].float(), size=(224, 224), mode="bilinear",
                                           antialias=True, align_corners=False)[0] for im in decoded])
            ((x - mean) / std).contiguous()
        sync(device)
        return time.perf_counter() - t0

    try:
        one_pass()  # warm-up: the decoder's handles and buffers
        seconds = min(one_pass() for _ in range(2))
    except (RuntimeError, TypeError) as exc:  # a torchvision without GPU decoding says so here
        return {"images_per_s": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"images_per_s": len(data) / seconds, "images": len(data)}


def measure(n: int, batch: int, args: argparse.Namespace, images_dir: Path, device: torch.device) -> dict:
    from benchmarks.bench_cache_reuse import decoded_batches, recipe

    with tempfile.TemporaryDirectory() as store:
        ctx = RunContext(catalog=Catalog(Path(store)), seed=0, recipe_name=f"bench-cuda-n{n}",
                         device=str(device))
        spec = recipe(args.samples, n, args.bits, args.epochs, batch, images_dir)
        # The two-stage trainer as it runs by default on a GPU (its step a CUDA graph that decodes the
        # resident codes) and the same trainer with the graph off: the eager step, dequantized ahead.
        eager = dict(spec["stages"]["two_stage"])
        eager["train"] = {**eager["train"], "cuda_graph": "off"}
        spec["stages"]["two_stage_eager"] = eager
        spec["targets"] = [*spec["targets"], "two_stage_eager"]
        runner = Runner(recipe_from_dict(spec), ctx)
        t0 = time.perf_counter()
        decoded = decoded_batches(runner)  # CPU threads into pinned memory, as the build gets them
        decode_ips = sum(len(x) for x in decoded) / (time.perf_counter() - t0)
        bottom = fold_batch_norms(split_at(runner.output("model").build(), n)[0].requires_grad_(False))
        bottom = bottom.to(device)
        on_device = [x.to(device) for x in decoded]
        del decoded
        total = sum(len(x) for x in on_device)
        train_samples = runner.specs["images"].splits["train"].num_samples
        fwd_before = bare_forward(bottom, on_device, device)
        limit_before, shape = compute_limit(n, train_samples, batch, args.epochs, device)
        graphed_before, _ = compute_limit(n, train_samples, batch, args.epochs, device, graphed=True)
        reports = {r.name: r for r in runner.run()}
        fwd_after = bare_forward(bottom, on_device, device)
        limit_after, _ = compute_limit(n, train_samples, batch, args.epochs, device)
        graphed_after, _ = compute_limit(n, train_samples, batch, args.epochs, device, graphed=True)
        del on_device
        compiled: dict[str, Any] = {}
        if args.compile:
            try:
                compiled["epoch_s"] = steady(compute_limit(n, train_samples, batch, args.epochs + 1, device,
                                                           compiled=True)[0])
            except Exception as exc:  # noqa: BLE001  a compiler toolchain missing: recorded, not fatal
                compiled["error"] = f"{type(exc).__name__}: {exc}"
    eager_limit = min(steady(limit_before), steady(limit_after))
    graphed_limit = min(steady(graphed_before), steady(graphed_after))
    limit = min(eager_limit, graphed_limit)  # the compute limit: the faster way to run the top's steps
    fwd_ips = max(fwd_before, fwd_after)
    build = reports["cache"]
    build_ips = total / build.seconds
    two = reports["two_stage"].metrics
    two_eager = reports["two_stage_eager"].metrics
    one = reports["single_stage"].metrics
    row = {
        "train_last_blocks": n,
        "batch_size": batch,
        "feature_shape": list(shape),
        "train_samples": train_samples,
        "single_stage_epoch_s": one["epoch_seconds_steady"],
        "two_stage_epoch_s": two["epoch_seconds_steady"],
        "two_stage_epoch_s_all": two["epoch_seconds_all"],
        "two_stage_cuda_graph": two.get("cuda_graph"),
        "two_stage_eager_epoch_s": two_eager["epoch_seconds_steady"],
        "single_stage_cuda_graph": one.get("cuda_graph"),
        "compute_limit_epoch_s": limit,
        "eager_top_loop_epoch_s": eager_limit,
        "eager_top_loop_epoch_s_passes": [steady(limit_before), steady(limit_after)],
        "graphed_top_loop_epoch_s": graphed_limit,
        "graphed_top_loop_epoch_s_passes": [steady(graphed_before), steady(graphed_after)],
        "compute_limit_compiled_top": compiled or None,
        "speedup_two_vs_single": one["epoch_seconds_steady"] / two["epoch_seconds_steady"],
        "two_stage_over_eager_top_loop": two["epoch_seconds_steady"] / eager_limit,
        "two_stage_eager_over_eager_top_loop": two_eager["epoch_seconds_steady"] / eager_limit,
        "two_stage_over_compute_limit": two["epoch_seconds_steady"] / limit,
        "single_stage_over_compute_limit": one["epoch_seconds_steady"] / limit,
        "cache_build_s": build.seconds,
        "cache_build_images": total,
        "cache_build_images_per_s": build_ips,
        "bare_forward_images_per_s": fwd_ips,
        "bare_forward_images_per_s_passes": [fwd_before, fwd_after],
        "build_over_bare_forward": build_ips / fwd_ips,
        "decode_cpu_threads_images_per_s": decode_ips,
        "cache_bytes": two.get("cache_bytes"),
        "bits": two.get("bits"),
    }
    print(f"N={n} batch {batch}: single {row['single_stage_epoch_s']:.4f}s  two-stage "
          f"{row['two_stage_epoch_s']:.4f}s (eager step {row['two_stage_eager_epoch_s']:.4f}s)  "
          f"eager top loop {eager_limit:.4f}s  graphed top loop {graphed_limit:.4f}s (two/eager loop "
          f"{row['two_stage_over_eager_top_loop']:.2f}, two/limit "
          f"{row['two_stage_over_compute_limit']:.2f}, speedup {row['speedup_two_vs_single']:.1f}x)  build "
          f"{build_ips:.0f} img/s vs bare fwd {fwd_ips:.0f} img/s ({row['build_over_bare_forward']:.2f}); "
          f"CPU decode {decode_ips:.0f} img/s", flush=True)
    return row


def run(args: argparse.Namespace, write_image_folder: Any, num_images: Any) -> Path:
    """Measure every (batch, cut) and write the result; ``bench_cache_reuse.main`` calls this."""
    device = require_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows, decode_gpu = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-cache-reuse-cuda-") as tmp:
        images_dir = Path(tmp) / "train"
        count = num_images(args.samples)
        image_bytes = write_image_folder(images_dir, count)
        for batch in args.batches:
            decode_gpu[str(batch)] = gpu_jpeg_decode(images_dir, batch, device)
            for n in args.cuts:
                rows.append(measure(n, batch, args, images_dir, device))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    settings = {k: getattr(args, k) for k in SETTINGS}
    at_32 = [r for r in rows if r["batch_size"] == 32]
    targets = {
        "two_stage_within_10pct_of_compute_limit": all(
            r["two_stage_over_compute_limit"] <= 1.10 for r in rows
        ),
        "two_stage_at_most_0.6x_eager_top_loop_at_batch_32": bool(at_32) and all(
            r["two_stage_over_eager_top_loop"] <= 0.6 for r in at_32
        ),
        "cache_build_at_least_90pct_of_bare_forward": all(r["build_over_bare_forward"] >= 0.90 for r in rows),
    }
    speed = [r["speedup_two_vs_single"] for r in rows]
    limit = [r["two_stage_over_compute_limit"] for r in rows]
    eager_loop = [r["two_stage_over_eager_top_loop"] for r in rows]
    build = [r["build_over_bare_forward"] for r in rows]
    payload = {
        "headline": f"{gpu or device}: two-stage {min(speed):.2f}–{max(speed):.2f}× faster per epoch than "
        f"single-stage; {min(eager_loop):.2f}–{max(eager_loop):.2f}× the plain eager top-only loop (CUDA "
        f"graph); {min(limit):.2f}–{max(limit):.2f}× the compute limit; build "
        f"{min(build):.2f}–{max(build):.2f}× the bare forward",
        "question": "on a GPU: per-epoch time single-stage vs two-stage (from cache) vs compute limit; cache "
        "build throughput vs the bare GPU frozen forward; JPEG decoding on CPU threads vs on the GPU",
        "device": str(device),
        "gpu": gpu,
        "cuda": torch.version.cuda,
        "command": "python -m benchmarks.bench_cache_reuse " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in settings.items() if k not in ("quick", "compile")
        ) + (" --compile" if args.compile else "") + (" --quick" if args.quick else ""),
        "settings": {
            **settings,
            "arch": "mobilenet_v2",
            "resolution": 224,
            "weights": "random init",
            "data": f"{count} synthetic 224x224 images as JPEG ({image_bytes / count / 1024:.1f} KiB/image), "
            "image_folder source, 80/10/10 split",
            "timing": "torch.cuda.synchronize() at both ends of every timed GPU section; epoch times are the "
            "mean of the epochs after the first; compute limit and bare forward: the better of a pass "
            "before and one after the pipeline run",
            "compute_limit": "the faster of two top-only loops on float features already on the GPU, same "
            "optimizer (fused AdamW), batch and samples: the plain eager loop a user would write "
            "(eager_top_loop) and the same step captured as a CUDA graph (graphed_top_loop)",
            "two_stage": "the pipeline's two-stage trainer as it runs by default (train.cuda_graph: auto: "
            "its step a CUDA graph that unpacks, dequantizes and crops the resident codes); "
            "two_stage_eager: the same with train.cuda_graph: off",
            "forward_precision": "fp32, TF32 off (the frozen_forward stage's fp32)",
        },
        "decode_gpu_jpeg": decode_gpu,
        "rows": rows,
        "targets": targets,
    }
    # A CPU run checks the code path; it never replaces a result file.
    directory = args.results_dir
    if device.type != "cuda" or args.quick:
        directory = directory or Path(tempfile.mkdtemp(prefix="bench-cache-reuse-cuda-check-"))
    path = write_result("cache_reuse_epoch_time_cuda", payload, directory)
    print(f"gpu: {gpu}\ntargets: {targets}\nwrote {path}")
    return path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The GPU run's own options (beside bench_cache_reuse's --samples, --epochs, --bits, --cuts)."""
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128],
                    help="--device cuda: batch sizes measured (issue 22: 32 and 128)")
    ap.add_argument("--compile", action="store_true",
                    help="--device cuda: also time the compute limit with the top under torch.compile")
    ap.add_argument("--quick", action="store_true",
                    help="a short check of the code path (few samples, one cut and batch); written to a "
                    "temporary folder")


def quick(args: argparse.Namespace) -> None:
    """Shrink a run to a check of the code path."""
    args.samples, args.epochs, args.cuts, args.batches = 64, 2, [1], [32]
