"""Run outputs: summary.json, metrics.jsonl (written while training), report.md, plots, resolved recipe."""

from __future__ import annotations

import json
import platform
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from .runner import Runner, StageReport
from .spec import RESULT


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _result_line(name: str, m: dict[str, Any]) -> str:
    """One trainer's result for the summary line: accuracy plus its speed and stored bytes when known."""
    text = f"{name} acc {m['accuracy']:.3f}" if _number(m.get("accuracy")) else name
    if _number(m.get("epoch_seconds")):
        cache = (
            f", cache {_human(m['cache_bytes'])} at {m['bits']} bits" if m.get("mode") == "two_stage" else ""
        )
        text += f" ({m['epoch_seconds']:.2f}s/epoch{cache})"
    elif _number(m.get("train_seconds")):
        text += f" ({m['train_seconds']:.1f}s training)"
    return text


def _epochs(path: Path) -> dict[str, list[dict[str, Any]]]:
    by_stage: dict[str, list[dict[str, Any]]] = defaultdict(list)
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                by_stage[rec.get("stage", "?")].append(rec)
    return by_stage


def _plots(
    output: Path, epochs: dict[str, list[dict[str, Any]]], results: dict[str, dict[str, Any]]
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    # Per-epoch records with one loss (trainers of one network); block-wise local learning logs
    # a loss per layer and is shown by the time-to-accuracy plot below instead.
    scalar = {
        stage: recs
        for stage, recs in epochs.items()
        if recs and all(_number(r.get("train_loss")) for r in recs)
    }
    if scalar:
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
        for stage, recs in scalar.items():
            xs = [r["epoch"] for r in recs]
            ax_loss.plot(xs, [r["train_loss"] for r in recs], marker="o", label=stage)
            if any(r.get("val_acc") is not None for r in recs):
                ax_acc.plot(xs, [r.get("val_acc") for r in recs], marker="o", label=stage)
        ax_loss.set(xlabel="epoch", ylabel="train loss", title="training loss")
        ax_acc.set(xlabel="epoch", ylabel="val accuracy", title="validation accuracy")
        ax_loss.legend()
        ax_acc.legend()
        fig.tight_layout()
        fig.savefig(output / "curves.png", dpi=100)
        plt.close(fig)
        written.append("curves.png")
    timed = {n: m for n, m in results.items() if _number(m.get("epoch_seconds"))}
    if timed:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = list(timed)
        ax.bar(
            names,
            [timed[n]["epoch_seconds"] for n in names],
            color=["tab:orange" if timed[n].get("mode") == "single_stage" else "tab:blue" for n in names],
        )
        ax.set(ylabel="seconds per epoch", title="epoch time: single-stage (orange) vs two-stage (blue)")
        fig.tight_layout()
        fig.savefig(output / "epoch_time.png", dpi=100)
        plt.close(fig)
        written.append("epoch_time.png")
    curves = {n: m["val_curve"] for n, m in results.items() if m.get("val_curve")}
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for n, curve in curves.items():
            ax.plot([t for t, _ in curve], [a for _, a in curve], marker="o", label=n)
        ax.set(
            xlabel="seconds since the stage started",
            ylabel="best val accuracy so far",
            title="time to accuracy",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(output / "time_to_accuracy.png", dpi=100)
        plt.close(fig)
        written.append("time_to_accuracy.png")
    return written


def write_run_outputs(
    output: Path, recipe: Any, runner: Runner, reports: list[StageReport], seconds: float
) -> dict[str, Any]:
    results = {r.name: r.metrics for r in reports if r.kind == RESULT and r.metrics}
    primary = next((t for t in reversed(runner.graph.targets) if t in results), None)
    stages: list[dict[str, Any]] = [
        {
            "name": r.name,
            "type": r.type,
            "kind": r.kind,
            "fingerprint": r.fingerprint,
            "status": r.status,
            "seconds": round(r.seconds, 4),
            "bytes_written": r.bytes_written,
            **({"metrics": r.metrics} if r.metrics else {}),
        }
        for r in reports
    ]
    computed = sum(r.status == "computed" for r in reports)
    reused = sum(r.status == "reused" for r in reports)
    parts = [f"{recipe.name}: {len(reports)} stages ({computed} computed, {reused} reused) in {seconds:.1f}s"]
    parts += [_result_line(name, m) for name, m in results.items()]
    summary_line = "; ".join(parts) + f" -> {output}"
    summary = {
        "recipe": recipe.name,
        "recipe_file": recipe.source,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
        "store": str(runner.ctx.catalog.root),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "stages": stages,
        "metrics": results.get(primary, {}) if primary else {},
        "results": results,
        "summary_line": summary_line,
    }
    (output / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    (output / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe.resolved_dict(), sort_keys=False))
    epochs = _epochs(output / "metrics.jsonl")
    plots = _plots(output, {k: v for k, v in epochs.items() if k in results or v}, results)
    lines = [
        f"# Run report: {recipe.name}",
        "",
        f"Recipe `{recipe.source}`, {summary['created']}, "
        f"{seconds:.1f} s in all. Store `{summary['store']}`.",
        "",
        "## Stages",
        "",
        "| stage | type | status | fingerprint | seconds | bytes written |",
        "|---|---|---|---|---:|---:|",
    ]
    for s in stages:
        lines.append(
            f"| {s['name']} | {s['type']} | {s['status']} | `{s['fingerprint'][:12]}` | "
            f"{s['seconds']:.2f} | {_human(s['bytes_written'])} |"
        )
    if results:
        lines += [
            "",
            "## Results",
            "",
            "| trainer | mode | bits | test accuracy | best val | s/epoch | training s | cache |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]

        def cell(value: Any, fmt: str) -> str:
            return format(value, fmt) if _number(value) else "-"

        for name, m in results.items():
            best_val = m.get("best_val_accuracy", m.get("exit_val_acc"))
            lines.append(
                f"| {name} | {m.get('mode', m.get('variant', '-'))} | {m.get('bits', '-')} | "
                f"{cell(m.get('accuracy'), '.4f')} | {cell(best_val, '.4f')} | "
                f"{cell(m.get('epoch_seconds'), '.3f')} | {cell(m.get('train_seconds'), '.1f')} | "
                f"{_human(m['cache_bytes']) if _number(m.get('cache_bytes')) else '-'} |"
            )
    lines += [""] + [f"![{p}]({p})" for p in plots] + ["", summary_line, ""]
    (output / "report.md").write_text("\n".join(lines))
    return summary
