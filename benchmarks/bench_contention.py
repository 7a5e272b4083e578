"""The quickstart beside other busy processes: ``run.threads: auto`` against fixed thread counts.

torch computes on an OpenMP pool whose threads meet at a barrier after every parallel region.
When another process takes a core, one of those threads is descheduled and the others wait for
it, so a run pinned to as many threads as there are cores can be several times slower than with
fewer. ``auto`` (pipeline/threads.py) starts from the cores the process may use and adapts the
count while training. This runs the quickstart end to end (``python -m pipeline run
recipes/quickstart.yaml``, a fresh store and output directory in a temp dir every time, so the
backbone, the cache and both transfers are computed every run) under three conditions:

- ``quiet``: nothing else started by this benchmark;
- ``busy1`` / ``busy2``: beside one / two busy processes, each a separate Python process running a
  plain PyTorch training loop (a conv layer's forward and backward, SGD) on one thread
  (``--busy torch1``, the default: a process that keeps one core busy), the same loop with torch's
  default thread count, one per core (``--busy torch``), or a pure-Python spin loop (``--busy spin``).
  Each busy process is started before the run (and has done a step) and stopped after it.

What "fair" means depends on the busy process. Linux's scheduler shares the cores between runnable
*threads*, not processes: beside a one-thread process, a one-thread run gets a whole core of the two;
beside ``--busy torch`` (two threads on two cores) it gets two thirds of one, and no thread count
gets it more than that without the barrier penalty above. The target (1.6x the quiet time) is for
one busy process that takes one core (``torch1``); ``torch`` is reported beside it.

Each condition runs every ``--settings`` value (``auto``, ``2``, ``1``: ``--set run.threads=...``)
once per round, in an order that rotates from round to round, conditions alternating too.
Reported: every run's wall time (the subprocess, Python start included) and the run's own
seconds (its summary line), the thread changes ``auto`` made (its ``threads: A -> B`` lines),
and each run's ratio to the median quiet time of ``auto`` and of its own setting.

Other work may share the machine while this runs (the result says so); rounds alternate so a
disturbance spreads over the settings instead of landing on one.

Usage: python -m benchmarks.bench_contention [--repeats 2] [--busy torch1|torch|spin] [--quick]
``--quick`` is a smoke run (two epochs per training, one round) that writes its JSON to the temp
directory (``contention_quick.json``), not to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._meta import machine, write_result

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/quickstart.yaml"
CONDITIONS = {"quiet": 0, "busy1": 1, "busy2": 2}
QUICK_SETS = ("stages.backbone.train.epochs=2", "stages.two_stage.train.epochs=2",
              "stages.baseline.train.epochs=2")
TARGET_RATIO = 1.6  # the bar: auto beside one busy process, against the quiet time
SUMMARY = re.compile(r" in ([0-9.]+)s;")

# A busy process: what else runs on a device. Prints "ready" after its first step.
BUSY: dict[str, str] = {
    "torch": r"""
import torch
conv = torch.nn.Conv2d(32, 32, 3, padding=1)
opt = torch.optim.SGD(conv.parameters(), lr=1e-3)
x = torch.randn(16, 32, 32, 32)
first = True
while True:
    opt.zero_grad()
    conv(x).square().mean().backward()
    opt.step()
    if first:
        print("ready", flush=True)
        first = False
""",
    "spin": r"""
print("ready", flush=True)
n = 0
while True:
    n += 1
""",
}
# The same training loop on one thread: a process that keeps one core busy (the default).
BUSY["torch1"] = BUSY["torch"].replace("import torch\n", "import torch\ntorch.set_num_threads(1)\n", 1)


def start_busy(kind: str, count: int) -> list[subprocess.Popen[str]]:
    procs = []
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    for _ in range(count):
        p = subprocess.Popen([sys.executable, "-c", BUSY[kind]], stdout=subprocess.PIPE, text=True, env=env)
        procs.append(p)
    for p in procs:
        line = p.stdout.readline() if p.stdout is not None else ""
        if line.strip() != "ready":
            stop_busy(procs)
            raise RuntimeError(f"busy process {p.pid} did not start (exit {p.poll()})")
    return procs


def stop_busy(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_quickstart(setting: str, quick: bool) -> dict[str, Any]:
    """One quickstart run with ``run.threads`` = ``setting``, fresh store and output; its times."""
    with tempfile.TemporaryDirectory(prefix="bench-contention-") as tmp:
        cmd = [sys.executable, "-m", "pipeline", "run", RECIPE, "--store", f"{tmp}/store",
               "--output", f"{tmp}/out", "--set", f"run.threads={setting}"]
        for s in QUICK_SETS if quick else ():
            cmd += ["--set", s]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        start = time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(
            f"quickstart with threads={setting} failed ({out.returncode}):\n{out.stderr[-3000:]}"
        )
    summary = out.stdout.strip().splitlines()[-1]
    match = SUMMARY.search(summary)
    return {
        "wall_s": round(wall, 3),
        "run_s": float(match.group(1)) if match else None,
        "thread_changes": [line for line in out.stderr.splitlines() if line.startswith("threads: ")],
        "summary_line": summary,
    }


def orders(settings: list[str], rounds: int) -> list[list[str]]:
    """Each round's order: rotated, and reversed every other round, so no setting always goes first."""
    out = []
    for r in range(rounds):
        k = r % len(settings)
        order = settings[k:] + settings[:k]
        out.append(order[::-1] if r % 2 else order)
    return out


