"""Every candidate checked and its training memory metered before anything trains.

The memory is the analytic footprint ``python -m pipeline memory`` prints (weights, gradients,
optimizer state and the activations backward keeps, one step at the trainer's batch size): it
needs the resolved specs only, no pretrained backbone, no cache, no training. A candidate whose
overrides do not make a valid recipe is bad input (the error names it); one whose settings do
not fit together (a method that needs inverted residual blocks above a cut that has none) is
left out with the reason, as is one over the memory budget.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelError, PipelineError, RecipeError, StageError
from ..methods.finetune import Finetune
from ..recipe import Recipe
from ..resolve import load_recipe, resolve_recipe, run_context
from ..spec import Spec
from .space import Candidate


@dataclass
class Metered:
    candidate: Candidate
    memory_bytes: int | None = None  # analytic training memory of one step (None: not valid)
    excluded: str | None = None  # why it never trains (invalid, over the memory budget)


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def candidate_recipe(recipe: str | Path | Recipe, candidate: Candidate, target: str,
                     extra: dict[str, Any] | None = None) -> Recipe:
    """The recipe with the candidate's overrides, training only ``target``; a bad value names it."""
    overrides = {**candidate.overrides, "targets": [target], **(extra or {})}
    try:
        return load_recipe(recipe, overrides)
    except RecipeError as exc:
        raise RecipeError(f"candidate {candidate.id} ({candidate.describe()}): {exc}") from None


def _footprint_key(trainer: Finetune, specs: dict[str, Spec]) -> str:
    """What a trainer's footprint depends on: its settings, the backbone, and what it reads (the cut
    and feature shape, or the image resolution), but not the bits of a cache: candidates that differ
    only in those are metered once."""
    refs = trainer.input_refs()
    model, data = specs[refs["model"]], specs[refs.get("features") or refs["images"]]
    cut = data.cut
    where = [cut.train_last_blocks, list(cut.feature_shape)] if cut is not None else data.resolution
    return json.dumps([trainer.to_config(), repr(model.model), model.num_classes, data.num_classes, where],
                      sort_keys=True, default=str)


def meter_candidates(
    recipe: str | Path | Recipe, candidates: list[Candidate], target: str, *, max_memory: int,
    store: str | Path | None = None, log: Callable[[str], None] = print,
) -> list[Metered]:
    """Each candidate validated and metered; those that cannot run or that exceed ``max_memory`` excluded.

    Every candidate's recipe is loaded first, so a wrong value fails before any is metered.
    """
    recipes = [candidate_recipe(recipe, c, target) for c in candidates]
    out = []
    seen: dict[str, int] = {}  # footprint key -> total bytes
    for i, (candidate, resolved) in enumerate(zip(candidates, recipes, strict=True)):
        metered = Metered(candidate)
        trainer = resolved.stages[target]
        assert isinstance(trainer, Finetune)
        try:
            # The resolve pass validate, plan and run make (pipeline/resolve.py), for this candidate.
            runner = resolve_recipe(resolved, context=run_context(resolved, store=store, quiet=True)).runner
            key = _footprint_key(trainer, runner.specs)
            if key not in seen:
                seen[key] = trainer.footprint_from_specs(runner.specs, runner.ctx, measure=False).total_bytes
        except (ModelError, StageError) as exc:
            metered.excluded = f"invalid: {str(exc).splitlines()[0]}"
        except PipelineError as exc:
            # Not a combination that does not fit (left out above) but a recipe no candidate can run
            # (data that is not there, a graph that does not hold): bad input, refused before any training.
            raise type(exc)(f"candidate {candidate.id} ({candidate.describe()}): {exc}") from None
        else:
            metered.memory_bytes = seen[key]
            if seen[key] > max_memory:
                metered.excluded = f"memory {mib(seen[key])} > budget {mib(max_memory)}"
        log(f"[meter {i + 1}/{len(candidates)}] {candidate.id} {candidate.describe()}: "
            + (mib(metered.memory_bytes) if metered.memory_bytes is not None else "invalid"))
        out.append(metered)
    return out
