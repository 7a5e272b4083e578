"""How long torch's idle OpenMP workers spin (libgomp's ``GOMP_SPINCOUNT``) against the work beside them.

After each parallel op, libgomp's worker threads spin-wait for the next one instead of
sleeping: 300,000 iterations by default, which on CPUs with a slow ``pause`` instruction
is several milliseconds of a core. That is free when torch's ops follow each other, and
a loss whenever anything else in the process needs that core right after an op: JPEG
decoding between frozen-forward batches, the reader threads of a training epoch. This
measures both sides, to decide how the toolkit should treat the spin: shortening it for the
whole process (``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``, which a user can set before starting
Python) against releasing the workers only where other work follows (``release_idle_workers``
before decoding, what the decode stage does; ``pipeline/openmp.py``).

MobileNetV2 at 224x224, batch 32, 2 torch threads, random weights. Per batch:
- ``forward_s``: the frozen bottom (train_last_blocks 4) alone;
- ``decode_after_forward_s``: decoding the next 32 JPEGs on 2 threads right after a forward
  batch (how the decode stage works on a CPU device, ``cpu_work: between_steps``), with the
  idle workers released first in the ``released`` setting only;
- ``decode_idle_s``: the same decoding with no forward before it (the floor);
- ``train_step_s``: forward + backward + AdamW of the last 7 blocks.
Each setting runs in a fresh subprocess (libgomp reads it when torch loads), settings
alternating in ``--repeats`` rounds; medians, and each ratio against libgomp's default
is the median of the per-round ratios (this host's speed swings between time windows).

Usage: python -m benchmarks.bench_openmp_spin [--batches 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._meta import write_result
from benchmarks.bench_cache_reuse import write_image_folder

# setting name -> environment it runs with (everything else about OpenMP unset)
SETTINGS = {
    "libgomp_default": {"GOMP_SPINCOUNT": "300000", "ONDEVICE_TL_OMP_PAUSE": "0"},
    "released": {"GOMP_SPINCOUNT": "300000", "ONDEVICE_TL_OMP_PAUSE": "1"},
    "spincount_100000": {"GOMP_SPINCOUNT": "100000", "ONDEVICE_TL_OMP_PAUSE": "0"},
    "spincount_30000": {"GOMP_SPINCOUNT": "30000", "ONDEVICE_TL_OMP_PAUSE": "0"},
    "spincount_10000": {"GOMP_SPINCOUNT": "10000", "ONDEVICE_TL_OMP_PAUSE": "0"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "ONDEVICE_TL_OMP_PAUSE": "0"},
}
KEYS = ("forward_s", "decode_after_forward_s", "decode_idle_s", "train_step_s")

# Runs in the subprocess: prints one JSON line.
PROBE = r"""
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import numpy as np
from pipeline.heap import keep_freed_heap, keep_freed_heap_requested
kept = keep_freed_heap_requested() and keep_freed_heap()  # as the CLI sets up a run
import torch
from pipeline.data.image_folder import decode_image
from pipeline.models.zoo import build_backbone, split_at
from pipeline.openmp import release_idle_workers  # does nothing with ONDEVICE_TL_OMP_PAUSE=0
torch.set_num_threads(2)
torch.manual_seed(0)
batches, images = int(sys.argv[1]), Path(sys.argv[2])
files = sorted(images.rglob("*.jpg"))
raw = [(p, p.read_bytes()) for p in files]
pool = ThreadPoolExecutor(2)

def decode(start):
    part = raw[start:start + 32]
    halves = [pool.submit(lambda r: np.stack([decode_image(p, d) for p, d in r]), h)
              for h in (part[:16], part[16:])]
    return np.concatenate([h.result() for h in halves])

bottom, _ = split_at(build_backbone("mobilenet_v2", 10), 4)
bottom.eval()
x = torch.randn(32, 3, 224, 224)
fwd = dec = 0.0
with torch.inference_mode():
    bottom(x)
    decode(0)
    for b in range(batches):
        t0 = time.perf_counter()
        bottom(x)
        t1 = time.perf_counter()
        release_idle_workers()  # timed with the decoding it is for; the forward pays the restart
        decode((32 * b) % (len(raw) - 31))
        fwd, dec = fwd + t1 - t0, dec + time.perf_counter() - t1
time.sleep(0.2)  # let the workers stop spinning: the floor is decoding on idle cores
t0 = time.perf_counter()
for b in range(batches):
    decode((32 * b) % (len(raw) - 31))
idle = time.perf_counter() - t0

low, top = split_at(build_backbone("mobilenet_v2", 10), 7)
with torch.no_grad():
    feats = low.eval()(x)
labels = torch.randint(0, 10, (32,))
opt = torch.optim.AdamW(top.parameters(), lr=1e-3)
loss_fn = torch.nn.CrossEntropyLoss()
top.train()
def step():
    opt.zero_grad(set_to_none=True)
    loss_fn(top(feats), labels).backward()
    opt.step()
step()
t0 = time.perf_counter()
for _ in range(batches):
    step()
train = time.perf_counter() - t0
print(json.dumps({"forward_s": fwd / batches, "decode_after_forward_s": dec / batches,
                  "decode_idle_s": idle / batches, "train_step_s": train / batches, "heap_kept": kept}))
"""


def probe(setting: str, batches: int, images: Path) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "ONDEVICE_TL_OMP_PAUSE")
    }
    env.update(SETTINGS[setting])
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(batches), str(images)], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise SystemExit(
            f"bench_openmp_spin: the {setting} probe failed (exit {out.returncode}):\n{out.stderr}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=8, help="timed batches per measurement (after a warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds, each running every setting once")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        write_image_folder(Path(tmp), 32 * args.batches + 32)
        for r in range(args.repeats):
            order = list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]  # alternate who goes first
            for setting in order:
                runs[setting].append(probe(setting, args.batches, Path(tmp)))
                print(setting, json.dumps(runs[setting][-1]), flush=True)
    base = runs["libgomp_default"]
    rows = []
    for setting, env in SETTINGS.items():
        row: dict = {"setting": setting, "env": env}
        for key in KEYS:
            row[key] = statistics.median(run[key] for run in runs[setting])
            row[f"{key}_vs_default"] = statistics.median(
                run[key] / b[key] for run, b in zip(runs[setting], base, strict=True)
            )
        rows.append(row)
    path = write_result(
        "openmp_spin",
        {
            "question": "per-batch seconds of torch compute and of decoding right after it, "
            "per OpenMP wait setting",
            "command": "python -m benchmarks.bench_openmp_spin "
            f"--batches {args.batches} --repeats {args.repeats}",
            "settings": {
                **vars(args),
                "model": "mobilenet_v2, random weights, 224x224, batch 32, 2 torch threads",
                "forward": "first 15 of 19 blocks (train_last_blocks 4), inference mode",
                "decode": "32 synthetic 224x224 JPEG files (quality 90) per batch, 2 threads, 16 each",
                "train_step": "last 7 blocks + classifier, forward + backward + AdamW step",
                "statistic": "median over repeats; *_vs_default: median of per-round ratios to "
                "libgomp_default",
                "malloc": "keep_freed_heap (the default)"
                if all(run["heap_kept"] for rs in runs.values() for run in rs)
                else "glibc defaults (ONDEVICE_TL_KEEP_HEAP=0)",
            },
            "rows": rows,
            "runs": runs,
        },
    )
    for row in rows:
        print(row["setting"], {k: round(row[f"{k}_vs_default"], 3) for k in KEYS})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
