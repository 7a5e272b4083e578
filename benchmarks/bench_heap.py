"""What keeping freed memory in the heap (``ONDEVICE_TL_KEEP_HEAP=1``, ``pipeline/heap.py``) buys.

MobileNetV2 at 224x224, batch 32, 2 torch threads, random weights: seconds and minor page
faults per batch of (1) the frozen forward of the bottom that Cache & Reuse runs once (the
first 18 of 19 blocks, no grad) and (2) a training step of the last 7 blocks (forward +
backward + AdamW) on their input features. glibc's defaults against ``keep_freed_heap()``;
each measurement in a fresh subprocess (the setting is process-wide and cannot be undone),
the two settings alternating in ``--repeats`` pairs, ratio of each pair, median reported:
this host's speed swings between time windows, a pair taken back to back cancels most of it.
Also the peak resident size (the price: the heap never shrinks back).

Usage: python -m benchmarks.bench_heap [--batches 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks._meta import write_result

SETTINGS = ("glibc_default", "keep_freed_heap")

# Runs in the subprocess: prints one JSON line.
PROBE = r"""
import json, resource, sys, time
from pipeline.heap import keep_freed_heap
applied = keep_freed_heap() if sys.argv[1] == "keep_freed_heap" else False
import torch
from pipeline.models.zoo import build_backbone, split_at
torch.set_num_threads(2)
torch.manual_seed(0)
batches = int(sys.argv[2])

def per_batch(step, x):
    step(x)  # warm-up
    faults0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for _ in range(batches):
        step(x)
    seconds = (time.perf_counter() - t0) / batches
    return seconds, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / batches

net = build_backbone("mobilenet_v2", 10)
bottom, _ = split_at(net, 1)
bottom.eval()
x = torch.randn(32, 3, 224, 224)
def forward(x):
    with torch.inference_mode():
        bottom(x)
fwd_s, fwd_faults = per_batch(forward, x)

low, top = split_at(build_backbone("mobilenet_v2", 10), 7)
with torch.no_grad():  # not inference_mode: the features are saved for the top's backward
    feats = low.eval()(x)
labels = torch.randint(0, 10, (32,))
opt = torch.optim.AdamW(top.parameters(), lr=1e-3)
loss_fn = torch.nn.CrossEntropyLoss()
top.train()
def train_step(f):
    opt.zero_grad(set_to_none=True)
    loss_fn(top(f), labels).backward()
    opt.step()
step_s, step_faults = per_batch(train_step, feats)
print(json.dumps({
    "applied": applied, "forward_s": fwd_s, "forward_faults": fwd_faults,
    "train_step_s": step_s, "train_step_faults": step_faults,
    "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def probe(setting: str, batches: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, setting, str(batches)],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode != 0:
        raise SystemExit(f"bench_heap: the {setting} probe failed (exit {out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--batches", type=int, default=6, help="timed batches per measurement (after one warm-up)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="alternating pairs (default, keep heap)")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(args.repeats):
        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:  # alternate who goes first
            runs[setting].append(probe(setting, args.batches))
            print(setting, json.dumps(runs[setting][-1]), flush=True)
    if not all(run["applied"] for run in runs["keep_freed_heap"]):
        raise SystemExit("keep_freed_heap() could not be applied here (needs Linux with glibc)")
    rows = []
    for setting in SETTINGS:
        row: dict = {"setting": setting}
        for key in ("forward_s", "forward_faults", "train_step_s", "train_step_faults", "max_rss_mib"):
            row[key] = statistics.median(run[key] for run in runs[setting])
        rows.append(row)
    speedup = {
        key: statistics.median(
            a[key] / b[key] for a, b in zip(runs["glibc_default"], runs["keep_freed_heap"], strict=True)
        )
        for key in ("forward_s", "train_step_s")
    }
    summary = {
        "frozen_forward_speedup_paired_median": speedup["forward_s"],
        "train_step_speedup_paired_median": speedup["train_step_s"],
        "peak_rss_ratio": rows[1]["max_rss_mib"] / rows[0]["max_rss_mib"],
    }
    path = write_result(
        "heap",
        {
            "question": "seconds and page faults per batch with glibc's malloc defaults vs keep_freed_heap()",
            "command": f"python -m benchmarks.bench_heap --batches {args.batches} --repeats {args.repeats}",
            "settings": {
                **vars(args),
                "model": "mobilenet_v2, random weights, 224x224, batch 32, 2 torch threads",
                "frozen_forward": "first 18 of 19 blocks (train_last_blocks 1), inference mode",
                "train_step": "last 7 blocks + classifier, forward + backward + AdamW step",
                "statistic": "median over repeats; speedups are the median of paired ratios",
            },
            "rows": rows,
            "runs": runs,
            "summary": summary,
        },
    )
    print(json.dumps(summary), f"\nwrote {path}")


if __name__ == "__main__":
    main()
