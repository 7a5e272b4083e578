"""int8 vs fp32 frozen bottom on this CPU: forward speed on the same inputs, and cache-build throughput.

Part 1 (kernels): for each backbone, the bottom up to a cut is run in fp32 and as the
calibrated int8 module of ``pipeline.models.int8`` on the same input
batch in one process, alternately (fp32, int8, fp32, ...) so that load from other
processes hits both alike; the median of ``--repeats`` timed runs after two warm-up
runs is reported, with the relative L2 difference of the outputs.
Part 2 (pipeline): the same recipe (Fashion-MNIST target split -> decode ->
frozen_forward -> float cache) is built twice into a fresh store, with
``precision: fp32`` and ``precision: int8``; throughput is images / cache-build seconds
(decode included in both). Weights are random (speed does not depend on them).

Usage: python -m benchmarks.bench_int8_bottom [--repeats 5] [--batch 64] [--no-pipeline]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._meta import write_result
from pipeline.context import RunContext
from pipeline.models.fold import fold_batch_norms
from pipeline.models.int8 import int8_bottom, int8_support
from pipeline.models.zoo import build_backbone, split_at
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog

# (arch, build kwargs, train_last_blocks, resolution): the two recipes' settings at their selected cuts,
# MobileNetV2 for comparison with the figure, and ResNet-18 at the paper's 224x224.
# Both searches selected train_last_blocks 0 (everything below the classifier in int8).
CASES: list[tuple[str, dict[str, Any], int, int]] = [
    ("resnet18", {}, 0, 32),
    ("squeezenet1_1", {"small_input": True}, 0, 32),
    ("mobilenet_v2", {}, 7, 224),
    ("resnet18", {}, 0, 224),
]


def timed(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median seconds of ``a(x)`` and ``b(x)``, timed alternately so a load change hits both alike."""
    ta: list[float] = []
    tb: list[float] = []
    with torch.inference_mode():
        for _ in range(2):
            a(x), b(x)
        for _ in range(repeats):
            for module, times in ((a, ta), (b, tb)):
                t0 = time.perf_counter()
                module(x)
                times.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def kernels(repeats: int, batch: int) -> list[dict[str, Any]]:
    rows = []
    for arch, kwargs, tlb, res in CASES:
        torch.manual_seed(0)
        net = build_backbone(arch, 5, **kwargs).eval()
        bottom, _ = split_at(net, tlb)
        calibration = [torch.randn(batch, 3, res, res) for _ in range(4)]
        x = torch.randn(batch, 3, res, res)
        q, used = int8_bottom(bottom, calibration)
        fp32 = fold_batch_norms(bottom.requires_grad_(False))  # as precision: fp32 runs it (folded)
        fp32_s, int8_s = timed(fp32, q, x, repeats)
        with torch.inference_mode():
            ref, out = fp32(x), q(x)
        row = {"arch": arch, "resolution": res, "train_last_blocks": tlb, "batch": batch,
               "precision_used": used,
               "fp32_seconds": fp32_s, "int8_seconds": int8_s, "speedup": fp32_s / int8_s,
               "relative_l2_error": float((out - ref).norm() / ref.norm()), **kwargs}
        rows.append(row)
        print(f"{arch:<14}{res:>4}px tlb {tlb}: fp32 {fp32_s * 1000:8.1f} ms  int8 {int8_s * 1000:7.1f} ms  "
              f"x{row['speedup']:.2f}  rel.err {row['relative_l2_error']:.4f}")
    return rows


def cache_build(precision: str, store: Path) -> dict[str, Any]:
    stages = {
        "fmnist": {"type": "fashion_mnist"},
        "target": {"type": "split", "input": "fmnist", "classes": [5, 6, 7, 8, 9], "per_class": 100,
                   "val_fraction": 0.02},
        "backbone": {"type": "backbone", "arch": "resnet18", "num_classes": 5, "resolution": 32},
        "images": {"type": "decode", "input": "target", "resolution": 32, "batch_size": 128},
        "features": {"type": "frozen_forward", "input": "images", "model": "backbone", "train_last_blocks": 0,
                     "precision": precision},
        "float": {"type": "quantize", "input": "features", "bits": 32, "eval_bits": 32},
        "cache": {"type": "cache", "input": "float"},
    }
    recipe = recipe_from_dict({"name": f"int8_cache_{precision}", "stages": stages, "targets": ["cache"]})
    runner = Runner(recipe, RunContext(catalog=Catalog(store), recipe_name=recipe.name))
    reports = {r.name: r for r in runner.run()}
    spec = runner.specs["cache"]
    samples = sum(s.num_samples for s in spec.splits.values())
    seconds = reports["cache"].seconds
    forward = reports["features"].seconds
    return {"precision": precision, "samples": samples, "cache_build_seconds": seconds,
            "images_per_second": samples / seconds, "forward_seconds": forward,
            "forward_images_per_second": samples / forward if forward else None,
            "bottom_precision": runner.output("features").spec.meta["cut"]["precision"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-pipeline", action="store_true", help="skip the cache-build part")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine, reason = int8_support()
    print(f"int8 support: {reason}")
    rows = kernels(args.repeats, args.batch)
    builds = []
    if not args.no_pipeline:
        with tempfile.TemporaryDirectory(prefix="int8-cache-") as tmp:
            for precision in ("fp32", "int8"):
                builds.append(cache_build(precision, Path(tmp) / precision))
                b = builds[-1]
                print(f"cache build {precision}: {b['samples']} images in {b['cache_build_seconds']:.1f}s "
                      f"({b['images_per_second']:.0f} img/s; bottom forward {b['forward_seconds']:.1f}s)")
    payload: dict[str, Any] = {
        "question": "how much faster is the int8 frozen bottom than fp32 on this CPU, and the cache build "
                    "with it?",
        "settings": {"repeats": args.repeats, "batch": args.batch, "torch_threads": torch.get_num_threads(),
                     "int8_engine": engine, "int8_support": reason,
                     "method": "torch.ao.quantization FX static int8 (x86 backend), calibrated on 4 batches"},
        "kernels": rows,
        "cache_build": builds,
        "bar": {"speedup_at_least_3x": {f"{r['arch']}@{r['resolution']}": r["speedup"] >= 3 for r in rows}},
    }
    if len(builds) == 2:
        ratio = builds[1]["images_per_second"] / builds[0]["images_per_second"]
        payload["cache_build_throughput_ratio"] = ratio
        print(f"cache build throughput int8/fp32: x{payload['cache_build_throughput_ratio']:.2f}")
    print(f"wrote {write_result('int8_bottom', payload)}")


if __name__ == "__main__":
    main()
