"""A sweep's grid: ``--grid KEY=V1,V2,...`` texts parsed, checked against the recipe, and crossed.

Keys are the dotted field paths ``--set`` takes (``stages.two_stage.train.lr``). Values are YAML, as
``--set`` parses them, separated by the commas that stand outside brackets, braces and quotes, so a
list or mapping value is written as YAML's flow style::

    --grid stages.two_stage.train.lr=0.001,0.01,0.1          # three floats
    --grid targets=[two_stage],[baseline,two_stage]          # two lists
    --grid "stages.two_stage.method={name: tinytl},vanilla"  # a mapping and a string
    --grid "stages.x.note='a,b',c"                           # a comma inside a value: quote it

Everything here is checked before any work: an unknown key (with the nearest name), an empty value
list or an empty value, a key given twice (or also given to ``--set``), a value given twice, and
``--random N`` larger than the grid, which is clamped to the whole grid with a note (sampling every
variant of a grid is running it).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from ..errors import RecipeError, did_you_mean
from ..recipe import load_yaml
from ..resolve import _yaml_value  # the one writer of --set values from Python data

_OPEN, _CLOSE = "[{", "]}"


class GridError(RecipeError):
    """A ``--grid`` (or ``--random``) the sweep cannot run: exit 2 before any work."""


@dataclass(frozen=True)
class Axis:
    """One swept field: its dotted key, its values, and each value as the ``--set`` text it came from."""

    key: str
    values: tuple[Any, ...]
    texts: tuple[str, ...]

    def override(self, i: int) -> str:
        return f"{self.key}={self.texts[i]}"


def split_values(text: str) -> list[str]:
    """``1,[2,3],'a,b'`` -> ``['1', '[2,3]', "'a,b'"]``: commas inside brackets or quotes do not split."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def parse_axis(text: str) -> Axis:
    """``KEY=V1,V2,...`` as an :class:`Axis` (the key is checked against a recipe by :func:`check_keys`)."""
    if "=" not in text:
        raise GridError(f"--grid {text!r}: expected KEY=V1,V2,... (e.g. stages.two_stage.train.lr=0.01,0.1)")
    key, raw = (s.strip() for s in text.split("=", 1))
    if not key or not all(key.split(".")):
        raise GridError(f"--grid {text!r}: the key {key!r} is not a dotted field path like "
                        "stages.two_stage.train.lr")
    if not raw:
        raise GridError(f"--grid {text!r}: no values after '='; give one or more, separated by commas")
    texts = split_values(raw)
    values = []
    for n, value_text in enumerate(texts, 1):
        if not value_text:
            raise GridError(f"--grid {text!r}: value {n} is empty (two commas in a row, or one at an end); "
                            "to sweep over an empty string, write ''")
        try:
            values.append(load_yaml(value_text))
        except yaml.YAMLError as exc:
            raise GridError(f"--grid {text!r}: value {n} ({value_text!r}) is not valid YAML: "
                            f"{str(exc).splitlines()[0]}") from None
    seen: dict[str, str] = {}
    for value, value_text in zip(values, texts, strict=True):
        canonical = yaml.safe_dump(value, default_flow_style=True)
        if canonical in seen:
            raise GridError(f"--grid {text!r}: the value {value_text!r} is given twice (as "
                            f"{seen[canonical]!r} before): each variant would be run twice")
        seen[canonical] = value_text
    return Axis(key, tuple(values), tuple(texts))


def axes_from(grid: Sequence[str] | Mapping[str, Iterable[Any]]) -> list[Axis]:
    """Axes from ``--grid`` texts, or from ``{key: [values]}`` (the Python API), in the order given."""
    if isinstance(grid, Mapping):
        axes = []
        for key, values in grid.items():
            if isinstance(values, str | bytes) or not isinstance(values, Iterable):
                raise GridError(f"grid[{key!r}]: expected a list of values, got {values!r}")
            texts = [_yaml_value(str(key), v) for v in values]
            if not texts:
                raise GridError(f"grid[{key!r}]: the list of values is empty")
            # Flow style, so split_values gives back exactly these texts.
            axes.append(parse_axis(f"{key}=" + ",".join(texts)))
    else:
        if isinstance(grid, str):
            grid = [grid]
        axes = [parse_axis(text) for text in grid]
    if not axes:
        raise GridError("the grid is empty: give at least one --grid KEY=V1,V2,...")
    keys: dict[str, int] = {}
    for n, axis in enumerate(axes):
        if axis.key in keys:
            raise GridError(f"--grid {axis.key}: the key is given twice; put all its values in one --grid "
                            f"{axis.key}=V1,V2,...")
        for other in keys:
            if other.startswith(axis.key + ".") or axis.key.startswith(other + "."):
                raise GridError(f"--grid {axis.key} and --grid {other} overlap (one is inside the other): "
                                "sweep one of them")
        keys[axis.key] = n
    return axes


