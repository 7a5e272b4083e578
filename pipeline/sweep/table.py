"""A sweep's results for people: ``sweep.csv``, ``sweep.md`` (sorted by validation accuracy),
``sweep.png`` (accuracy against each swept key, against time and against memory) and ``best/``.

``best/`` is the best variant's trained model as its run left it (``model.pt``, which
``pipeline.load_model`` and ``predict``/``export`` read, and ``best.pt``), copied with the
variant's record beside it, so the sweep directory alone is enough to deploy the winner.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

from stores.durable import atomic_write_bytes
from stores.manifest import human_size

from .records import RECORD_FILE

COLUMNS = ("val_accuracy", "test_accuracy", "train_seconds", "epoch_seconds", "memory_total_bytes",
           "seconds", "trained", "status", "run_dir")
BEST_DIR = "best"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _sorted(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: (r.get("val_accuracy") is None, -(r.get("val_accuracy") or 0.0),
                                          r["index"]))


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def write_csv(sweep_dir: Path, keys: list[str], records: list[dict[str, Any]]) -> None:
    rows = [["variant", *keys, *COLUMNS]]
    for r in sorted(records, key=lambda r: r["index"]):
        values = [_cell(r["values"].get(k)) for k in keys]
        rows.append([r["id"], *values, *(_cell(r.get(c)) for c in COLUMNS)])
    tmp = sweep_dir / ".sweep.csv.tmp"
    with open(tmp, "w", newline="") as fh:
        csv.writer(fh).writerows(rows)
    tmp.replace(sweep_dir / "sweep.csv")


def write_markdown(sweep_dir: Path, data: dict[str, Any], plots: list[str]) -> None:
    keys = [a["key"] for a in data["grid"]]
    records = data["variants"]
    lines = [f"# Sweep of {data['recipe']}", "",
             f"Recipe `{data['recipe_file']}`, target `{data['target']}`, ranked by its validation accuracy.",
             ""]
    lines += [f"- `--grid {a['key']}=" + ",".join(a["texts"]) + "`" for a in data["grid"]]
    if data.get("random") is not None:
        lines.append(f"- `--random {data['random']} --seed {data['seed']}`")
    lines += ["", "Plan: " + "; ".join(data["plan_lines"]), ""]
    header = ["rank", "variant", *keys, "val acc", "test acc", "train s", "s/epoch", "memory", "trained",
              "status"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def fmt(value: Any, spec: str) -> str:
        return format(value, spec) if _number(value) else "-"

    for rank, r in enumerate(_sorted(records), 1):
        memory = human_size(int(r["memory_total_bytes"])) if _number(r.get("memory_total_bytes")) else "-"
        cells = [str(rank), r["id"], *(f"`{_cell(r['values'].get(k))}`" for k in keys),
                 fmt(r.get("val_accuracy"), ".4f"), fmt(r.get("test_accuracy"), ".4f"),
                 fmt(r.get("train_seconds"), ".1f"), fmt(r.get("epoch_seconds"), ".3f"), memory,
                 r.get("trained") or "-", r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in records if r.get("error")]
    if failed:
        lines += ["", "## Failed variants", ""] + [f"- {r['id']} ({', '.join(r['overrides'])}): {r['error']}"
                                                    for r in failed]
    lines += [""] + [f"![{p}]({p})" for p in plots] + ["", data["summary_line"], ""]
    atomic_write_bytes(sweep_dir / "sweep.md", "\n".join(lines).encode())


def _axis_values(values: list[Any]) -> tuple[list[Any], list[str] | None]:
    """Numbers stay numbers; anything else is placed at 0, 1, ... and labelled with its text."""
    if all(_number(v) for v in values):
        return values, None
    labels = sorted({_cell(v) for v in values})
    return [labels.index(_cell(v)) for v in values], labels


def write_plot(sweep_dir: Path, keys: list[str], records: list[dict[str, Any]]) -> list[str]:
    """sweep.png: validation accuracy against each swept key, the training time and the training memory."""
    done = [r for r in records if _number(r.get("val_accuracy"))]
    if not done:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, list[Any]]] = [(k, [r["values"].get(k) for r in done]) for k in keys]
    if all(_number(r.get("train_seconds")) for r in done):
        panels.append(("training seconds", [r["train_seconds"] for r in done]))
    if all(_number(r.get("memory_total_bytes")) for r in done):
        panels.append(("training memory (MiB)", [r["memory_total_bytes"] / 2**20 for r in done]))
    accuracy = [r["val_accuracy"] for r in done]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (name, xs) in zip(axes[0], panels, strict=True):
        positions, labels = _axis_values(xs)
        ax.scatter(positions, accuracy)
        if labels is not None:
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        elif min(xs) > 0 and max(xs) / min(xs) >= 100:
            ax.set_xscale("log")  # learning rates and the like span decades
        ax.set(xlabel=name, ylabel="val accuracy")
    fig.tight_layout()
    fig.savefig(sweep_dir / "sweep.png", dpi=100)
    plt.close(fig)
    return ["sweep.png"]


def copy_best(sweep_dir: Path, best: dict[str, Any] | None) -> Path | None:
    """``best/``: the best variant's trained model files and record (replacing an earlier ``best/``)."""
    target = sweep_dir / BEST_DIR
    if best is None:
        return None
    stage_dir = sweep_dir / best["run_dir"] / "stages" / best["target"]
    files = [p for p in stage_dir.glob("*") if p.is_file()] if stage_dir.is_dir() else []
    tmp = sweep_dir / f".{BEST_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in files:
        shutil.copy2(f, tmp / f.name)
    (tmp / RECORD_FILE).write_text(json.dumps(best, indent=2, default=float))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
