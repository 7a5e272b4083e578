"""Cache & Reuse on vision transformers: accuracy of 2/4/8-bit caches against the float cache (issue 24).

Runs recipes/cache_reuse/fashion_mnist_swin.yaml (torchvision's swin_t pretrained from scratch on
Fashion-MNIST classes 0-4, transferred to classes 5-9 with 100 images per class) through the real
pipeline and store, once per seed: the backbone and the caches are built by the first seed and
reused by the others (only the trainers' and feature augmentation's seeds change). Reports test
accuracy per cache (mean and spread over seeds), each cache's stored bytes, steady epoch time, and
the memory meter's numbers for the trained top (analytic and measured saved activations, weights,
gradients, optimizer state).

vit_b_16 (86M parameters) is timed as well, on the same machine in the same run (one full training
step, one frozen forward, one training step of a one-block top, batch ``--vit-batch`` at 32 px), and
the time the same task would take is extrapolated from those numbers, so the JSON says with
measurements what running it costs; ``--arch vit_b_16 --resolution 32`` runs the recipe on it
(written to its own JSON).

Usage: python -m benchmarks.bench_transformer_cache [--seeds 0 1] [--store DIR] [--set KEY=VALUE ...]
       [--arch vit_b_16 --resolution 32] [--skip-vit] [--quick]  (--quick: minutes, written under /tmp)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks._meta import write_result
from pipeline.context import RunContext
from pipeline.models.zoo import build_backbone, feature_shape, split_at
from pipeline.progress import Progress
from pipeline.recipe import load_recipe
from pipeline.runner import Runner
from stores.catalog import Catalog

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cache_reuse" / "fashion_mnist_swin.yaml"
ROWS = ["no_compression", "bits_8", "bits_4", "bits_2"]
SEEDED = [*ROWS, "float_aug", "aug8", "aug4", "aug2"]
MEMORY_KEYS = ("memory_activation_bytes", "memory_activation_bytes_measured", "memory_parameter_bytes",
               "memory_gradient_bytes", "memory_optimizer_bytes", "memory_total_bytes", "flops_forward",
               "flops_backward", "trainable_parameters")
QUICK = [  # the code path in minutes
    "stages.source.per_class=8", "stages.target.per_class=6", "stages.source.val_fraction=0.001",
    "stages.target.val_fraction=0.001", "stages.target.test_fraction=0.002", "stages.backbone.train.epochs=1",
    *[f"stages.{name}.train.epochs=1" for name in ROWS],
]


def run_seed(seed: int, store: Path, extra: list[str]) -> tuple[dict[str, dict], dict[str, dict], float]:
    overrides = [f"stages.{name}.seed={seed}" for name in SEEDED] + extra
    recipe = load_recipe(RECIPE, overrides)
    threads = recipe.run.threads
    torch.set_num_threads(threads if isinstance(threads, int) else torch.get_num_threads())
    ctx = RunContext(catalog=Catalog(store), seed=recipe.seed, recipe_name=recipe.name,
                     progress=Progress(quiet=False))
    start = time.perf_counter()
    reports = {r.name: r for r in Runner(recipe, ctx).run()}
    stages = {name: {"status": r.status, "seconds": r.seconds} for name, r in reports.items()}
    return {name: reports[name].metrics for name in ROWS}, stages, time.perf_counter() - start


def _rate(step: Callable[[], object], samples: int, repeats: int = 2) -> float:
    """Samples per second of ``step()``: the faster of ``repeats`` timed calls after one warm-up."""
    step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return samples / best


def _train_step(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One AdamW training step of ``module`` on (``x``, ``y``), as a callable to time."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        opt.step()

    return step


def vit_feasibility(batch: int, resolution: int, source_images: int, target_images: int, pretrain_epochs: int,
                    transfer_epochs: int, rows: int) -> dict[str, object]:
    """Measured throughput of vit_b_16 here and the task's time extrapolated from it."""
    torch.manual_seed(0)
    net = build_backbone("vit_b_16", 5, resolution=resolution)
    x = torch.randn(batch, 3, resolution, resolution)
    y = torch.randint(0, 5, (batch,))
    net.train()
    full = _rate(_train_step(net, x, y), batch)
    net.eval()
    with torch.no_grad():
        forward = _rate(lambda: net(x), batch)
    bottom, top = split_at(net, 1)
    with torch.no_grad():
        features = bottom(x)
    top.train()
    top_rate = _rate(_train_step(top, features, y), batch)
    pretrain_s = source_images * pretrain_epochs / full
    forward_s = target_images / forward
    transfer_s = rows * 500 * transfer_epochs / top_rate
    return {
        "resolution": resolution, "batch": batch, "parameters": sum(p.numel() for p in net.parameters()),
        "feature_shape_at_cut_1": list(feature_shape(net, 1, resolution)),
        "full_train_images_per_s": full, "frozen_forward_images_per_s": forward,
        "top_1_block_train_images_per_s": top_rate,
        "extrapolated_seconds": {"pretrain": pretrain_s, "frozen_forward": forward_s,
                                 "transfer_rows": transfer_s, "total": pretrain_s + forward_s + transfer_s},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--store", help="store directory (default: a temporary one)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--skip-vit", action="store_true", help="leave out the vit_b_16 timing")
    ap.add_argument("--arch", default="swin_t", help="the recipe's backbone (vit_b_16: at --resolution, a "
                    "multiple of 16); other than swin_t, written to "
                    "transformer_cache_fashion_mnist_<arch>.json")
    ap.add_argument("--resolution", type=int, default=None, help="input size of the backbone and the images")
    ap.add_argument("--vit-batch", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="one seed, tiny data, one epoch: checks the path")
    ap.add_argument("--output-dir", type=Path, help="write the result here instead of benchmarks/results")
    args = ap.parse_args()
    if args.quick:
        args.seeds = args.seeds[:1]
        args.output_dir = args.output_dir or Path(tempfile.gettempdir()) / "bench-quick"
    extra = [*(QUICK if args.quick else [])]
    if args.arch != "swin_t":
        extra.append(f"stages.backbone.arch={args.arch}")
    if args.resolution is not None:
        extra += [f"stages.{s}.resolution={args.resolution}" for s in ("backbone", "target_images")]
    extra += args.overrides
    tmp = None
    if args.store:
        store = Path(args.store)
        store.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="transformer-cache-")
        store = Path(tmp.name)
    started = time.perf_counter()
    per_seed = []
    for seed in args.seeds:
        metrics, stages, seconds = run_seed(seed, store, extra)
        per_seed.append({"seed": seed, "seconds": seconds, "stages": stages, "metrics": metrics})
        print(f"seed {seed}: " + "  ".join(f"{r} {metrics[r]['accuracy']:.4f}" for r in ROWS)
              + f"  ({seconds:.0f}s)")
    rows = []
    for name in ROWS:
        accs = [s["metrics"][name]["accuracy"] for s in per_seed]
        first = per_seed[0]["metrics"][name]
        rows.append({
            "row": name, "bits": first["bits"], "accuracy_mean": statistics.fmean(accs),
            "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0, "accuracies": accs,
            "epoch_seconds_steady": statistics.fmean(
                s["metrics"][name]["epoch_seconds_steady"] for s in per_seed),
            "cache_bytes": first["cache_bytes"], "test_samples": first["test_samples"],
        })
    by = {r["row"]: r for r in rows}
    base = by["no_compression"]["accuracy_mean"]
    for r in rows:
        r["accuracy_minus_float"] = r["accuracy_mean"] - base
    first = per_seed[0]["metrics"]["no_compression"]
    memory = {k: first.get(k) for k in MEMORY_KEYS}
    print(f"{'row':<16}{'bits':>5}{'accuracy':>18}{'vs float':>10}{'s/epoch':>9}{'cache':>12}")
    for r in rows:
        print(f"{r['row']:<16}{r['bits']:>5}{r['accuracy_mean']:>10.4f} ± {r['accuracy_std']:.4f}"
              f"{r['accuracy_minus_float']:>+10.4f}{r['epoch_seconds_steady']:>9.2f}"
              f"{r['cache_bytes'] / 1024:>10.1f}Ki")
    print(f"memory of the trained top (batch 32): {memory}")
    vit = None
    if not args.skip_vit:
        source = 5 * (8 if args.quick else 100)
        vit = vit_feasibility(args.vit_batch, 32, source_images=source, target_images=500 + 60 + 300,
                              pretrain_epochs=1, transfer_epochs=2, rows=len(ROWS))
        print(f"vit_b_16: {vit}")
    name = "transformer_cache_fashion_mnist" + ("" if args.arch == "swin_t" else f"_{args.arch}")
    path = write_result(name, {
        "question": "test accuracy of Cache & Reuse from 2/4/8-bit caches against the float (32-bit) "
                    "cache on a vision transformer (swin_t), Fashion-MNIST transfer task; vit_b_16 "
                    "feasibility here",
        "settings": {
            "recipe": str(RECIPE.relative_to(RECIPE.parents[2])), "arch": args.arch, "seeds": args.seeds,
            "overrides": extra,
            "quick": args.quick, "torch_threads": torch.get_num_threads(),
            "task": f"{args.arch} from scratch at {args.resolution or 64} px on classes 0-4 (100/class, 1 "
                    "epoch), transfer to 5-9 with 100 train images/class, top = the last block + head, "
                    "test: 1% of each class's training images (300), 2 epochs per row",
        },
        "rows": rows,
        "top_memory": memory,
        "top_input_shape": first.get("top_input_shape"),
        "vit_b_16": vit,
        "per_seed": per_seed,
        "total_seconds": time.perf_counter() - started,
    }, directory=args.output_dir)
    print(f"wrote {path}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
