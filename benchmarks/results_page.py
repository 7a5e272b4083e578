"""One results page: ``benchmarks/README.md`` and its plots, built from every JSON in ``benchmarks/results/``.

Usage: python -m benchmarks.results_page [--results DIR] [--output FILE] [--plots DIR] [--discussion FILE]
[--strict]

Every result file is written by ``benchmarks._meta.write_result``, so each carries ``name``, ``created``,
``git_commit``, ``machine`` and ``command`` beside its own payload. Each benchmark renders its own section:
a module in ``benchmarks.pages`` names the results it renders (``RESULTS``) and picks their main numbers,
a headline and plots (``render``); this module only finds those modules, renders every result with its
own (any other JSON, a new benchmark this page has never seen, gets the generic section: its scalars, its
``targets``/``findings`` and every list of records as a table) and assembles the page: headline table,
the hand-written reading of the results by method (``benchmarks/discussion.md``, copied verbatim), commands,
provenance and checks. A new benchmark can set a top-level ``"headline"`` string to fill its line
of the headline table without a module of its own.

The page is deterministic: files are processed in sorted order, tables keep each result's own row
order, PNGs carry no timestamp or software stamp, and files are only rewritten when their bytes
change, so rerunning without new results leaves ``git status`` clean.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks import pages
from benchmarks.pages.common import (
    CHECK_KEYS,
    DASH,
    Check,
    Figure,
    Rendered,
    Result,
    by_key,
    cell,
    flatten,
    nbytes,
    table,
)
from benchmarks.pages.generic import render_generic

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_RESULTS = BENCH_DIR / "results"
DEFAULT_OUTPUT = BENCH_DIR / "README.md"
# Hand-written reading of the results, by method (the tables that matter, how they were taken, what they
# show); copied verbatim after the headline table, since a generated page has nowhere else to keep prose.
DEFAULT_DISCUSSION = BENCH_DIR / "discussion.md"
PLOTS_SUBDIR = "plots"

Renderer = Callable[[Result, Path], Rendered]


@cache
def renderers() -> dict[str, Renderer]:
    """Result name -> its section's renderer: every module in ``benchmarks.pages`` with ``RESULTS``."""
    found: dict[str, Renderer] = {}
    for info in sorted(pkgutil.iter_modules(pages.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{pages.__name__}.{info.name}")
        for name in getattr(module, "RESULTS", ()):
            if name in found:
                raise RuntimeError(f"two modules in benchmarks.pages render {name!r}; one must drop it")
            found[name] = module.render
    return found


def anchor(text: str) -> str:
    """GitHub's heading anchor for a heading made only of ``text``."""
    return "".join(c for c in text.lower().replace(" ", "-") if c.isalnum() or c in "-_")


@cache
def gpu_commands() -> dict[str, str]:
    """CPU result name -> the command measuring its GPU counterpart (``GPU_COMMANDS`` of the page modules),
    so the headline says what is still to be measured on a GPU, and how."""
    found: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(pages.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{pages.__name__}.{info.name}")
        found.update(getattr(module, "GPU_COMMANDS", {}))
    return found


def checks_of(data: dict[str, Any]) -> list[Check]:
    """``targets`` and ``bar`` are the issue's bars; ``findings`` are paper claims the benchmark checks."""
    checks = []
    for key in CHECK_KEYS:
        block = data.get(key)
        if isinstance(block, dict):
            kind = "finding" if key == "findings" else "target"
            checks += [Check(name, value, kind) for name, value in flatten(block)]
        elif isinstance(block, bool):
            checks.append(Check(key, block, "target"))
    return checks


def status(checks: list[Check]) -> str:
    targets = [c.value for c in checks if c.kind == "target" and isinstance(c.value, bool)]
    findings = [c.value for c in checks if c.kind == "finding" and isinstance(c.value, bool)]
    if targets:
        met = sum(targets)
        return (
            f"met ({met}/{len(targets)})"
            if met == len(targets)
            else f"**not met** ({met}/{len(targets)} met)"
        )
    if findings:
        return f"findings hold: {sum(findings)}/{len(findings)}"
    return "no target"


# ------------------------------------------------------------------------------------------ the page


@dataclass
class Section:
    result: Result
    rendered: Rendered
    checks: list[Check]
    plots: list[tuple[str, Path]]  # (caption, png path)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def load_results(results_dir: Path) -> tuple[list[Result], list[tuple[Path, str]]]:
    """Every ``*.json`` in ``results_dir``, sorted by file name; malformed files come back as problems."""
    results, problems = [], []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            problems.append((path, f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"))
            continue
        except (OSError, UnicodeDecodeError) as exc:
            problems.append((path, f"cannot be read ({exc})"))
            continue
        if not isinstance(data, dict):
            problems.append((path, f"top level is a JSON {type(data).__name__}, expected an object"))
            continue
        results.append(Result(path, data))
    return results, problems


def render_result(result: Result, results_dir: Path) -> Rendered:
    renderer = renderers().get(result.name)
    if renderer is not None:
        try:
            return renderer(result, results_dir)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as exc:
            # A result of a known type whose layout changed must still be published, not crash the page.
            warn(
                f"{result.path}: the {result.name!r} renderer could not read it "
                f"({type(exc).__name__}: {exc}); using the generic renderer"
            )
    return render_generic(result)


def save_png(fig: Figure, path: Path) -> None:
    buf = io.BytesIO()
    fig.tight_layout()
    # No "Software" stamp: a matplotlib upgrade alone should not change every committed plot.
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    write_if_changed(path, buf.getvalue())


def write_if_changed(path: Path, content: bytes) -> bool:
    """Atomic write, skipped when the bytes are identical, so reruns leave files (and mtimes) alone."""
    if path.is_file() and path.read_bytes() == content:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)
    return True


def machine_line(machine: Any) -> str:
    if not isinstance(machine, dict):
        return "not recorded"
    parts = [cell(machine.get("cpu", "unknown CPU"))]
    if isinstance(machine.get("cpu_count"), int):
        parts.append(f"{machine['cpu_count']} cores")
    if isinstance(machine.get("memory_bytes"), (int, float)):
        parts.append(f"{nbytes(machine['memory_bytes'])} memory")
    for key, label in (
        ("machine", ""),
        ("platform", ""),
        ("python", "Python "),
        ("torch_threads", "torch threads "),
        ("load_average", "load average "),
    ):
        if machine.get(key) is not None:
            parts.append(f"{label}{cell(machine[key])}")
    return ", ".join(parts)


def gpu_line(data: dict[str, Any]) -> str:
    """The GPU first, for a result measured on one (the CPU line that follows is its host's)."""
    gpu = gpu_name(data)
    device = data.get("device") if isinstance(data.get("device"), dict) else {}
    cuda = device.get("cuda") or data.get("cuda")
    return f"GPU {cell(gpu)}" + (f" (CUDA {cell(cuda)})" if cuda else "") + ", host: " if gpu else ""


def versions_line(machine: Any) -> str:
    versions = machine.get("versions") if isinstance(machine, dict) else None
    if not isinstance(versions, dict) or not versions:
        return "not recorded"
    installed = [f"{name} {cell(v)}" for name, v in versions.items() if v is not None]
    return ", ".join(installed) or "not recorded"


def commands_of(section: Section) -> list[str]:
    command = section.result.data.get("command")
    commands = [command] if isinstance(command, str) and command else []
    return commands + [c for c in section.rendered.commands if c not in commands]


def rel(path: Path, base: Path) -> str:
    return Path(os.path.relpath(path, base)).as_posix()


def build_sections(results: list[Result], results_dir: Path, plots_dir: Path) -> list[Section]:
    sections = []
    for result in results:
        rendered = render_result(result, results_dir)
        plots = []
        for suffix, caption, fig in rendered.figures:
            path = plots_dir / f"{result.key}_{suffix}.png"
            save_png(fig, path)
            plots.append((caption, path))
        plots += rendered.images
        sections.append(Section(result, rendered, checks_of(result.data) + rendered.checks, plots))
    return sections


def section_markdown(section: Section, base: Path) -> list[str]:
    result, rendered = section.result, section.rendered
    data = result.data
    lines = [f"## {result.key}", "", f"**{cell(rendered.title, 200)}**", ""]
    question = data.get("question") if isinstance(data.get("question"), str) else rendered.question
    lines += [f"*Question:* {cell(question, 400) if question else 'not recorded'}", ""]
    lines += rendered.body + [""]
    for caption, path in section.plots:
        lines += [f"![{caption}]({rel(path, base)})", ""]
    targets = [c for c in section.checks if c.kind == "target"]
    findings = [c for c in section.checks if c.kind == "finding"]
    met = [c for c in targets if isinstance(c.value, bool)]
    if met:
        lines += [f"**Targets:** {status(targets)}", ""]
        lines += table(
            ["target", "result"],
            [[cell(c.name, 200), "met" if c.value else "**not met**"] for c in met],
            ["l", "l"],
        )
        lines.append("")
    thresholds = [c for c in targets if not isinstance(c.value, bool)]
    if thresholds:
        # Numbers inside "targets" are the bars themselves (or a paper's reference), not outcomes.
        lines += [
            "Thresholds and references: "
            + "; ".join(f"{cell(c.name)} = {by_key(c.name, c.value)}" for c in thresholds),
            "",
        ]
    if findings:
        lines += ["**Findings:**", ""]
        lines += table(
            ["finding", "result"],
            [
                [
                    cell(c.name, 200),
                    ("holds" if c.value else "**does not hold**")
                    if isinstance(c.value, bool)
                    else by_key(c.name, c.value),
                ]
                for c in findings
            ],
            ["l", "l"],
        )
        lines.append("")
    settings = data.get("settings")
    if isinstance(settings, dict) and settings:
        lines += ["<details><summary>Settings</summary>", ""]
        lines += table(
            ["setting", "value"], [[cell(k), by_key(k, v, 300)] for k, v in flatten(settings)], ["l", "l"]
        )
        lines += ["", "</details>", ""]
    commands = commands_of(section)
    lines += [
        f"- Machine: {gpu_line(data)}{machine_line(data.get('machine'))}",
        f"- Versions: {versions_line(data.get('machine'))}",
        f"- Date: {cell(data.get('created', 'not recorded'))}",
        f"- Git commit: {cell(data.get('git_commit') or 'not recorded')}",
    ]
    if commands:
        lines += ["- Command: " + "; ".join(f"`{c}`" for c in commands)]
    else:
        lines += ["- Command: not recorded"]
    lines += [f"- Source: [{result.path.name}]({rel(result.path, base)})", ""]
    return lines


def page(
    sections: list[Section],
    problems: list[tuple[Path, str]],
    results_dir: Path,
    output: Path,
    discussion: str = "",
) -> str:
    base = output.parent
    count = len(sections)
    lines = [
        "# Benchmark results",
        "",
        f"Generated from {count} result{'s' if count != 1 else ''} in "
        f"[`{rel(results_dir, base)}/`]({rel(results_dir, base)}/) by `python -m benchmarks.results_page`; "
        "do not edit by hand. Every number below is read from a JSON file that records the machine, library "
        "versions, date, git commit and the command that produced it.",
        "",
        "## Headline",
        "",
    ]
    lines += headline_table(sections)
    if discussion.strip():
        lines += ["", discussion.strip()]
    lines += [
        "",
        "## Regenerate",
        "",
        "This page and its plots (in `" + rel(results_dir / PLOTS_SUBDIR, base) + "/`):",
        "",
        "```bash",
        "python -m benchmarks.results_page",
        "```",
        "",
        "Rerun a benchmark (each writes its JSON into the results directory), then regenerate:",
        "",
        "```bash",
    ]
    for s in sections:
        commands = commands_of(s) if s.rendered.rerunnable else ["# (a record only: its script was removed)"]
        lines += [f"# {s.result.key}"] + (commands or ["# (command not recorded)"])
    lines += ["```", ""]
    if problems:
        lines += ["## Skipped files", ""]
        lines += [f"- `{path.name}`: {cell(reason, 300)}" for path, reason in problems]
        lines.append("")
    for section in sections:
        lines += section_markdown(section, base)
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- the headline
GPU_SUFFIX = "_cuda"  # benchmarks._device.result_name: a GPU result is its CPU result's name + this


def gpu_name(data: dict[str, Any]) -> str | None:
    """The GPU a result was measured on (``device`` as ``benchmarks._device.device_info`` writes it)."""
    device = data.get("device")
    if isinstance(device, dict) and isinstance(device.get("gpu"), str):
        return device["gpu"]
    return data["gpu"] if isinstance(data.get("gpu"), str) else None


def machine_tag(data: dict[str, Any]) -> str:
    """A short name of the machine that measured a result, for the headline's cells."""
    gpu = gpu_name(data)
    if gpu:
        return gpu
    machine = data.get("machine")
    if not isinstance(machine, dict):
        return "machine not recorded"
    cpu = str(machine.get("cpu") or "unknown CPU")
    cores = machine.get("cpu_count")
    return f"{cpu}, {cores} cores" if isinstance(cores, int) else cpu


def headline_cell(section: Section) -> str:
    result = section.result
    return (f"[{result.key}](#{anchor(result.key)}): {cell(section.rendered.headline, 300)} "
            f"(*{cell(machine_tag(result.data), 80)}*)")


def headline_table(sections: list[Section]) -> list[str]:
    """One row per benchmark: its CPU result and its GPU result side by side, each naming its machine;
    a GPU result still to be measured shows the command that measures it."""
    by_key = {s.result.key: s for s in sections}
    rows = []
    for section in sections:
        key = section.result.key
        if key.endswith(GPU_SUFFIX) and key.removesuffix(GPU_SUFFIX) in by_key:
            continue  # shown beside its CPU result
        gpu_run = by_key.get(key + GPU_SUFFIX)
        if key.endswith(GPU_SUFFIX) or gpu_name(section.result.data):
            cpu_run, gpu_run = None, section
        else:
            cpu_run = section
        if gpu_run is not None:
            gpu = headline_cell(gpu_run)
        elif key in gpu_commands() and not any(k.startswith(key) and k.endswith(GPU_SUFFIX) for k in by_key):
            gpu = f"not measured yet: `{gpu_commands()[key]}`"
        else:
            gpu = DASH
        checks = [("CPU", cpu_run), ("GPU", gpu_run)]
        targets = "; ".join(f"{label}: {status(s.checks)}" for label, s in checks if s is not None)
        dates = sorted(str(s.result.data.get("created", DASH))[:10] for _, s in checks if s is not None)
        rows.append([
            f"{key.removesuffix(GPU_SUFFIX)}",
            headline_cell(cpu_run) if cpu_run is not None else DASH,
            gpu,
            targets,
            cell(dates[-1]),
        ])
    return table(["benchmark", "CPU", "GPU", "targets", "date"], rows, ["l", "l", "l", "l", "l"])


def remove_stale_plots(plots_dir: Path, keep: set[Path]) -> None:
    """The plots directory belongs to this page: a plot whose result (or renderer) is gone is removed,
    so the committed directory always matches the page."""
    if not plots_dir.is_dir():
        return
    for png in sorted(plots_dir.glob("*.png")):
        if png.resolve() not in keep:
            png.unlink()


def generate(
    results_dir: Path, output: Path, plots_dir: Path, discussion: Path | None = None
) -> tuple[int, list[tuple[Path, str]]]:
    """Build the page; returns (number of results rendered, malformed files skipped)."""
    if not results_dir.is_dir():
        raise FileNotFoundError(f"results directory {results_dir} does not exist")
    if discussion is not None and not discussion.is_file():
        raise FileNotFoundError(f"discussion file {discussion} does not exist (--discussion '' for none)")
    prose = discussion.read_text(encoding="utf-8") if discussion is not None else ""
    results, problems = load_results(results_dir)
    for path, reason in problems:
        warn(f"skipping {path}: {reason}")
    sections = build_sections(results, results_dir, plots_dir)
    remove_stale_plots(plots_dir, {p.resolve() for s in sections for _, p in s.plots})
    write_if_changed(output, page(sections, problems, results_dir, output, prose).encode("utf-8"))
    return len(sections), problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.results_page",
        description="Build benchmarks/README.md and its plots from every JSON in benchmarks/results/.",
    )
    parser.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS, help="directory of result JSON files"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="Markdown page to write")
    parser.add_argument(
        "--plots", type=Path, default=None, help=f"directory for PNG plots (default: RESULTS/{PLOTS_SUBDIR})"
    )
    parser.add_argument(
        "--discussion",
        default=str(DEFAULT_DISCUSSION),
        help="hand-written Markdown placed after the headline table ('' for none)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 if any result file is malformed")
    args = parser.parse_args(argv)
    plots_dir = args.plots if args.plots is not None else args.results / PLOTS_SUBDIR
    discussion = Path(args.discussion) if args.discussion else None
    try:
        count, problems = generate(args.results, args.output, plots_dir, discussion)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plural = "" if count == 1 else "s"
    print(f"wrote {args.output} from {count} result{plural} ({len(problems)} skipped), plots in {plots_dir}")
    return 1 if args.strict and problems else 0


if __name__ == "__main__":
    sys.exit(main())
