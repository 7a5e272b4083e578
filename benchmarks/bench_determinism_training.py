"""What thread-invariant training costs, and whether it holds beside busy processes.

    python -m benchmarks.bench_determinism_training [--repeats 2] [--quick]

Runs the quickstart end to end (``python -m pipeline run recipes/quickstart.yaml``, a fresh store and
output directory every time, so the backbone, the cache and both transfers are computed each run):

- ``quiet``: ``run.deterministic: true`` (the default: micro-batches, pipeline/methods/microbatch.py)
  against ``false`` (intra-op threads, the loop before), both at ``run.threads: auto``, alternating;
  the bar: the deterministic run within 5% of the other.
- ``busy2``: the same beside two busy processes (each a one-thread PyTorch training loop, as in
  benchmarks/bench_contention.py), plus the deterministic run at a fixed single thread (the speed
  issue's reference: ``auto`` should not cost more than one thread beside two busy processes).

And whether the bytes hold: the sha256 of every content file of every stored entry (manifest, last-use
stamp and ``build.json``, the build's times, aside) and of the run's model files, for every run;
all deterministic runs, quiet or busy, must agree.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._meta import write_result
from benchmarks.bench_contention import QUICK_SETS, start_busy, stop_busy

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/quickstart.yaml"
SUMMARY = re.compile(r" in ([0-9.]+)s;")
BOOKKEEPING = {"manifest.json", ".last_used", "build.json"}


def content_digest(store: Path, out: Path) -> str:
    """One digest over every entry's content files and the run's model files."""
    h = hashlib.sha256()
    files = [f for f in sorted((store / "entries").rglob("*")) if f.is_file() and f.name not in BOOKKEEPING]
    files += sorted(out.rglob("*.pt"))
    for f in files:
        h.update(f.name.encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def run(deterministic: bool, threads: str, quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-det-") as tmp:
        store, out = Path(tmp) / "store", Path(tmp) / "out"
        cmd = [sys.executable, "-m", "pipeline", "run", RECIPE, "--store", str(store), "--output", str(out),
               "--set", f"run.threads={threads}", "--set", f"run.deterministic={str(deterministic).lower()}"]
        for s in QUICK_SETS if quick else ():
            cmd += ["--set", s]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"quickstart failed ({done.returncode}):\n{done.stderr[-3000:]}")
        digest = content_digest(store, out)
    summary = done.stdout.strip().splitlines()[-1]
    match = SUMMARY.search(summary)
    return {"deterministic": deterministic, "threads": threads, "wall_s": round(wall, 3),
            "run_s": float(match.group(1)) if match else None, "digest": digest, "summary_line": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="two epochs per training, one round, JSON to a temp dir")
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    plans = {"quiet": [(True, "auto"), (False, "auto")],
             "busy2": [(True, "auto"), (False, "auto"), (True, "1")]}
    rows: list[dict[str, Any]] = []
    for round_ in range(repeats):
        for condition, settings in plans.items():
            order = settings if round_ % 2 == 0 else list(reversed(settings))
            busy = start_busy("torch1", 2) if condition == "busy2" else []
            try:
                for deterministic, threads in order:
                    row = run(deterministic, threads, args.quick)
                    rows.append({"condition": condition, "round": round_, **row})
                    print(f"{condition} deterministic={deterministic} threads={threads}: "
                          f"{row['wall_s']:.1f}s {row['digest'][:12]}", flush=True)
            finally:
                stop_busy(busy)

    def median(condition: str, deterministic: bool, threads: str) -> float:
        return statistics.median(r["wall_s"] for r in rows if r["condition"] == condition
                                 and r["deterministic"] == deterministic and r["threads"] == threads)

    quiet_ratio = median("quiet", True, "auto") / median("quiet", False, "auto")
    busy_ratio = median("busy2", True, "auto") / median("busy2", False, "auto")
    busy_vs_one = median("busy2", True, "auto") / median("busy2", True, "1")
    det_digests = {r["digest"] for r in rows if r["deterministic"]}
    fast_digests = {r["digest"] for r in rows if not r["deterministic"]}
    payload: dict[str, Any] = {
        "headline": (f"deterministic quickstart {quiet_ratio:.3f}x the thread-dependent one quiet, "
                     f"{busy_ratio:.3f}x beside two busy processes (auto {busy_vs_one:.2f}x a fixed single "
                     f"thread there); {len(det_digests)} distinct content digest(s) over "
                     f"{sum(r['deterministic'] for r in rows)} deterministic runs, {len(fast_digests)} over "
                     f"{sum(not r['deterministic'] for r in rows)} thread-dependent ones"),
        "question": "does run.deterministic keep the quickstart's bytes fixed, quiet or busy, and at what "
                    "cost?",
        "settings": {"recipe": RECIPE, "repeats": repeats, "quick": args.quick, "busy": "2 x torch1",
                     "timing": "wall time of the whole subprocess, fresh store each run; medians"},
        "runs": rows,
        "quiet_ratio": quiet_ratio,
        "busy2_ratio": busy_ratio,
        "busy2_auto_vs_single_thread": busy_vs_one,
        "deterministic_digests": sorted(det_digests),
        "thread_dependent_digests": sorted(fast_digests),
        "targets": {"quiet_within_5pct": quiet_ratio <= 1.05,
                    "one_content_quiet_and_busy": len(det_digests) == 1,
                    "auto_not_slower_than_one_thread_busy2": busy_vs_one <= 1.0},
    }
    directory = Path(tempfile.gettempdir()) if args.quick else None
    path = write_result("determinism_training_quick" if args.quick else "determinism_training", payload,
                        directory=directory)
    print(payload["headline"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
