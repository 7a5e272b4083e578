"""Resolving a recipe: the one pass every command makes before it does any work.

``validate``, ``plan``, ``run``, ``sweep`` (each variant, through ``plan``), ``choose`` (each candidate)
and ``cache_dataset`` all resolve through :func:`resolve_recipe`, so a recipe one of them refuses, all
of them refuse, with the same message. Resolving is:

1. load: a file, dict or :class:`~pipeline.recipe.Recipe`, overrides applied, checked against the
   schema (:func:`load_recipe`); a file's cuts are also checked against their architectures, so the
   error names its line (:func:`load_checked`);
2. graph: every input names a stage of the right kind, no cycle, the targets exist;
3. each stage the targets need resolved by the runner (:class:`~pipeline.runner.Runner`): its output
   spec, fingerprint and lineage. Datasets are materialized on the way (a split needs the labels to
   check its classes, a plan needs sizes): data is read, nothing is written.

It has no side effects of its own: no store entry is written, no run directory made, no threads
installed. Those are the caller's, before or after: ``plan`` and ``run`` pass the context of their
store (:func:`run_context`); without one, the recipe is resolved against a scratch store in a
temporary directory that is removed before :func:`resolve_recipe` returns, so ``validate`` needs no
store at all, writable or not.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import RecipeError
from .recipe import Recipe, apply_overrides, recipe_from_dict, validate_recipe
from .recipe import load_recipe as _load_recipe_file

if TYPE_CHECKING:
    from stores.catalog import Catalog

    from .context import RunContext
    from .runner import PlanRow, Runner

__all__ = ["Resolved", "load_checked", "load_recipe", "resolve_recipe", "run_context"]

RecipeLike = str | Path | Mapping[str, Any] | Recipe
Overrides = Mapping[str, Any] | Sequence[str] | None


# ------------------------------------------------------------------------------------- loading
def _override_texts(overrides: Overrides) -> list[str]:
    """``{"stages.x.y": v}`` or ``["stages.x.y=v"]`` as the ``KEY=VALUE`` texts ``--set`` takes."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [overrides]
    if isinstance(overrides, Mapping):
        texts = []
        for key, value in overrides.items():
            if not isinstance(key, str):
                raise RecipeError(
                    f"overrides: keys are dotted field paths like 'stages.cache.bits', got {key!r}"
                )
            texts.append(f"{key}={_yaml_value(key, value)}")
        return texts
    texts = list(overrides)
    for text in texts:
        if not isinstance(text, str):
            raise RecipeError(f"overrides: expected 'KEY=VALUE' strings, got {text!r}")
    return texts


