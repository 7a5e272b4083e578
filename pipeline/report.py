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
    if epochs:
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
        for stage, recs in epochs.items():
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
    if results:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = list(results)
        ax.bar(
            names,
            [results[n]["epoch_seconds"] for n in names],
            color=["tab:orange" if results[n]["mode"] == "single_stage" else "tab:blue" for n in names],
        )
        ax.set(ylabel="seconds per epoch", title="epoch time: single-stage (orange) vs two-stage (blue)")
        fig.tight_layout()
        fig.savefig(output / "epoch_time.png", dpi=100)
        plt.close(fig)
        written.append("epoch_time.png")
    return written


def write_run_outputs(
    output: Path, recipe: Any, runner: Runner, reports: list[StageReport], seconds: float
) -> dict[str, Any]:
    results = {r.name: r.metrics for r in reports if r.kind == RESULT and r.metrics}
    primary = next((t for t in reversed(runner.graph.targets) if t in results), None)
    stages = [
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
    for name, m in results.items():
        cache = f", cache {_human(m['cache_bytes'])} at {m['bits']} bits" if m["mode"] == "two_stage" else ""
        parts.append(f"{name} acc {m['accuracy']:.3f} ({m['epoch_seconds']:.2f}s/epoch{cache})")
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
            "| trainer | mode | bits | test accuracy | best val | s/epoch | cache |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for name, m in results.items():
            lines.append(
                f"| {name} | {m['mode']} | {m['bits']} | {m['accuracy']:.4f} | "
                f"{m['best_val_accuracy']:.4f} | {m['epoch_seconds']:.3f} | {_human(m['cache_bytes'])} |"
            )
    lines += [""] + [f"![{p}]({p})" for p in plots] + ["", summary_line, ""]
    (output / "report.md").write_text("\n".join(lines))
    return summary
