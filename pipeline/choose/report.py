"""What ``choose`` explored, as a table, ``choose.json``, ``choose.md`` and the winner's recipe.

One row per candidate: its settings, its metered memory, its measured seconds per epoch, its
validation accuracy at each rung it reached, and where it dropped out and why (or that it won).
A ``*`` marks the candidates on the memory/accuracy frontier of rung 0 (no other candidate of
rung 0 is both smaller and at least as accurate): the trade-off curve the budget cut through.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from .meter import mib
from .search import ChooseResult
from .space import short_value

WINNER_FILE = "winner.yaml"


def _frontier(result: ChooseResult) -> set[str]:
    first = result.halving.rungs[0].trained
    memory = {m.candidate.id: m.memory_bytes or 0 for m in result.metered}
    return {
        i for i, t in first.items()
        if not any(memory[j] <= memory[i] and u.val_accuracy >= t.val_accuracy
                   and (memory[j], u.val_accuracy) != (memory[i], t.val_accuracy) for j, u in first.items())
    }


def rows(result: ChooseResult) -> list[dict[str, Any]]:
    """Every candidate, in order, with what the search learned about it."""
    frontier = _frontier(result)
    out = []
    for m in result.metered:
        cid = m.candidate.id
        reached = [(r, rung.trained[cid]) for r, rung in enumerate(result.halving.rungs)
                   if cid in rung.trained]
        if cid == result.halving.winner:
            outcome = "winner"
        elif m.excluded is not None:
            outcome = f"excluded: {m.excluded}"
        else:
            outcome = f"dropped {result.halving.dropped[cid]}"
        out.append({
            "id": cid,
            "settings": m.candidate.settings,
            "overrides": m.candidate.overrides,
            "memory_bytes": m.memory_bytes,
            "epoch_seconds": reached[0][1].epoch_seconds if reached else None,
            "rungs": [{"rung": r, "epochs": t.epochs, "val_accuracy": t.val_accuracy, "val_loss": t.val_loss,
                       "test_accuracy": t.test_accuracy, "status": t.status, "train_seconds": t.train_seconds,
                       "run_dir": t.run_dir} for r, t in reached],
            "frontier": cid in frontier,
            "outcome": outcome,
        })
    return out


def table(result: ChooseResult, *, markdown: bool = False) -> str:
    """The explored frontier: one line per candidate."""
    keys = list(dict.fromkeys(k for m in result.metered for k in m.candidate.settings))
    rung_heads = [f"r{i} ({rung.epochs}ep)" for i, rung in enumerate(result.halving.rungs)]
    head = ["id", *keys, "memory", "s/epoch", *rung_heads, "outcome"]
    body = []
    for row in rows(result):
        accs = {r["rung"]: f"{r['val_accuracy']:.3f}" for r in row["rungs"]}
        body.append([
            row["id"] + ("*" if row["frontier"] else ""),
            *(short_value(row["settings"][k]) if k in row["settings"] else "-" for k in keys),
            mib(row["memory_bytes"]) if row["memory_bytes"] is not None else "-",
            f"{row['epoch_seconds']:.2f}" if row["epoch_seconds"] is not None else "-",
            *(accs.get(i, "-") for i in range(len(rung_heads))),
            row["outcome"],
        ])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in body]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    widths[-1] = 0  # the outcome is last and free-length
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in [head, *body])


class _PlainDumper(yaml.SafeDumper):
    """No anchors or aliases: the winner's recipe reads as plain YAML, every stage spelled out."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def winner_yaml(result: ChooseResult, command: str) -> str:
    """The recipe with the winner's overrides applied, training the tuned stage only."""
    won = result.winner_candidate
    header = [
        f"# Chosen by: {command}",
        f"# from {result.recipe.source}, stage {result.target}: {won.id} {won.describe()}",
        "# Overrides applied to that recipe (targets narrowed to the chosen stage):",
        *(f"#   {k}: {json.dumps(v)}" for k, v in won.overrides.items()),
    ]
    body = yaml.dump(result.winner.resolved_dict(), Dumper=_PlainDumper, sort_keys=False, width=110,
                     default_flow_style=None)
    return "\n".join(header) + "\n" + body


