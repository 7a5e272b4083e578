"""The cache build against the loop a user would write by hand (issue: faster than the loop a user writes).

The anchor is what a careful PyTorch user writes to cache a frozen bottom's features without this
toolkit: ``torchvision.datasets.ImageFolder`` (PIL decode, ``Resize``, ``ToTensor``, ``Normalize``)
in a ``DataLoader(batch_size=32, num_workers=2)``, the bottom in ``eval()`` mode under
``torch.no_grad()``, and one ``torch.save`` file per batch (features and labels). The toolkit's build
is ``python -m pipeline run`` of a recipe whose target is the cache: the ``image_folder`` source,
``decode``, ``frozen_forward`` (batch norms folded), ``quantize``, the zarr cache, through
:func:`pipeline.run` exactly as the CLI runs it (thread policy, idle probe, run directory, lineage).

Both read the same JPEG files (MobileNetV2 at 224x224, the toolkit's synthetic images at JPEG quality
90, as ``bench_cache_reuse`` writes them), run the same bottom (the recipe's backbone: its weights are
saved once and the anchor loads them with ``torch.load``),
and write every image's features. The toolkit's build writes them quantized (``--bits``, 8 by default)
and, with ``--bits 32``, as float32 like the anchor.

Each pass runs in a fresh spawned process (no heap or file-cache state shared with the previous
pass beyond the page cache, which holds the JPEGs for both), timed from the first line of work to the
last byte written, including every one-off cost a user pays (indexing the folder, building the model,
starting the DataLoader's workers; the run's store commit). ``--repeats`` repeats, each an anchor
pass, the anchor with the toolkit's heap policy (freed memory kept: without it glibc returns and
re-faults the forward's large activation buffers on every batch, which alone makes the plain loop
several times slower on this machine) and a build pass, back to back, the order reversed every
other repeat; the bar is the median of the repeats' images/s ratios (build over anchor) at each cut,
and the ratio to the heap-policy anchor says how much of the gain is the rest of the pipeline.

Usage: python -m benchmarks.bench_build_vs_loop [--images 1024] [--cuts 1 4 7] [--repeats 5] [--bits 8]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks._meta import write_result
from benchmarks.bench_cache_reuse import JPEG_QUALITY, write_image_folder

BATCH = 32
RESOLUTION = 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the decode stage's defaults (ImageNet)


def build_recipe(images: Path, n: int, bits: int) -> dict:
    """The toolkit's build: every image decoded, through the bottom of cut ``n``, quantized, cached."""
    return {
        "name": f"bench-build-n{n}",
        "seed": 0,
        "stages": {
            "data": {"type": "image_folder", "root": str(images)},
            "model": {"type": "backbone", "arch": "mobilenet_v2", "num_classes": 10, "weights": "random"},
            "images": {"type": "decode", "input": "data", "resolution": RESOLUTION, "batch_size": BATCH},
            "features": {"type": "frozen_forward", "input": "images", "model": "model",
                         "train_last_blocks": n},
            "quantized": {"type": "quantize", "input": "features", "bits": bits},
            "cache": {"type": "cache", "input": "quantized"},
        },
        "targets": ["cache"],
    }


def toolkit_pass(images: str, n: int, bits: int) -> dict:
    """Seconds of one build into a fresh store, as ``python -m pipeline run`` does it."""
    import pipeline
    from pipeline.switches import apply_process_settings

    apply_process_settings()  # as the CLI does before its command
    with tempfile.TemporaryDirectory(prefix="bench-build-store-") as store:
        t0 = time.perf_counter()
        result = pipeline.run(build_recipe(Path(images), n, bits), store=Path(store) / "store",
                              output=Path(store) / "run", quiet=True)
        seconds = time.perf_counter() - t0
        stored = sum(f.stat().st_size for f in (Path(store) / "store").rglob("*") if f.is_file())
    if result.stages["cache"].status != "computed":
        raise RuntimeError(f"the build pass reused its cache ({result.stages['cache'].status}): not a build")
    return {"seconds": seconds, "stored_bytes": stored}


