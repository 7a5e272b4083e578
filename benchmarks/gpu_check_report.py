"""The record of one ``benchmarks/gpu_check.sh`` run: ``benchmarks/results/gpu_check_cuda.json``.

    python -m benchmarks.gpu_check_report WORK [--cpu-run RUN_DIR] [--machine-from RESULT.json]

Reads the check's work folder (``gpu.txt``, ``steps.txt``, ``logs/``, ``summaries/``) and writes what the
GPU issue's bar asks for in one file: every step's exit status and seconds, the CUDA tests' counts and
the names of those that failed, the quickstart's test accuracy at each precision on the GPU (beside a
CPU run's, given ``--cpu-run``), and whether the GPU-trained model gives the same classes on the CPU.
``gpu_check.sh`` runs it at its end, on the GPU machine. Assembled elsewhere from a run's files,
``--machine-from`` takes the machine block from a result file that run wrote (so the record names the
GPU machine, not the one that assembled it).

The quickstart's epoch times are recorded but are not timings: the smoke runs share the machine with
the tests.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from benchmarks._meta import write_result

TEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|error|errors)")


def steps(work: Path) -> list[dict[str, Any]]:
    out = []
    for line in (work / "steps.txt").read_text().splitlines():
        m = re.fullmatch(r"(\S+) rc=(\d+) (\d+)s", line.strip())
        if m:
            out.append({"step": m[1], "exit_status": int(m[2]), "seconds": int(m[3])})
    return out


def tests(work: Path) -> dict[str, Any]:
    log = work / "logs" / "tests.log"
    if not log.is_file():
        return {}
    text = log.read_text(errors="replace")
    counts: dict[str, int] = {}
    summary = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    for n, kind in TEST_COUNTS.findall(summary[-1] if summary else ""):
        counts["errors" if kind.startswith("error") else kind] = int(n)
    failed = sorted(set(re.findall(r"^_{3,} (test\S+) _{3,}$", text, flags=re.MULTILINE)))
    return {**counts, "failed_tests": failed}


def quickstart(work: Path) -> list[dict[str, Any]]:
    rows = []
    for summary in sorted((work / "summaries").glob("qs_*/summary.json")):
        results = json.loads(summary.read_text())["results"]
        for stage, m in results.items():
            if "accuracy" in m:
                rows.append({"run": summary.parent.name, "stage": stage, "device": m.get("device"),
                             "precision": m.get("precision"), "cuda_graph": m.get("cuda_graph"),
                             "test_accuracy": m["accuracy"], "test_samples": m.get("test_samples"),
                             "epoch_seconds_steady": m.get("epoch_seconds_steady")})
    return rows


def last_json(path: Path) -> dict[str, Any] | None:
    """The JSON object a command printed last (its --json output), or None."""
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    start = text.rfind("\n{")
    start = 0 if text.startswith("{") and start < 0 else start
    try:
        data = json.loads(text[start:])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path, help="the work folder of a gpu_check.sh run")
    ap.add_argument("--cpu-run", type=Path, help="a CPU run directory of the quickstart, to compare with")
    ap.add_argument("--machine-from", type=Path, help="a result file of the same GPU run: its machine block")
    ap.add_argument("--results-dir", type=Path, default=None)
    args = ap.parse_args()
    work = args.work
    gpu = (work / "gpu.txt").read_text().strip().splitlines() if (work / "gpu.txt").is_file() else []
    # nvidia-smi's CSV: a header, then "name, driver, memory" per GPU
    gpu_name = gpu[1].split(",")[0].strip() if len(gpu) > 1 and "," in gpu[1] else None
    run_steps = steps(work)
    test_counts = tests(work)
    qs = quickstart(work)
    predict = last_json(work / "logs" / "predict_cpu_gpu.log")
    evaluated = {name: (last_json(work / "logs" / f"{name}.log") or {}).get("accuracy")
                 for name in ("evaluate_cpu", "evaluate_cpu_pt2")}
    cpu = None
    if args.cpu_run is not None:
        results = json.loads((args.cpu_run / "summary.json").read_text())["results"]
        cpu = {stage: m["accuracy"] for stage, m in results.items() if "accuracy" in m}
    gpu_two = {r["precision"]: r["test_accuracy"] for r in qs if r["stage"] == "two_stage"
               and r["run"] in ("qs_fp32", "qs_fp16", "qs_bf16")}
    headline = (f"CUDA tests {test_counts.get('passed', 0)} passed, {test_counts.get('failed', 0)} failed; "
                "quickstart two-stage on the GPU " + ", ".join(f"{p} {a:.3f}" for p, a in gpu_two.items())
                + (f" (CPU {cpu['two_stage']:.3f})" if cpu and "two_stage" in cpu else ""))
    if predict is not None and "cpu_gpu_disagree" in predict:
        headline += (f"; the GPU-trained model on the CPU: {predict['cpu_gpu_disagree']:.1%} of "
                     f"{predict['samples']} classes differ")
    payload: dict[str, Any] = {
        "headline": headline,
        "question": "does every CUDA path run on a real GPU, with the CPU's results where they must agree?",
        "gpu": gpu_name,
        "gpu_details": gpu,
        "command": "benchmarks/gpu_check.sh " + " ".join(s["step"] for s in run_steps),
        "steps": run_steps,
        "tests": test_counts,
        "quickstart": qs,
        "quickstart_cpu": cpu,
        "gpu_model_on_cpu": {"predict_check": predict, "evaluate_accuracy_on_cpu": evaluated},
        "targets": {
            "every_step_ran": bool(run_steps) and all(s["exit_status"] == 0 for s in run_steps),
            "gpu_model_same_classes_on_cpu": bool(predict) and predict.get("cpu_gpu_disagree") == 0.0,
        },
        "settings": {"note": "quickstart epoch times are not timings: the smoke runs share the machine "
                             "with the tests and table4"},
    }
    path = write_result("gpu_check_cuda", payload, args.results_dir)
    if args.machine_from is not None:  # assembled elsewhere: the GPU run's machine, not this one
        record = json.loads(path.read_text())
        source = json.loads(args.machine_from.read_text())
        record["machine"] = source["machine"]
        record["machine_note"] = f"the machine block of {args.machine_from.name}, written by the same GPU run"
        path.write_text(json.dumps(record, indent=2, default=float) + "\n")
    print(headline)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