def as_dict(result: ChooseResult, command: str) -> dict[str, Any]:
    winner = next(r for r in rows(result) if r["outcome"] == "winner")
    last = winner["rungs"][-1]
    return {
        "command": command,
        "recipe": result.recipe.source,
        "target": result.target,
        "knobs": result.knobs.paths(),
        "budgets": {"max_memory_bytes": result.max_memory, "max_epoch_seconds": result.max_epoch_seconds},
        "eta": result.eta,
        "epochs": result.epochs,
        "rungs": [{"epochs": r.epochs, "candidates": len(r.trained), "kept": r.kept}
                  for r in result.halving.rungs],
        "winner": {"id": winner["id"], "settings": winner["settings"], "overrides": winner["overrides"],
                   "memory_bytes": winner["memory_bytes"], "epoch_seconds": winner["epoch_seconds"],
                   "val_accuracy": last["val_accuracy"], "test_accuracy": last["test_accuracy"],
                   "epochs": last["epochs"], "recipe_file": WINNER_FILE},
        "cost": result.cost(),
        "candidates": rows(result),
    }


def summary_line(result: ChooseResult) -> str:
    won = result.winner_candidate
    best = result.halving.rungs[-1].trained[won.id]
    memory = next(m.memory_bytes for m in result.metered if m.candidate.id == won.id) or 0
    cost = result.cost()
    return (f"chose {won.id} {won.describe()}: val {best.val_accuracy:.3f}, test {best.test_accuracy:.3f} "
            f"after {best.epochs} epochs; {mib(memory)} training memory, "
            f"{result.halving.rungs[0].trained[won.id].epoch_seconds:.2f} s/epoch; search: "
            f"{cost['trainings']} trainings ({cost['epochs_trained']} epochs, {cost['train_seconds']:.0f}s) "
            f"+ {cost['build_seconds']:.0f}s of builds")


def write_outputs(result: ChooseResult, output: Path, command: str) -> dict[str, Path]:
    """``choose.json``, ``choose.md`` and the winner's recipe in ``output``; returns their paths."""
    output.mkdir(parents=True, exist_ok=True)
    data = as_dict(result, command)
    paths = {"json": output / "choose.json", "md": output / "choose.md", "recipe": output / WINNER_FILE}
    paths["json"].write_text(json.dumps(data, indent=2, default=float) + "\n")
    cost = data["cost"]
    rungs = ", ".join(f"{r['candidates']} at {r['epochs']} epochs" for r in data["rungs"])
    md = [
        f"# choose: {result.recipe.name}, stage {result.target}",
        "",
        f"`{command}`",
        "",
        f"Budgets: {mib(result.max_memory)} training memory (analytic meter), "
        f"{result.max_epoch_seconds:g} s per training epoch (measured in rung 0). "
        f"Successive halving, eta {result.eta}: {rungs}.",
        "",
        f"**{summary_line(result)}**",
        "",
        f"Cost: {cost['trainings']} trainings ({cost['trainings_reused']} reused from the store), "
        f"{cost['epochs_trained']} epochs, {cost['train_seconds']:.1f} s training, "
        f"{cost['build_seconds']:.1f} s building stored stages, {cost['metering_seconds']:.1f} s metering, "
        f"{cost['wall_seconds']:.1f} s in all.",
        "",
        "Validation accuracy per rung (`*`: on rung 0's memory/accuracy frontier):",
        "",
        table(result, markdown=True),
        "",
        f"Winner's recipe: [{WINNER_FILE}]({WINNER_FILE})",
        "",
    ]
    paths["md"].write_text("\n".join(md))
    paths["recipe"].write_text(winner_yaml(result, command))
    return paths