def recipe_weights(images: Path, n: int, bits: int, path: Path) -> None:
    """Save the recipe's backbone weights (as its build uses them) where the anchor loads them from."""
    import torch

    from pipeline.context import RunContext
    from pipeline.recipe import recipe_from_dict
    from pipeline.runner import Runner
    from stores.catalog import Catalog

    with tempfile.TemporaryDirectory() as store:
        runner = Runner(recipe_from_dict(build_recipe(images, n, bits)),
                        RunContext(catalog=Catalog(Path(store)), seed=0, recipe_name="weights"))
        torch.save(runner.output("model").build().state_dict(), path)


def anchor_pass(images: str, n: int, weights: str, keep_heap: bool = False) -> dict:
    """Seconds of the hand-written loop: DataLoader(ImageFolder, num_workers=2) + eval + no_grad + torch.save.

    ``keep_heap``: with the toolkit's heap policy applied first (pipeline/heap.py), the loop as a user
    who knew of it would run it.
    """
    import torch

    if keep_heap:
        from pipeline.switches import apply_process_settings

        apply_process_settings()
    import torchvision.transforms as T
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    from pipeline.models.zoo import build_backbone, split_at

    with tempfile.TemporaryDirectory(prefix="bench-build-anchor-") as out:
        t0 = time.perf_counter()
        net = build_backbone("mobilenet_v2", 10)
        net.load_state_dict(torch.load(weights, weights_only=True))
        bottom, _ = split_at(net, n)
        bottom.eval()
        dataset = ImageFolder(images, transform=T.Compose([
            T.Resize(RESOLUTION), T.ToTensor(), T.Normalize(MEAN, STD)]))
        loader = DataLoader(dataset, batch_size=BATCH, num_workers=2)
        with torch.no_grad():
            for i, (x, y) in enumerate(loader):
                torch.save({"features": bottom(x), "labels": y}, os.path.join(out, f"{i:05d}.pt"))
        seconds = time.perf_counter() - t0
        stored = sum(f.stat().st_size for f in Path(out).iterdir())
    return {"seconds": seconds, "stored_bytes": stored}


