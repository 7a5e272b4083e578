"""What determinism costs: the frozen forward with its batches padded to a multiple of 16 (thread-invariant
bits) against the same forward unpadded, and the sha256 of an entry's files at commit and on use.

    python -m benchmarks.bench_determinism [--repeats 7]

On the quickstart's data and a backbone pretrained in a temporary store (the recipe's own, one epoch):
the frozen forward of every split (decode batch 64, so each split ends in a short batch), padded and
unpadded, alternating, min over repeats; and the time to hash the files a run checks when it uses the
stored backbone and a stored result. Both are paired in one process; the quickstart's whole run is the
reference the overhead is a fraction of (its time measured here too, once).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._meta import write_result
from pipeline.context import RunContext
from pipeline.ops import padded_forward as forward
from pipeline.recipe import load_recipe
from pipeline.runner import Runner
from stores.catalog import Catalog
from stores.manifest import read_entry
from stores.verify import damaged_files

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"


def forward_seconds(runner: Runner, block: int) -> float:
    stream = runner.output("features")
    saved = forward.FORWARD_BLOCK
    forward.FORWARD_BLOCK = block
    try:
        t0 = time.perf_counter()
        for split in stream.spec.splits:
            for _ in stream.open(split):
                pass
        return time.perf_counter() - t0
    finally:
        forward.FORWARD_BLOCK = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as store:
        overrides = [f"run.threads={args.threads}"]
        recipe = load_recipe(RECIPE, overrides)
        t0 = time.perf_counter()
        Runner(recipe, RunContext(catalog=Catalog(store), seed=0)).run()
        quickstart_s = time.perf_counter() - t0
        runner = Runner(recipe, RunContext(catalog=Catalog(store), seed=0))
        padded, plain = [], []
        for _ in range(args.repeats):
            plain.append(forward_seconds(runner, 1))
            padded.append(forward_seconds(runner, 16))
        checks = []
        for entry_dir in sorted((Path(store) / "entries").iterdir()):
            entry = read_entry(entry_dir, entry_dir.name)
            if entry is None or not entry.checksums:
                continue
            t1 = time.perf_counter()
            for _ in range(args.repeats):
                damaged_files(entry.path, entry.files, entry.checksums)
            checks.append({"kind": entry.kind, "files": len(entry.checksums),
                           "bytes": sum(entry.files[f] for f in entry.checksums),
                           "check_s": (time.perf_counter() - t1) / args.repeats})
    forward_overhead = min(padded) - min(plain)
    check_total = sum(c["check_s"] for c in checks)
    payload: dict[str, Any] = {
        "headline": f"padded frozen forward {min(padded) / min(plain):.3f}x the unpadded one "
        f"(+{1000 * forward_overhead:.1f} ms); checking every stored file on use "
        f"{1000 * check_total:.1f} ms; "
        f"together {100 * (forward_overhead + check_total) / quickstart_s:.2f}% of the quickstart's "
        f"{quickstart_s:.1f} s",
        "question": "how much do thread-invariant frozen forwards and checksummed entries cost?",
        "settings": {"recipe": "recipes/quickstart.yaml", "threads": args.threads, "repeats": args.repeats,
                     "timing": "min over repeats, padded and unpadded alternating in one process"},
        "forward_unpadded_s": min(plain),
        "forward_padded_s": min(padded),
        "forward_ratio": min(padded) / min(plain),
        "checksum_checks": checks,
        "quickstart_s": quickstart_s,
        "overhead_fraction_of_quickstart": (forward_overhead + check_total) / quickstart_s,
        "targets": {"quickstart_within_5pct": (forward_overhead + check_total) / quickstart_s <= 0.05},
    }
    path = write_result("determinism_cost", payload)
    print(payload["headline"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
