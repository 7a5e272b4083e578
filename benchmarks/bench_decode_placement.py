"""Where the decode stage decodes JPEGs during a cache build: on its prefetch thread, or between batches.

The decode stage's ``cpu_work`` setting places pixel decoding either on the background
thread that reads the files (``background``: concurrent with the frozen forward) or on a
pool of torch's thread count, run when the forward asks for the next batch
(``between_steps``: the default on a CPU device). On a CPU whose cores the forward fills,
a concurrent decoder preempts one of torch's OpenMP workers and the others wait for it at
the next barrier; decoding between batches costs its own CPU time spread over the cores
instead. This measures both against the bare frozen forward on already-decoded tensors.

Same setting as ``bench_cache_reuse`` (MobileNetV2 at 224x224, random weights, JPEG files
written once, 2-bit cache, batch 32, 2 torch threads). In each round the three
measurements run in a shuffled order: a bare-forward pass and one fresh build (new store)
per placement. Reported per placement: build seconds, the frozen forward's own seconds
inside the build (the ``frozen_forward`` stage's time), the decode stage's seconds, and
the median over rounds of build images/s over the same round's bare-forward images/s.

Usage: python -m benchmarks.bench_decode_placement [--cut 4] [--samples 256] [--rounds 8]
(prefix ``ONDEVICE_TL_KEEP_HEAP=0`` to measure with glibc's malloc defaults; it writes its own JSON)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from benchmarks._meta import write_result
from benchmarks.bench_cache_reuse import bare_forward, decoded_batches, num_images, recipe, write_image_folder
from pipeline.context import RunContext
from pipeline.models.fold import fold_batch_norms
from pipeline.models.zoo import split_at
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from pipeline.switches import KEEP_HEAP, apply_process_settings
from stores.catalog import Catalog

PLACEMENTS = ("background", "between_steps")


def build_once(spec: dict, placement: str) -> dict[str, float]:
    """One fresh build of the cache with the decode stage's work placed as asked; stage seconds."""
    spec["stages"]["images"]["cpu_work"] = placement
    with tempfile.TemporaryDirectory() as store:
        ctx = RunContext(catalog=Catalog(Path(store)), seed=0, recipe_name="bench-decode-placement")
        reports = {r.name: r for r in Runner(recipe_from_dict(spec), ctx).run()}
    assert reports["cache"].status == "computed"
    return {
        "build_s": reports["cache"].seconds,
        "forward_s": reports["features"].seconds,
        "decode_s": reports["images"].seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cut", type=int, default=4, help="train_last_blocks: the frozen bottom is the rest")
    ap.add_argument("--samples", type=int, default=256, help="training samples (80%% of the images)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of (bare forward, one build per placement)")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    kept = apply_process_settings()[KEEP_HEAP]  # as the CLI sets up a run
    rng = random.Random(0)
    runs: dict[str, list] = {"bare_forward_s": [], **{p: [] for p in PLACEMENTS}}
    with tempfile.TemporaryDirectory() as tmp:
        images = Path(tmp) / "images"
        write_image_folder(images, num_images(args.samples))
        spec = recipe(args.samples, args.cut, 2, 1, args.batch, images)
        spec["targets"] = ["cache"]
        with tempfile.TemporaryDirectory() as store:
            ctx = RunContext(catalog=Catalog(Path(store)), seed=0, recipe_name="bench-decode-placement")
            runner = Runner(recipe_from_dict(spec), ctx)
            batches = decoded_batches(runner)
            # as the frozen forward runs it: frozen, batch norms folded
            frozen, _ = split_at(runner.output("model").build(), args.cut)
            bottom = fold_batch_norms(frozen.requires_grad_(False))
        total = sum(len(x) for x in batches)
        for r in range(args.rounds):
            order = ["bare", *PLACEMENTS]
            rng.shuffle(order)
            for what in order:
                if what == "bare":
                    runs["bare_forward_s"].append(total / bare_forward(bottom, batches))
                else:
                    runs[what].append(build_once(spec, what))
            print(f"round {r}: bare {runs['bare_forward_s'][-1]:.2f}s "
                  + " ".join(f"{p} {runs[p][-1]['build_s']:.2f}s" for p in PLACEMENTS), flush=True)
    rows = []
    for placement in PLACEMENTS:
        ratios = [b / m["build_s"] for b, m in zip(runs["bare_forward_s"], runs[placement], strict=True)]
        fwd = [b / m["forward_s"] for b, m in zip(runs["bare_forward_s"], runs[placement], strict=True)]
        rows.append({
            "cpu_work": placement,
            "build_s_median": statistics.median(m["build_s"] for m in runs[placement]),
            "forward_in_build_s_median": statistics.median(m["forward_s"] for m in runs[placement]),
            "decode_stage_s_median": statistics.median(m["decode_s"] for m in runs[placement]),
            "build_over_bare_forward_median": statistics.median(ratios),
            "bare_over_forward_in_build_median": statistics.median(fwd),
        })
    name = "decode_placement" if kept else "decode_placement_malloc_defaults"
    command = (f"python -m benchmarks.bench_decode_placement --cut {args.cut} --samples {args.samples} "
               f"--rounds {args.rounds} --batch {args.batch}")
    path = write_result(
        name,
        {
            "question": "cache build throughput over the bare frozen forward's, decoding on the prefetch "
            "thread vs between batches on all cores",
            "command": ("" if kept else "ONDEVICE_TL_KEEP_HEAP=0 ") + command,
            "settings": {
                **vars(args),
                "images": num_images(args.samples),
                "model": "mobilenet_v2, random weights, 224x224 JPEG (quality 90), 2-bit cache, "
                "2 torch threads",
                "malloc": (
                    "keep_freed_heap (the default)" if kept else "glibc defaults (ONDEVICE_TL_KEEP_HEAP=0)"
                ),
                "statistic": "medians over rounds; ratios are per round (bare forward of that round)",
            },
            "rows": rows,
            "runs": runs,
        },
    )
    for row in rows:
        print(json.dumps(row))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
