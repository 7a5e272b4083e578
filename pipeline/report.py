"""Run outputs: summary.json, metrics.jsonl (written while training), report.md, plots, resolved recipe.

Written for every run that started, finished or not: a failed, interrupted or terminated run's
summary says which stage was working and what went wrong, beside the stages that finished.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import shutil
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from .data.image_folder import SkippedSamplesWarning
from .errors import OutputError, stage_of
from .runner import Runner, StageReport
from .spec import RESULT, Derivation
from .stages.derived_cut import blocks_run

DISTRIBUTION = "ondevice-tl"


def toolkit_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def versions() -> dict[str, str]:
    """What made the numbers: the toolkit, torch and Python (a run record outlives the environment)."""
    import torch

    return {"ondevice_tl": toolkit_version(), "torch": torch.__version__, "python": platform.python_version()}


@dataclass
class SkippedSamples:
    """Samples a dataset left out under ``on_bad_sample: skip``, gathered while the run makes them."""

    sources: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(s["count"] for s in self.sources)

    def as_json(self) -> dict[str, Any]:
        return {"total": self.total, "sources": self.sources}


@contextmanager
def recording_skipped_samples() -> Iterator[SkippedSamples]:
    """Count the samples datasets skip while this block runs; their warnings are still shown.

    The count is only known where the dataset is indexed, which reports it as a
    ``SkippedSamplesWarning``; the warning stays the user's live notice, and this hook keeps its
    numbers for summary.json.
    """
    record = SkippedSamples()
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if isinstance(message, SkippedSamplesWarning):
            record.sources.append(
                {"source": message.source, "count": len(message.skipped), "examples": message.skipped[:5]}
            )
        shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", SkippedSamplesWarning)  # every dataset's skips are counted
        warnings.showwarning = show
        yield record


@dataclass(frozen=True)
class Failure:
    """How a run that did not finish ended: the stage at work, and the error or signal."""

    status: str  # "failed" | "interrupted" | "terminated"
    stage: str | None
    error: str
    message: str

    def as_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "error": self.error, "message": self.message}


def failure_of(exc: BaseException, *, status: str, message: str | None = None) -> Failure:
    return Failure(status, stage_of(exc), type(exc).__name__, message or str(exc))


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


def _from_lists(name: str, m: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored training result's per-epoch history (finetune keeps it as ``*_all`` lists)."""
    columns = {"train_loss": "train_loss_all", "val_acc": "val_accuracy_all", "val_loss": "val_loss_all",
               "epoch_seconds": "epoch_seconds_all"}
    lists = {key: m[src] for key, src in columns.items() if isinstance(m.get(src), list)}
    if "train_loss" not in lists:
        return []
    mode = {"mode": m["mode"]} if "mode" in m else {}
    return [{"stage": name, **mode, "epoch": i,
             **{key: values[i] for key, values in lists.items() if i < len(values)}}
            for i in range(len(lists["train_loss"]))]


