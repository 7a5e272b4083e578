"""A sweep's variants as recipes, each validated and planned before any work.

:func:`variant_recipes` is the one place the per-variant :class:`~pipeline.recipe.Recipe` objects
are made; a rewrite pass (e.g. deriving the caches of a cut sweep from the deepest cut's) takes that
list and returns another before :func:`plan_sweep` plans it.

The plan of a variant is ``pipeline.plan``'s rows plus what the runner will actually touch: a stored
entry is loaded without pulling its inputs, so only the stages reached from the targets through
entries that are not stored do work (:func:`working_stages`). Across variants, entries are counted
once per fingerprint: that is what the store builds once and every later variant reuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..api import plan
from ..errors import PipelineError
from ..graph import Graph
from ..recipe import Recipe
from ..resolve import RecipeLike, load_checked, load_recipe
from ..runner import PlanRow
from ..spec import MODEL, RESULT, STREAM
from .grid import Axis, GridError, axes_from, axes_of_points, check_keys, combinations, sample

# Stage types that run a frozen bottom over their input stream: what "a frozen forward" counts.
FORWARD_TYPES = frozenset({"frozen_forward"})
# Metrics a trainer reports its validation accuracy under, in order of preference.
VALIDATION_METRICS = ("best_val_accuracy", "exit_val_acc")
MAX_ERRORS_SHOWN = 5

Rewrite = Callable[[list[Recipe]], list[Recipe]]


@dataclass(frozen=True)
class Variant:
    """One point of the grid: its position, the value of each swept key, and its recipe."""

    index: int
    values: dict[str, Any]
    overrides: tuple[str, ...]  # the grid's KEY=VALUE texts for this variant (--set's syntax)
    recipe: Recipe

    @property
    def id(self) -> str:
        return f"{self.index + 1:03d}"

    @property
    def label(self) -> str:
        return ", ".join(self.overrides)


@dataclass
class VariantPlan:
    variant: Variant
    target: str
    target_fingerprint: str
    rows: list[PlanRow]
    working: set[str]  # the stages that will do work (not stored, and needed by something that is not)


@dataclass
class SweepPlan:
    """What the whole sweep will compute and reuse, each entry counted once across variants."""

    variants: list[VariantPlan]
    # category -> fingerprint -> (stage name, id of the first variant that needs it)
    compute: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    reuse: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    # (frozen forward fingerprint, fingerprint of the entry whose build runs it): one pass each
    forward_passes: set[tuple[str, str]] = field(default_factory=set)

    def count(self, category: str, *, stored: bool = False) -> int:
        return len((self.reuse if stored else self.compute).get(category, {}))

    def lines(self) -> list[str]:
        """The plan as the sweep prints it before any work."""
        n = len(self.variants)
        forwards, passes = self.count("forward"), len(self.forward_passes)
        fwd = f"{_counted(forwards, 'frozen forward')} to run (one per distinct upstream)"
        if passes > forwards:
            fwd += (f", in {passes} passes: features are stored quantized, so each of the {passes} cache "
                    "builds runs its upstream's forward")
        if self.count("derivation"):
            fwd += (f", {_counted(self.count('derivation'), 'cut')} derived from a deeper cut's stored "
                    "features (only the blocks between the cuts run)")
        lines = [
            f"{_counted(n, 'variant')}: {fwd}; "
            f"{_counted(self.count('cache'), 'cache build')}, {_counted(self.count('model'), 'backbone')} to "
            f"train, {_counted(self.count('training'), 'training')}",
        ]
        stored = [_counted(self.count(c, stored=True), what) for c, what in (
            ("forward", "frozen forward"), ("derivation", "derived cut"),
            ("cache", "cache"), ("model", "backbone"),
            ("training", "training")) if self.count(c, stored=True)]
        lines.append("already stored, reused: " + (", ".join(stored) if stored else "nothing"))
        return lines

    def as_json(self) -> dict[str, Any]:
        return {
            "variants": len(self.variants),
            "to_compute": {c: len(v) for c, v in self.compute.items()},
            "stored": {c: len(v) for c, v in self.reuse.items()},
            "forward_passes": len(self.forward_passes),
        }


def _counted(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def variant_recipes(
    recipe: RecipeLike,
    grid: Sequence[str] | Mapping[str, Iterable[Any]] | None,
    *,
    points: Sequence[Mapping[str, Any]] | None = None,
    overrides: Sequence[str] = (),
    random: int | None = None,
    seed: int = 0,
    note: Callable[[str], None] | None = None,
) -> tuple[Recipe, list[Axis], list[Variant]]:
    """(the base recipe, the grid's axes, one validated :class:`Variant` per grid point).

    ``points``, instead of a grid: the variants themselves, ``{key: value}`` each (all with the same keys).

    Bad input raises :class:`~pipeline.sweep.grid.GridError` (or the recipe's own error for the base
    recipe) before anything is planned; every variant that does not validate is named.
    """
    base = load_recipe(recipe, list(overrides))
    if (grid is None) == (points is None):
        raise GridError("give a grid (--grid KEY=V1,V2,...) or the points to run, one of the two")
    if points is not None:
        axes, combos = axes_of_points(points)
    else:
        assert grid is not None
        axes = axes_from(grid)
        combos = combinations(axes)
    check_keys(axes, base.full_dict(), overrides)
    picked = sample(combos, random, seed, note=note)
    # A file is loaded again per variant (not the base), as validate, plan and run load it, so errors
    # name its lines and the --grid that set a field (a cut outside its backbone too); a dict or Recipe
    # has no lines to name. Each variant is then resolved when it is planned (plan_sweep).
    from_file = isinstance(recipe, str | Path)
    variants, errors = [], []
    for index, combo in enumerate(picked):
        texts = tuple(axis.override(i) for axis, i in zip(axes, combo, strict=True))
        values = {axis.key: axis.values[i] for axis, i in zip(axes, combo, strict=True)}
        try:
            resolved = (load_checked(recipe, [*overrides, *texts])[0] if from_file
                        else load_recipe(base, texts))
        except PipelineError as exc:
            message = str(exc)
            for axis in axes:  # the recipe names an override's source as --set; these came from a --grid
                message = message.replace(f"(--set {axis.key})", f"(--grid {axis.key})")
            errors.append(f"variant {index + 1:03d} ({', '.join(texts)}): {message}")
            continue
        variants.append(Variant(index, values, texts, resolved))
    _raise_if(errors, len(picked), "do not make valid recipes")
    return base, axes, variants


def apply_rewrite(variants: list[Variant], rewrite: Rewrite | None) -> list[Variant]:
    """The variants with ``rewrite`` applied to their recipes (same order, same count)."""
    if rewrite is None:
        return variants
    recipes = rewrite([v.recipe for v in variants])
    if len(recipes) != len(variants):
        raise ValueError(f"a sweep rewrite returned {len(recipes)} recipes for {len(variants)} variants")
    return [Variant(v.index, v.values, v.overrides, r) for v, r in zip(variants, recipes, strict=True)]


def _raise_if(errors: list[str], total: int, what: str) -> None:
    if not errors:
        return
    shown = errors[:MAX_ERRORS_SHOWN]
    more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
    raise GridError(f"{len(errors)} of the sweep's {total} variants {what}:\n  " + "\n  ".join(shown) + more)


def default_target(recipe: Recipe) -> str | None:
    """The last target that trains (a result), as a run's summary ranks it; None if none does."""
    graph = Graph(recipe)
    trainers = [t for t in graph.targets if recipe.stages[t].kind == RESULT]
    return trainers[-1] if trainers else None


def _walk(
    start: Iterable[str], by_name: Mapping[str, PlanRow], through: Callable[[PlanRow], bool]
) -> set[str]:
    """The stages reached upstream from ``start`` through (and only through) rows ``through`` accepts."""
    reached: set[str] = set()
    seen: set[str] = set()
    stack = list(start)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if through(by_name[name]):
            reached.add(name)
            stack.extend(by_name[name].inputs.values())
    return reached


def working_stages(rows: Sequence[PlanRow], targets: Iterable[str]) -> set[str]:
    """The stages that will do work: reached from the targets through entries that are not stored (a
    stored entry is loaded: its inputs are never pulled)."""
    return _walk(targets, {r.name: r for r in rows}, lambda row: row.action != "reuse")


def category(recipe: Recipe, row: PlanRow) -> str | None:
    stage = recipe.stages[row.name]
    if row.type in FORWARD_TYPES:
        if row.action != "derive":
            return "forward"
        # From stored features at a deeper cut it runs only the blocks between the cuts: none at that
        # cut itself (the deepest variant of a cut sweep reads its own stored features).
        derivation = row.spec.derivation
        return "derivation" if derivation is not None and derivation.ran_blocks else None
    if row.kind == RESULT:
        return "training"
    if stage.cacheable and row.kind == STREAM:
        return "cache"
    if stage.cacheable and row.kind == MODEL:
        return "model"
    return None


def plan_sweep(
    variants: Sequence[Variant], *, store: str | Path | None = None, target: str | None = None
) -> SweepPlan:
    """Plan every variant (fingerprints, what is stored) and count the sweep's work, before any of it."""
    plans: list[VariantPlan] = []
    errors: list[str] = []
    for v in variants:
        name = target or default_target(v.recipe)
        try:
            if name is None:
                targets = ", ".join(Graph(v.recipe).targets)
                raise GridError(f"its targets ({targets}) include no trainer whose validation accuracy "
                                "could rank the variants")
            graph = Graph(v.recipe)
            if name not in graph.targets:
                raise GridError(f"--target {name} is not one of its targets ({', '.join(graph.targets)}); "
                                "name one with --target")
            rows = plan(v.recipe, store=store)  # resolved as validate and run resolve (pipeline/resolve.py)
        except PipelineError as exc:
            errors.append(f"variant {v.id} ({v.label}): {exc}")
            continue
        fingerprint = next(r.fingerprint for r in rows if r.name == name)
        plans.append(VariantPlan(v, name, fingerprint, rows, working_stages(rows, graph.targets)))
    _raise_if(errors, len(variants), "cannot be planned")
    out = SweepPlan(plans)
    for p in plans:
        by_name = {r.name: r for r in p.rows}
        for row in p.rows:
            kind = category(p.variant.recipe, row)
            if kind is None:
                continue
            if row.name in p.working:
                out.compute.setdefault(kind, {}).setdefault(row.fingerprint, (row.name, p.variant.id))
            else:  # needed, yet no work: stored, or (a forward) covered by a stored entry downstream
                out.reuse.setdefault(kind, {}).setdefault(row.fingerprint, (row.name, p.variant.id))
        for name in p.working:
            if p.variant.recipe.stages[name].cacheable:
                for forward in _forwards_pulled(name, by_name, p.variant.recipe):
                    out.forward_passes.add((by_name[forward].fingerprint, by_name[name].fingerprint))
    # A forward both run by one variant and covered by a stored cache in another is counted as run.
    for fp in out.compute.get("forward", {}):
        out.reuse.get("forward", {}).pop(fp, None)
    return out


def _forwards_pulled(name: str, by_name: Mapping[str, PlanRow], recipe: Recipe) -> list[str]:
    """The frozen forwards the build of entry ``name`` runs: upstream through streams, up to entries (a
    stored one, or one counted as its own build) and models."""

    def stream(row: PlanRow) -> bool:
        return row.kind == STREAM and not recipe.stages[row.name].cacheable

    return sorted(n for n in _walk(by_name[name].inputs.values(), by_name, stream)
                  if category(recipe, by_name[n]) == "forward")  # not a derivation from stored features
