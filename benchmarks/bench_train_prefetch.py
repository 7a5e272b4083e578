"""Does preparing training batches on a background thread help? ``finetune``'s ``prefetch: N``.

With ``prefetch: 2`` a background thread reads, dequantizes and augments the next training
batches (two-stage) or decodes and resizes them (single-stage), running on into the next
epoch while one ends (``pipeline.ops.EpochPrefetch``); with ``prefetch: 0`` all of that runs
on the training thread between steps. On a CPU whose cores the training step already
fills, the background thread's torch ops start a second OpenMP team that contends with the
step's; this benchmark measures which effect wins.

MobileNetV2 at 224x224, random weights, the Cache & Reuse benchmark's recipe and data
(``bench_cache_reuse``: JPEG files read by ``image_folder``, 2-bit cache), batch 32.
Per setting: ``--pairs`` back-to-back pairs of runs, prefetch 0 and 2 alternating which goes
first; each run's statistic is the mean epoch time after the first epoch; the ratio
``prefetch 2 / prefetch 0`` of each pair and its median are reported (this host's speed
swings between time windows; a pair taken back to back cancels most of that).

Usage: python -m benchmarks.bench_train_prefetch [--samples 256] [--pairs 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks._meta import write_result
from benchmarks.bench_cache_reuse import num_images, recipe, write_image_folder
from pipeline.context import RunContext
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog

# (trained blocks, trainer, epochs per run): two-stage runs are short, so more epochs average more.
SETTINGS = ((1, "two_stage", 4), (7, "two_stage", 4), (4, "single_stage", 2))


def epoch_seconds(
    ctx: RunContext, images: Path, samples: int, n: int, mode: str, epochs: int, prefetch: int
) -> float:
    """Mean seconds of the epochs after the first, of one run of trainer ``mode`` with ``prefetch``."""
    r = recipe(samples, n, 2, epochs, 32, images)
    r["targets"] = [mode]
    r["stages"][mode]["prefetch"] = prefetch
    reports = {rep.name: rep for rep in Runner(recipe_from_dict(r), ctx).run()}
    return reports[mode].metrics["epoch_seconds_steady"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=256, help="training samples per epoch")
    ap.add_argument("--pairs", type=int, default=6, help="back-to-back (prefetch 0, prefetch 2) pairs")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-train-prefetch-") as tmp:
        images, store = Path(tmp) / "images", Path(tmp) / "store"
        images.mkdir()
        write_image_folder(images, num_images(args.samples))
        ctx = RunContext(catalog=Catalog(store), seed=0, recipe_name="bench-train-prefetch")
        for n, mode, epochs in SETTINGS:
            epoch_seconds(ctx, images, args.samples, n, mode, 2, 0)  # builds the cache; warms up
            off, on = [], []
            for i in range(args.pairs):
                order = (0, 2) if i % 2 == 0 else (2, 0)
                got = {p: epoch_seconds(ctx, images, args.samples, n, mode, epochs, p) for p in order}
                off.append(got[0])
                on.append(got[2])
                print(f"{mode} N={n}: prefetch 0 {got[0]:.3f}s  prefetch 2 {got[2]:.3f}s", flush=True)
            ratios = [b / a for a, b in zip(off, on, strict=True)]
            rows.append(
                {
                    "train_last_blocks": n,
                    "mode": mode,
                    "epochs_per_run": epochs,
                    "prefetch0_epoch_s": statistics.median(off),
                    "prefetch2_epoch_s": statistics.median(on),
                    "prefetch2_over_prefetch0_median": statistics.median(ratios),
                    "prefetch2_over_prefetch0_paired": ratios,
                    "prefetch0_epoch_s_all": off,
                    "prefetch2_epoch_s_all": on,
                }
            )
            median = rows[-1]["prefetch2_over_prefetch0_median"]
            print(f"{mode} N={n}: median prefetch2/prefetch0 {median:.3f}", flush=True)
    path = write_result(
        "train_prefetch",
        {
            "question": "finetune prefetch 2 (batches prepared on a background thread across epoch ends) "
            "vs 0 (on the training thread): epoch time on a 2-core CPU",
            "settings": {
                **vars(args),
                "arch": "mobilenet_v2",
                "resolution": 224,
                "bits": 2,
                "batch": 32,
                "torch_threads": torch.get_num_threads(),
                "statistic": "per run: mean epoch time after the first; per setting: medians over pairs",
            },
            "rows": rows,
            "findings": [
                f"{r['mode']} N={r['train_last_blocks']}: prefetch 2 / prefetch 0 = "
                f"{r['prefetch2_over_prefetch0_median']:.3f} (median of {args.pairs} pairs)"
                for r in rows
            ],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
