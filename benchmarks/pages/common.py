"""What every section of the results page is built from: the result and rendered-section types, number
formatting for tables, and plotting helpers. A module per benchmark (beside this one in ``benchmarks.pages``)
renders its result's section from these; ``benchmarks.results_page`` assembles the page."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import matplotlib

# The page is built headless (CI, SSH sessions); pin the non-interactive backend before anything draws.
matplotlib.use("Agg")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

# Fields every result has (written by _meta.write_result) or that are rendered in their own block.
META_KEYS = ("name", "created", "git_commit", "machine", "command", "question", "headline")
CHECK_KEYS = ("targets", "bar", "findings")
DASH = "–"


# --------------------------------------------------------------------------------------------- formatting


def sig(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits in fixed notation (no 1.59e+03 in a table)."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(x)))
    if magnitude < -4:
        return f"{x:.{digits}g}"
    decimals = max(0, digits - 1 - magnitude)
    text = f"{x:.{decimals}f}"
    # Rounding can carry into a new digit (9.996 -> "10.00"); one decimal fewer keeps 3 significant digits.
    if decimals and len(text.replace("-", "").replace(".", "").lstrip("0")) > digits:
        text = f"{x:.{decimals - 1}f}"
    # A value that is exact at this precision (a threshold of 50, a k of 0.01) reads better without
    # padding zeros; measured values keep them, so a column of them lines up.
    if "." in text and float(text) == x:
        text = text.rstrip("0").rstrip(".")
    return text


def num(x: Any) -> str:
    """Any scalar for a table cell: ints exact (grouped), floats to 3 significant digits."""
    if x is None:
        return DASH
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}" if abs(x) >= 10_000 else str(x)
    if isinstance(x, float):
        return sig(x)
    return cell(x)


def nbytes(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return num(n)
    value, unit = float(n), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, next_unit
    if unit == "B":
        return f"{int(n)} B" if float(n).is_integer() else f"{sig(value)} B"
    return f"{sig(value)} {unit}"


def pct(fraction: Any) -> str:
    return f"{sig(100 * fraction)}%" if isinstance(fraction, (int, float)) else num(fraction)


def acc(mean: Any, std: Any = None) -> str:
    """Accuracy in percent with two decimals: rows of Table 4 differ by tenths of a point, so 3 significant
    digits (91.5) would hide the differences the table exists to show."""
    if not isinstance(mean, (int, float)):
        return num(mean)
    text = f"{100 * mean:.2f}"
    if isinstance(std, (int, float)):
        text += f" ± {100 * std:.2f}"
    return text


def times(x: Any) -> str:
    return f"{sig(x)}×" if isinstance(x, (int, float)) and not isinstance(x, bool) else num(x)


def cell(x: Any, limit: int = 80) -> str:
    """A value that is not a plain number, as compact single-line text safe inside a Markdown table."""
    if isinstance(x, (dict, list)):
        if not x:
            text = "(none)"
        elif isinstance(x, list) and all(
            isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in x
        ):
            text = ", ".join(num(v) if not isinstance(v, str) else v for v in x)
        else:
            text = json.dumps(x, sort_keys=True, default=str)
    else:
        text = str(x)
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def by_key(key: str, value: Any, limit: int = 80) -> str:
    """Format a value of an unknown result from its key name: sizes as bytes, accuracies as percent."""
    lowered = key.lower()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "bytes" in lowered and "per_element" not in lowered:
            return nbytes(value)
        if "accuracy" in lowered and 0 <= value <= 1:
            return pct(value)
    return num(value) if not isinstance(value, (str, dict, list)) else cell(value, limit)


def looks_numeric(text: str) -> bool:
    return text == DASH or (bool(text) and (text[0].isdigit() or (text[0] in "-+" and text[1:2].isdigit())))


def table(header: list[str], rows: Iterable[list[str]], align: list[str] | None = None) -> list[str]:
    """A Markdown table; ``align`` per column is 'l' or 'r'. By default a column is right-aligned when
    all its cells are numbers, so digits line up and text stays readable."""
    rows = list(rows)
    if align is None:
        align = [
            "r"
            if rows and all(looks_numeric(r[i]) for r in rows) and any(r[i] != DASH for r in rows)
            else "l"
            for i in range(len(header))
        ]
    lines = [
        "| " + " | ".join(h.replace("|", "\\|") for h in header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dicts as dotted keys; lists and scalars are leaves."""
    if isinstance(value, dict):
        items: list[tuple[str, Any]] = []
        for key, sub in value.items():
            items += flatten(sub, f"{prefix}.{key}" if prefix else str(key))
        return items
    return [(prefix, value)]


def list_of_records(value: Any) -> TypeGuard[list[dict[str, Any]]]:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def keyed_records(value: Any) -> TypeGuard[dict[str, dict[str, Any]]]:
    """A dict of dicts ({"local": {...}, "dask_1x1": {...}}): one record per key, best read as a table."""
    return (
        isinstance(value, dict) and len(value) >= 2 and all(isinstance(v, dict) and v for v in value.values())
    )


# ---------------------------------------------------------------------------------------------- model


@dataclass
class Result:
    path: Path
    data: dict[str, Any]

    @property
    def key(self) -> str:
        # The file name, not the "name" field: file names are unique in a directory, names need not be.
        return self.path.stem

    @property
    def name(self) -> str:
        name = self.data.get("name")
        return name if isinstance(name, str) and name else self.key


@dataclass
class Check:
    name: str
    value: Any
    kind: str  # "target" (a bar the benchmark must meet) or "finding" (a claim from a paper, checked)


@dataclass
class Rendered:
    """What a renderer returns; provenance, checks and plot files are added by the page builder."""

    title: str
    headline: str
    body: list[str]
    question: str | None = None
    figures: list[tuple[str, str, Figure]] = field(default_factory=list)  # (file suffix, caption, figure)
    images: list[tuple[str, Path]] = field(default_factory=list)  # existing image files to show
    checks: list[Check] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)  # extra commands (beside the top-level one)
    # False for a result kept as the record of a decision whose benchmark script is gone: its command is
    # shown as provenance but not offered as a way to rerun it.
    rerunnable: bool = True


# ------------------------------------------------------------------------------------------- plotting


def new_figure(width: float = 7.0, height: float = 3.6) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def rows_of(data: dict[str, Any], key: str = "rows") -> list[dict[str, Any]]:
    rows = data.get(key)
    if not list_of_records(rows):
        raise ValueError(f"expected a non-empty list of records in {key!r}")
    return rows


def grouped_bars(
    ax: Any, groups: list[str], series: list[tuple[str, list[float]]], log: bool = False
) -> None:
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks(range(len(groups)), groups)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(series), frameon=False)


def span(values: list[float], fmt: Callable[[Any], str]) -> str:
    low, high = min(values), max(values)
    return fmt(low) if fmt(low) == fmt(high) else f"{fmt(low).rstrip('×%')}–{fmt(high)}"


def signed_pct(fraction: Any) -> str:
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool):
        return num(fraction)
    return ("+" if fraction >= 0 else "") + pct(fraction)