def check_keys(axes: Sequence[Axis], full: Mapping[str, Any], overrides: Sequence[str] = ()) -> None:
    """Every key names a field of the recipe (``full``: its ``full_dict()``, every default written out),
    and none is also given to ``--set``."""
    set_keys = {text.split("=", 1)[0].strip() for text in overrides}
    for axis in axes:
        if axis.key in set_keys:
            raise GridError(f"--grid {axis.key} is also given as --set {axis.key}=...: a key is either fixed "
                            "or swept; drop one")
        node: Any = full
        parts = axis.key.split(".")
        for depth, part in enumerate(parts):
            where = ".".join(parts[:depth]) or "the recipe"
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise GridError(f"--grid {axis.key}: {where} is a list of {len(node)}; expected an index "
                                    f"0..{len(node) - 1}, found {part!r}")
                node = node[int(part)]
            elif isinstance(node, Mapping):
                if part not in node:
                    names = sorted(str(k) for k in node)
                    raise GridError(
                        f"--grid {axis.key}: {where} has no field {part!r}{did_you_mean(part, names)}; "
                        f"its fields: {', '.join(names)}"
                    )
                node = node[part]
            else:
                raise GridError(f"--grid {axis.key}: {where} is a value ({node!r}), not a mapping with "
                                f"a field {part!r}")


def axes_of_points(points: Sequence[Mapping[str, Any]]) -> tuple[list[Axis], list[tuple[int, ...]]]:
    """(axes, one value index per axis for each point) of explicit variants (``{key: value}`` each,
    all with the same keys), so they run as a sweep runs its grid's points: a search that picks its
    variants itself (``choose``'s rungs) gets the sweep's planning, records and executors."""
    if not points:
        raise GridError("no variants given: the list of points is empty")
    keys = list(points[0])
    if not keys:
        raise GridError("point 1 sets no key: give each variant its {key: value} overrides")
    texts: dict[str, list[str]] = {key: [] for key in keys}
    values: dict[str, list[Any]] = {key: [] for key in keys}
    combos = []
    for n, point in enumerate(points, 1):
        if set(point) != set(keys):
            raise GridError(f"point {n} sets {sorted(point)}, point 1 {sorted(keys)}: every point sets the "
                            "same keys")
        combo = []
        for key in keys:
            text = _yaml_value(str(key), point[key])
            if text not in texts[key]:
                texts[key].append(text)
                values[key].append(point[key])
            combo.append(texts[key].index(text))
        combos.append(tuple(combo))
    axes = [Axis(key, tuple(values[key]), tuple(texts[key])) for key in keys]
    if len(set(combos)) < len(combos):
        raise GridError("two points set the same values: each variant would be run twice")
    return axes, combos


def combinations(axes: Sequence[Axis]) -> list[tuple[int, ...]]:
    """Every variant of the cross product, as one value index per axis, the first axis slowest."""
    return list(itertools.product(*(range(len(a.values)) for a in axes)))


def sample(
    combos: list[tuple[int, ...]], n: int | None, seed: int, *, note: Any = None
) -> list[tuple[int, ...]]:
    """``n`` distinct variants drawn with ``seed`` (kept in grid order), or all of them (``n`` None).

    ``n`` larger than the grid runs the whole grid; ``note`` (a callable) hears why.
    """
    if n is None:
        return combos
    if n < 1:
        raise GridError(f"--random {n}: expected a number of variants >= 1")
    if n >= len(combos):
        if n > len(combos) and note is not None:
            note(f"note: --random {n} asks for more variants than the grid has ({len(combos)}): "
                 "running all of them")
        return combos
    picked = sorted(random.Random(seed).sample(range(len(combos)), n))
    return [combos[i] for i in picked]