def ratio(a: float, b: float | None) -> float | None:
    return round(a / b, 3) if b else None


def summarize(rows: list[dict[str, Any]], settings: list[str]) -> list[dict[str, Any]]:
    """Per condition and setting: the median wall time and its ratios to the quiet medians."""
    quiet: dict[str, float | None] = {}
    for s in settings:
        walls = [r["wall_s"] for r in rows if r["condition"] == "quiet" and r["setting"] == s]
        quiet[s] = statistics.median(walls) if walls else None
    for r in rows:
        r["ratio_to_quiet_auto"] = ratio(r["wall_s"], quiet.get("auto"))
        r["ratio_to_quiet_same_setting"] = ratio(r["wall_s"], quiet.get(r["setting"]))
    table = []
    for condition in CONDITIONS:
        for s in settings:
            walls = [r["wall_s"] for r in rows if r["condition"] == condition and r["setting"] == s]
            if not walls:
                continue
            med = statistics.median(walls)
            table.append({
                "condition": condition, "setting": s, "runs": len(walls), "median_wall_s": round(med, 2),
                "min_wall_s": round(min(walls), 2), "max_wall_s": round(max(walls), 2),
                "ratio_to_quiet_auto": ratio(med, quiet.get("auto")),
                "ratio_to_quiet_same_setting": ratio(med, quiet.get(s)),
            })
    return table


def describe(table: list[dict[str, Any]]) -> str:
    """The headline: auto and the fixed counts beside one busy process, against the quiet auto time."""
    busy1 = {t["setting"]: t["ratio_to_quiet_auto"] for t in table if t["condition"] == "busy1"}
    if busy1.get("auto") is None:
        return "see section"
    fixed = ", ".join(f"threads {s}: {v:.2f}x" for s, v in busy1.items() if s != "auto" and v is not None)
    return (f"beside one busy process, auto took {busy1['auto']:.2f}x the quiet time (target "
            f"{TARGET_RATIO}x)" + (f"; fixed {fixed}" if fixed else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="rounds, each running every condition x setting")
    ap.add_argument("--settings", nargs="+", default=["auto", "2", "1"], help="run.threads values")
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=list(CONDITIONS))
    ap.add_argument("--busy", choices=sorted(BUSY), default="torch1", help="what a busy process runs")
    ap.add_argument("--quick", action="store_true", help="smoke run: two epochs per training, one round")
    args = ap.parse_args()
    # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so the `finally` below stops the busy processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rounds = 1 if args.quick else args.repeats
    # One result file per kind of busy process: they answer different questions (see the docstring).
    name = "contention" if args.busy == "torch1" else f"contention_{args.busy}"
    if args.quick:
        name += "_quick"
    rows: list[dict[str, Any]] = []
    condition_orders = orders(list(args.conditions), rounds)
    setting_orders = orders(list(args.settings), rounds * len(args.conditions))

    def save(partial: bool) -> Path:
        table = summarize(rows, list(args.settings))
        auto_busy1 = next((t["ratio_to_quiet_auto"] for t in table
                           if t["condition"] == "busy1" and t["setting"] == "auto"), None)
        payload: dict[str, Any] = {
            "question": "quickstart wall time quiet and beside busy processes: run.threads auto vs fixed",
            "headline": describe(table),
            "partial": partial,
            "shared_machine_note": "other work (tests, other builds) may have shared this machine's cores "
            "during the runs; rounds alternate the order of conditions and settings to spread it",
            "settings": {
                "recipe": RECIPE, "repeats": rounds, "thread_settings": list(args.settings),
                "conditions": {c: CONDITIONS[c] for c in args.conditions},
                "busy_process": args.busy,
                "busy_process_code": BUSY[args.busy].strip(),
                "quick_overrides": list(QUICK_SETS) if args.quick else [],
                "fresh_store_each_run": True,
                "cores_available": os.cpu_count(),
                "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            },
            "summary": table,
            "rows": rows,
        }
        if auto_busy1 is not None:
            payload["targets"] = {
                f"auto_beside_one_busy_within_{TARGET_RATIO}x_quiet":
                    auto_busy1 <= TARGET_RATIO,
            }
        if args.quick:  # a smoke run's numbers are not results: kept out of benchmarks/results/
            path = Path(tempfile.gettempdir()) / f"{name}.json"
            path.write_text(json.dumps({"name": name, "machine": machine(), **payload}, indent=2) + "\n")
            return path
        return write_result(name, payload)

    for r in range(rounds):
        for ci, condition in enumerate(condition_orders[r]):
            order = setting_orders[r * len(args.conditions) + ci]
            for setting in order:
                procs = start_busy(args.busy, CONDITIONS[condition])
                try:
                    result = run_quickstart(setting, args.quick)
                finally:
                    stop_busy(procs)
                row = {"round": r, "condition": condition, "setting": setting,
                       "order": order.index(setting), **result}
                rows.append(row)
                print(f"round {r} {condition:<5} threads={setting:<4} {result['wall_s']:7.1f}s "
                      f"(run {result['run_s']}s) changes: {len(result['thread_changes'])}", flush=True)
                save(partial=True)
    path = save(partial=False)
    for t in summarize(rows, list(args.settings)):
        print(f"{t['condition']:<5} threads={t['setting']:<4} median {t['median_wall_s']:7.1f}s: "
              f"{t['ratio_to_quiet_auto']}x quiet auto, {t['ratio_to_quiet_same_setting']}x quiet same")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