def isolated(fn, *args):  # type: ignore[no-untyped-def]
    """``fn(*args)`` in a fresh spawned process (its own heap, torch threads and imports)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def headline(rows: list[dict]) -> str:
    """One line for the results page: the bar's ratio per cut, and the stricter heap-policy one."""
    plain = ", ".join(f"cut {r['train_last_blocks']} {r['build_over_anchor_median']:.2f}x" for r in rows)
    heap = ", ".join(f"{r['build_over_anchor_keep_heap_median']:.2f}x" for r in rows)
    return (f"cache build vs a hand-written DataLoader(num_workers=2) + torch.save loop, images/s: {plain} "
            f"(bar 1.2x); vs the same loop with the toolkit's heap policy: {heap}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--cuts", type=int, nargs="+", default=[1, 4, 7])
    ap.add_argument("--repeats", type=int, default=5, help="paired (anchor, build) repeats per cut")
    ap.add_argument("--bits", type=int, default=8,
                    help="the build's quantization (32: float32, as the anchor's)")
    ap.add_argument("--results-dir", type=Path, default=None,
                    help="write the JSON here, not in benchmarks/results (a trial run must not replace one)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-build-images-") as tmp:
        images = Path(tmp) / "images"
        image_bytes = write_image_folder(images, args.images)
        weights = Path(tmp) / "weights.pt"
        recipe_weights(images, args.cuts[0], args.bits, weights)
        isolated(toolkit_pass, str(images), args.cuts[0], args.bits)  # warm the page cache, build the codec
        for n in args.cuts:
            ratios, heap_ratios, anchor_s, heap_s, build_s = [], [], [], [], []
            anchor_bytes = build_bytes = 0
            passes = {
                "anchor": lambda n=n: isolated(anchor_pass, str(images), n, str(weights)),
                "anchor_keep_heap": lambda n=n: isolated(anchor_pass, str(images), n, str(weights), True),
                "build": lambda n=n: isolated(toolkit_pass, str(images), n, args.bits),
            }
            for i in range(args.repeats):
                order = list(passes) if i % 2 == 0 else list(passes)[::-1]
                took = {side: passes[side]() for side in order}
                anchor_s.append(took["anchor"]["seconds"])
                heap_s.append(took["anchor_keep_heap"]["seconds"])
                build_s.append(took["build"]["seconds"])
                anchor_bytes, build_bytes = took["anchor"]["stored_bytes"], took["build"]["stored_bytes"]
                ratios.append(took["anchor"]["seconds"] / took["build"]["seconds"])
                heap_ratios.append(took["anchor_keep_heap"]["seconds"] / took["build"]["seconds"])
                print(f"cut {n} repeat {i}: anchor {anchor_s[-1]:.2f}s, anchor with the heap policy "
                      f"{heap_s[-1]:.2f}s, build {build_s[-1]:.2f}s -> {ratios[-1]:.2f}x, "
                      f"{heap_ratios[-1]:.2f}x", flush=True)
            rows.append({
                "train_last_blocks": n,
                "images": args.images,
                "anchor_seconds": anchor_s,
                "build_seconds": build_s,
                "anchor_images_per_s_median": args.images / statistics.median(anchor_s),
                "build_images_per_s_median": args.images / statistics.median(build_s),
                "build_over_anchor_paired": ratios,
                "build_over_anchor_median": statistics.median(ratios),
                "anchor_keep_heap_seconds": heap_s,
                "anchor_keep_heap_images_per_s_median": args.images / statistics.median(heap_s),
                "build_over_anchor_keep_heap_paired": heap_ratios,
                "build_over_anchor_keep_heap_median": statistics.median(heap_ratios),
                "anchor_stored_bytes": anchor_bytes,
                "build_stored_bytes": build_bytes,
            })
            print(f"cut {n}: build/anchor images/s, median of repeats {statistics.median(ratios):.2f}x "
                  f"(anchor with the heap policy: {statistics.median(heap_ratios):.2f}x)", flush=True)
    path = write_result("build_vs_loop", {
        "question": "images/s of the toolkit's cache build vs a hand-written DataLoader + eval + no_grad + "
                    "torch.save loop over the same JPEGs and the same bottom",
        "command": "python -m benchmarks.bench_build_vs_loop " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k != "results_dir"),
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "results_dir"},
            "arch": "mobilenet_v2", "resolution": RESOLUTION, "batch": BATCH, "weights": "random init",
            "data": f"{args.images} synthetic 224x224 images (10 classes) as JPEG quality {JPEG_QUALITY} "
                    f"({image_bytes / args.images / 1024:.1f} KiB/image)",
            "anchor": "ImageFolder(Resize(224), ToTensor, Normalize) -> DataLoader(batch 32, "
                      "num_workers=2) -> bottom.eval(), torch.no_grad() -> torch.save per batch",
            "build": "pipeline.run of image_folder -> decode -> frozen_forward -> quantize -> cache "
                     "(a fresh store each pass)",
            "anchor_keep_heap": "the same loop after the toolkit's heap policy (pipeline/heap.py: freed "
                                "memory kept, not returned to the OS), to separate that policy's share",
            "timing": "each pass in a fresh spawned process, from its first line of work to its last write; "
                      "each repeat runs the three passes back to back, in reverse order every other "
                      "repeat; bar on the median ratio",
        },
        "rows": rows,
        "headline": headline(rows),
        "targets": {"build_at_least_1_2x_the_hand_written_loop": all(
            r["build_over_anchor_median"] >= 1.2 for r in rows)},
    }, args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