def _plain(value: Any) -> Any:
    """Tuples as lists (YAML has only sequences); everything else as it is."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _yaml_value(key: str, value: Any) -> str:
    """``value`` as the YAML text ``--set`` parses back to it (one line, flow style)."""
    import yaml

    try:
        text = yaml.safe_dump(_plain(value), default_flow_style=True, width=float("inf"))
    except yaml.YAMLError:
        raise RecipeError(
            f"overrides[{key!r}]: {value!r} is not plain data (expected str, int, float, bool, None, "
            "or lists and dicts of them)"
        ) from None
    return text.removesuffix("\n...\n").rstrip("\n")


def load_recipe(recipe: RecipeLike, overrides: Overrides = None) -> Recipe:
    """A validated recipe from a YAML file, a dict or a :class:`~pipeline.recipe.Recipe`, overrides applied.

    ``overrides`` are what ``--set`` takes on the command line: ``{"stages.cache.bits": 4}`` or
    ``["stages.cache.bits=4"]``. Errors (:class:`~pipeline.errors.RecipeError`) name the file, the
    line or the override, the field and what was expected.

    Example::

        import pipeline

        recipe = pipeline.load_recipe("recipes/quickstart.yaml", {"stages.quantized.bits": 4})
        print(recipe.name, list(recipe.stages))
    """
    texts = _override_texts(overrides)
    if isinstance(recipe, Recipe):
        if not texts:
            return recipe
        data: dict[str, Any] = recipe.resolved_dict()
        touched = apply_overrides(data, texts)
        return recipe_from_dict(data, source=recipe.source, overridden=touched)
    if isinstance(recipe, Mapping):
        data = copy.deepcopy(dict(recipe))
        touched = apply_overrides(data, texts)
        return recipe_from_dict(data, source="<dict>", overridden=touched)
    if isinstance(recipe, str | Path):
        return _load_recipe_file(recipe, texts)
    raise RecipeError(
        f"expected a recipe file path, a dict or a Recipe, got {type(recipe).__name__}: {recipe!r}"
    )


def load_checked(recipe: RecipeLike, overrides: Overrides = None) -> tuple[Recipe, bool]:
    """(the recipe as :func:`load_recipe` gives it, whether its cuts were checked against their backbones).

    A file's cuts are checked here, where its lines are known, so a cut outside its backbone names
    the line (or the ``--set``) that gave it; a dict's or Recipe's are left to the resolve pass, which
    finds the same problem. Without torch nothing is checked against an architecture (False).
    """
    if isinstance(recipe, str | Path):
        return validate_recipe(recipe, _override_texts(overrides))
    return load_recipe(recipe, overrides), False


# ------------------------------------------------------------------------------------ contexts
def run_context(
    recipe: Recipe,
    *,
    store: str | Path | None = None,
    max_bytes: int | None = None,
    output: Path | None = None,
    quiet: bool = False,
    writes: bool = False,
) -> RunContext:
    """The :class:`~pipeline.context.RunContext` a run of ``recipe`` uses (``--store``, ``--max-bytes``).

    ``store`` overrides the recipe's ``store.path`` (then ``$ONDEVICE_TL_STORE``, then the per-user
    cache); ``max_bytes`` overrides ``store.max_bytes``, 0 included. ``writes``: the run will write
    to the store, so a store this user cannot write is refused now (exit 2), before any work.
    """
    from stores.catalog import Catalog

    from .storepath import resolve_store

    root = resolve_store(None if store is None else str(store), recipe.store.path, writable=writes)
    budget = max_bytes if max_bytes is not None else recipe.store.max_bytes
    return _context(recipe, Catalog(root, max_bytes=budget), output=output, quiet=quiet)


def _context(recipe: Recipe, catalog: Catalog, *, output: Path | None, quiet: bool) -> RunContext:
    from .context import RunContext
    from .executors import executor_for
    from .progress import Progress

    try:
        return RunContext(
            catalog=catalog,
            output_dir=output,
            seed=recipe.seed,
            device=recipe.run.device,
            recipe_name=recipe.name,
            recipe_path=recipe.source,
            progress=Progress(quiet=quiet),
            executor=executor_for(recipe),
        )
    except RecipeError as exc:  # run.device names a GPU this machine lacks: say which recipe asks for it
        message = str(exc)
        raise RecipeError(message if message.startswith(recipe.source) else f"{recipe.source}: {message}") \
            from None


# ------------------------------------------------------------------------------------ resolving
@dataclass(frozen=True)
class Resolved:
    """A recipe resolved: its ``runner`` holds each needed stage's spec, fingerprint and call; ``rows``
    are what ``plan`` shows (against the caller's store, or a scratch one: everything to compute)."""

    recipe: Recipe
    runner: Runner
    rows: list[PlanRow]


def resolve_recipe(
    recipe: RecipeLike, overrides: Overrides = None, *, context: RunContext | None = None
) -> Resolved:
    """``recipe`` loaded, checked and resolved, every stage its targets need, with no work done.

    ``context``: the run context to resolve in (``plan``'s and ``run``'s, made by :func:`run_context`
    for the recipe as loaded: pass a :class:`~pipeline.recipe.Recipe`, then, so it is not loaded
    again). Without one, a scratch store in a temporary directory stands in, removed before this
    returns: the :class:`Resolved` then answers questions (specs, fingerprints, plan rows) but is not
    for running. Raises the toolkit's errors, each naming the recipe and the field (``stages.<name>``).
    """
    loaded = recipe if isinstance(recipe, Recipe) and not overrides else load_checked(recipe, overrides)[0]
    if context is not None:
        return _resolved(loaded, context)
    from stores.catalog import Catalog

    with tempfile.TemporaryDirectory(prefix="ondevice-tl-resolve-") as scratch:
        return _resolved(loaded, _context(loaded, Catalog(scratch), output=None, quiet=True))


def _resolved(recipe: Recipe, ctx: RunContext) -> Resolved:
    from .runner import Runner

    runner = Runner(recipe, ctx)  # the graph, then each needed stage's resolve
    return Resolved(recipe, runner, runner.plan())