def reused_history(reports: Sequence[StageReport], runner: Runner | None,
                   logged: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The per-epoch records of the trainings this run took from the store instead of running them.

    A reused stage trains nothing, so it logs nothing while the run works; its stored result (a
    trainer's result.json + build.json) or its entry's manifest (a pretrained backbone) holds the
    history of the build that made it. Written to metrics.jsonl marked ``reused`` (with the entry), so
    a rerun's curves and metrics show the training its numbers come from.
    """
    records: list[dict[str, Any]] = []
    for r in reports:
        if r.status != "reused" or logged.get(r.name):
            continue
        history = _from_lists(r.name, r.metrics) if r.kind == RESULT else []
        if not history and runner is not None and r.kind != RESULT:
            entry = runner.ctx.catalog.lookup(r.fingerprint)
            stored = entry.manifest.get("extra", {}).get("history") if entry is not None else None
            if isinstance(stored, list):
                history = [{"stage": r.name, **rec} for rec in stored if isinstance(rec, dict)]
        records += [{**rec, "reused": True, "entry": r.fingerprint[:12]} for rec in history]
    return records


def training_seconds(m: dict[str, Any]) -> float | None:
    """A trainer's training time: its own total, else the sum of its epochs (finetune records those)."""
    if _number(m.get("train_seconds")):
        return float(m["train_seconds"])
    epochs = m.get("epoch_seconds_all")
    if isinstance(epochs, list) and epochs and all(_number(e) for e in epochs):
        return float(sum(epochs))
    return None


# Bar colours and names of the trainers' modes; any other trainer (tinytl, neuroflux, ...) is grey.
MODE_BARS = {"single_stage": ("tab:orange", "orange", "single-stage"),
             "two_stage": ("tab:blue", "blue", "two-stage")}


def epoch_time_title(results: dict[str, dict[str, Any]]) -> str:
    """Named after what the plot shows: the modes present, with their colours when there are several."""
    other = ("tab:gray", "grey", "other trainers")
    present = {MODE_BARS.get(m.get("mode", ""), other) for m in results.values()}
    kinds = [bar for bar in (*MODE_BARS.values(), other) if bar in present]  # always in this order
    if len(kinds) == 1:
        return f"seconds per epoch: {kinds[0][2]}"
    return "seconds per epoch: " + " vs ".join(f"{name} ({colour})" for _, colour, name in kinds)


def _save(fig: Any, path: Path, title: str) -> None:
    # The title also goes into the PNG's text chunk and report.md's alt text: what each plot shows is
    # readable without looking at it (and checked by the tests).
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Title": title})


def _plots(
    output: Path,
    epochs: dict[str, list[dict[str, Any]]],
    results: dict[str, dict[str, Any]],
    reused: AbstractSet[str] = frozenset(),
) -> list[tuple[str, str]]:
    """Draw the run's plots; (file name, title) of each one written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    written = []
    # Per-epoch records with one loss (trainers of one network); block-wise local learning logs
    # a loss per layer and is shown by the time-to-accuracy plot below instead.
    scalar = {
        stage: recs
        for stage, recs in epochs.items()
        if recs and all(_number(r.get("train_loss")) for r in recs)
    }
    # A pretrained backbone learned its own data (often other classes) before the transfer: its curves
    # get their own row, so no one reads its accuracy as the transfer's.
    transfer = {s: recs for s, recs in scalar.items() if s in results}
    pretraining = {s: recs for s, recs in scalar.items() if s not in results}
    rows = [(label, group) for label, group in (
        ("transfer", transfer), ("backbone pretraining", pretraining)) if group]
    if rows:
        fig, axes = plt.subplots(len(rows), 2, figsize=(10, 4 * len(rows)), squeeze=False)
        for (label, group), (ax_loss, ax_acc) in zip(rows, axes, strict=True):
            for stage, recs in group.items():
                name = f"{stage} (reused)" if stage in reused else stage
                style = "--" if stage in reused else "-"
                xs = [r["epoch"] for r in recs]
                ax_loss.plot(xs, [r["train_loss"] for r in recs], style, marker="o", label=name)
                if any(r.get("val_acc") is not None for r in recs):
                    ax_acc.plot(xs, [r.get("val_acc") for r in recs], style, marker="o", label=name)
            ax_loss.set(xlabel="epoch", ylabel="train loss", title=f"{label}: training loss")
            ax_acc.set(xlabel="epoch", ylabel="val accuracy", title=f"{label}: val accuracy")
            seen = sorted({r["epoch"] for recs in group.values() for r in recs})
            for ax in (ax_loss, ax_acc):  # epochs are whole numbers: ticks on them, never at 0.5
                if len(seen) <= 12:
                    ax.set_xticks(seen)
                else:
                    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax_loss.legend()
            if ax_acc.lines:
                ax_acc.legend()
        title = "training curves: " + "; ".join(f"{label} ({', '.join(group)})" for label, group in rows)
        _save(fig, output / "curves.png", title)
        plt.close(fig)
        written.append(("curves.png", title))
    timed = {n: m for n, m in results.items() if _number(m.get("epoch_seconds"))}
    if timed:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = list(timed)
        ax.bar(
            [f"{n} (reused)" if n in reused else n for n in names],
            [timed[n]["epoch_seconds"] for n in names],
            color=[MODE_BARS.get(timed[n].get("mode", ""), ("tab:gray",))[0] for n in names],
        )
        title = epoch_time_title(timed)
        ax.set(ylabel="seconds per epoch", title=title)
        _save(fig, output / "epoch_time.png", title)
        plt.close(fig)
        written.append(("epoch_time.png", title))
    curves = {n: m["val_curve"] for n, m in results.items() if m.get("val_curve")}
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for n, curve in curves.items():
            ax.plot([t for t, _ in curve], [a for _, a in curve], marker="o", label=n)
        title = "time to accuracy"
        ax.set(xlabel="seconds since the stage started", ylabel="best val accuracy so far", title=title)
        ax.legend()
        _save(fig, output / "time_to_accuracy.png", title)
        plt.close(fig)
        written.append(("time_to_accuracy.png", title))
    return written


# What a run writes into its run directory (write_run_outputs, the trainers' stages/<name>/ folders).
RUN_FILES = ("summary.json", "report.md", "metrics.jsonl", "recipe.resolved.yaml", "curves.png",
             "epoch_time.png", "time_to_accuracy.png")
RUN_DIRS = ("stages",)


def clear_run_dir(run_dir: Path, *, force: bool) -> None:
    """Make ``run_dir`` ready for a new run, refusing (:class:`OutputError`) where that would overwrite or mix
    with what it holds: another run (unless ``force``: then that run's files and folders are removed,
    nothing else), other files, or a file in its place. A new or empty directory is left as it is."""
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputError(f"--output {run_dir} is a file, not a directory; give a new or empty directory")
    if not run_dir.is_dir():
        return
    held = sorted(p.name for p in run_dir.iterdir())
    if not held:
        return
    ours = set(RUN_FILES) | set(RUN_DIRS)
    earlier = _describe_run(run_dir / "summary.json")
    if earlier is None or not set(held) <= ours:
        others = [name for name in held if name not in ours] or held
        raise OutputError(f"--output {run_dir} is not empty and holds files that are not a run's "
                          f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); give a new or "
                          "empty directory")
    if not force:
        raise OutputError(f"--output {run_dir} holds another run ({earlier}); a run would mix its files "
                          "with that one's: give a new directory, or pass --force to replace that run")
    for name in held:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _describe_run(summary: Path) -> str | None:
    try:
        data = json.loads(summary.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "recipe" not in data:
        return None
    return f"recipe {data.get('recipe')!r}, {data.get('status', '?')}, created {data.get('created', '?')}"


def write_run_outputs(
    output: Path,
    recipe: Any,
    runner: Runner | None,
    reports: list[StageReport],
    seconds: float,
    *,
    store: Path | None = None,
    overrides: Sequence[str] = (),
    skipped: SkippedSamples | None = None,
    failure: Failure | None = None,
) -> dict[str, Any]:
    """summary.json, report.md, recipe.resolved.yaml and plots in ``output``.

    ``runner`` is None when the run failed before its stages were resolved; ``failure`` says how a
    run that did not finish ended.
    """
    results = {r.name: r.metrics for r in reports if r.kind == RESULT and r.metrics}
    targets = runner.graph.targets if runner is not None else []
    primary = next((t for t in reversed(targets) if t in results), None)
    if store is None and runner is not None:
        store = runner.ctx.catalog.root
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
    if failure is not None:
        at = f" in stage {failure.stage}" if failure.stage else ""
        parts[0] = (
            f"{recipe.name}: {failure.status}{at} after {seconds:.1f}s "
            f"({computed} stages computed, {reused} reused before that)"
        )
    parts += [_result_line(name, m) for name, m in results.items()]
    if skipped is not None and skipped.total:
        parts.append(f"{skipped.total} unreadable samples skipped")
    summary_line = "; ".join(parts) + f" -> {output}"
    summary = {
        "recipe": recipe.name,
        "recipe_file": recipe.source,
        "status": failure.status if failure else "finished",
        **({"failure": failure.as_json()} if failure else {}),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
        "store": str(store) if store is not None else None,
        "overrides": list(overrides),
        "versions": versions(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "executable": sys.executable},
        "skipped_samples": (skipped or SkippedSamples()).as_json(),
        "stages": stages,
        "metrics": results.get(primary, {}) if primary else {},
        "results": results,
        "summary_line": summary_line,
    }
    (output / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    (output / "recipe.resolved.yaml").write_text(
        "# The recipe as run: overrides applied, every default written out. `python -m pipeline run` this\n"
        "# file to repeat the run (same fingerprints, so stored results are reused). Each stage's seed is\n"
        "# written out too, so `--set seed=N` on this file changes no stage: set stages.NAME.seed.\n"
        + yaml.safe_dump(recipe.full_dict(), sort_keys=False)
    )
    epochs = _epochs(output / "metrics.jsonl")
    stored = reused_history(reports, runner, epochs)
    if stored:
        with open(output / "metrics.jsonl", "a") as fh:
            fh.writelines(json.dumps(rec, default=float) + "\n" for rec in stored)
        for rec in stored:
            epochs[rec["stage"]].append(rec)
    taken = {r.name for r in reports if r.status == "reused"}
    plots = _plots(output, {k: v for k, v in epochs.items() if k in results or v}, results, taken)
    lines = [
        f"# Run report: {recipe.name}",
        "",
        f"Recipe `{recipe.source}`, {summary['created']}, "
        f"{seconds:.1f} s in all. Store `{summary['store']}`.",
        "",
    ]
    if failure is not None:
        lines += [
            f"**The run {failure.status}**"
            + (f" in stage `{failure.stage}`" if failure.stage else "")
            + f": {failure.error}: {failure.message}",
            "",
        ]
    if overrides:
        lines += ["Overrides: " + ", ".join(f"`--set {o}`" for o in overrides), ""]
    if skipped is not None and skipped.total:
        lines += [
            f"Skipped unreadable samples (on_bad_sample: skip): {skipped.total} ("
            + ", ".join(f"{s['count']} in {s['source']}" for s in skipped.sources) + ")",
            "",
        ]
    lines += [
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
    derived = [s for s in stages if "derived_from" in s.get("metrics", {})]
    if derived:
        lines += ["", "Derived from stored features (only the blocks between the two cuts ran):", ""]
        for s in derived:
            m = s["metrics"]
            source = Derivation.from_meta(m["derived_from"])  # the stream's report holds it as its spec does
            rate = f" ({m['samples_per_s']:.0f} samples/s)" if _number(m.get("samples_per_s")) else ""
            blocks = blocks_run(*source.blocks)
            lines.append(f"- `{s['name']}`: cut {source.train_last_blocks} of `{source.stream}` "
                         f"(`{str(source.fingerprint)[:12]}`), {blocks}: {m['samples']} samples in "
                         f"{m['seconds']:.2f} s{rate}")
    extended = [s for s in stages if "extended_from" in s.get("metrics", {})]
    if extended:
        lines += ["", "Extended from a stored entry (only the new samples were computed):", ""]
        for s in extended:
            m = s["metrics"]
            moved = f", {m['relabelled']} kept with another label" if m.get("relabelled") else ""
            lines.append(f"- `{s['name']}`: from `{str(m['extended_from'])[:12]}`: +{m['new']} new, "
                         f"-{m['removed']} removed, {m['reused']} reused{moved}; {m['computed_seconds']:.2f} "
                         f"s upstream on the new samples, {s['seconds']:.2f} s in all")
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
                f"| {name}{' (reused)' if name in taken else ''} | {m.get('mode', m.get('variant', '-'))} | "
                f"{m.get('bits', '-')} | {cell(m.get('accuracy'), '.4f')} | {cell(best_val, '.4f')} | "
                f"{cell(m.get('epoch_seconds'), '.3f')} | {cell(training_seconds(m), '.1f')} | "
                f"{_human(m['cache_bytes']) if _number(m.get('cache_bytes')) else '-'} |"
            )
        if taken & set(results):
            lines += ["", "(reused): trained by an earlier run with the same fingerprint and taken from the "
                      "store; its accuracy, times and curves are that training's."]
    lines += [""] + [f"![{title}]({name})" for name, title in plots] + ["", summary_line, ""]
    (output / "report.md").write_text("\n".join(lines))
    return summary
