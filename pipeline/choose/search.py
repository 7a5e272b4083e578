"""``choose``'s work, start to end: the space, the metering, the halving, the costs.

Everything that can be checked is checked before the first training: the keys, each candidate's
recipe, the memory of each (analytic, no training). The time budget needs a measurement, so it is
applied after rung 0. A budget no candidate meets is a :class:`~pipeline.errors.BudgetError` that
says which constraint excluded what.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BudgetError
from ..methods.finetune import Finetune
from ..recipe import Recipe
from ..resolve import load_recipe, resolve_recipe, run_context
from .halving import Halving, Train, successive_halving, train_candidates
from .meter import Metered, candidate_recipe, meter_candidates, mib
from .space import Candidate, Knobs, build_candidates, find_knobs, pick_target


@dataclass
class ChooseResult:
    recipe: Recipe  # the recipe searched (with --set applied)
    target: str
    knobs: Knobs
    eta: int
    epochs: int  # the recipe's full epochs: the last rung's
    max_memory: int
    max_epoch_seconds: float
    metered: list[Metered]  # every candidate, in order
    halving: Halving
    winner: Recipe  # the recipe with the winner's overrides, training the target only
    metering_seconds: float
    wall_seconds: float

    @property
    def candidates(self) -> list[Candidate]:
        return [m.candidate for m in self.metered]

    @property
    def winner_candidate(self) -> Candidate:
        return next(c for c in self.candidates if c.id == self.halving.winner)

    def cost(self) -> dict[str, Any]:
        """What the search spent: trainings run (and reused), epochs, seconds training and building."""
        trained = [t for rung in self.halving.rungs for t in rung.trained.values()]
        computed = [t for t in trained if t.status == "computed"]
        return {
            "trainings": len(computed),
            "trainings_reused": len(trained) - len(computed),
            "epochs_trained": sum(t.epochs for t in computed),
            "train_seconds": sum(t.train_seconds for t in computed),
            "build_seconds": sum(t.build_seconds for t in trained),
            "built": [f"{t.candidate}-e{t.epochs}: {', '.join(t.built)}" for t in trained if t.built],
            "metering_seconds": self.metering_seconds,
            "wall_seconds": self.wall_seconds,
        }


def _blocks_counter(recipe: Recipe, knobs: Knobs, store: str | Path | None) -> Callable[[str | None], int]:
    """``arch -> number of blocks`` of the backbone the target trains (for the default cuts), resolved
    once per arch from the recipe itself (only the backbone's own stages: no training data read)."""
    seen: dict[str | None, int] = {}

    def count(arch: str | None) -> int:
        if arch not in seen:
            overrides: dict[str, Any] = {"targets": [knobs.backbone]}
            if arch is not None:
                overrides[f"stages.{knobs.backbone}.arch"] = arch
            only = load_recipe(recipe, overrides)
            resolved = resolve_recipe(only, context=run_context(only, store=store, quiet=True))
            spec = resolved.runner.specs[knobs.backbone]
            seen[arch] = spec.model.num_blocks if spec.model is not None else 0
        return seen[arch]

    return count


def _no_fit(metered: list[Metered], max_memory: int) -> BudgetError:
    """Which constraint excluded what, when no candidate is left to train."""
    sized = [m for m in metered if m.memory_bytes is not None]
    invalid = [m for m in metered if m.memory_bytes is None]
    parts = []
    if sized:
        small = min(sized, key=lambda m: m.memory_bytes or 0)
        need = mib(small.memory_bytes or 0)
        parts.append(f"--max-memory {mib(max_memory)} excluded {len(sized)}: the smallest, "
                     f"{small.candidate.id} ({small.candidate.describe()}), needs {need}")
    if invalid:
        reasons = sorted({m.excluded or "" for m in invalid})
        parts.append(f"{len(invalid)} cannot run as set up ({'; '.join(reasons[:3])}"
                     f"{'; ...' if len(reasons) > 3 else ''})")
    return BudgetError(f"no candidate meets the budget: {'; '.join(parts)}")


def choose(
    recipe: str | Path | Recipe, *, max_memory: int, max_epoch_seconds: float,
    space: Mapping[str, list[Any]] | None = None, target: str | None = None, eta: int = 3,
    overrides: Sequence[str] | Mapping[str, Any] | None = None, store: str | Path | None = None,
    output: str | Path = Path("runs/choose"), log: Callable[[str], None] = print,
    train: Train = train_candidates,
) -> ChooseResult:
    """Pick the candidate with the best validation accuracy within the memory and time budgets.

    ``space``: ``{key: values}`` as :func:`~pipeline.choose.space.parse_space` reads ``--space``;
    ``overrides``: ``--set`` texts applied to the recipe first. Raises
    :class:`~pipeline.errors.RecipeError` for bad input and :class:`~pipeline.errors.BudgetError`
    when no candidate meets a budget.
    """
    start = time.perf_counter()
    if eta < 2:
        raise BudgetError(f"--eta must be at least 2 (keep the best 1/eta of each rung), got {eta}")
    if max_memory <= 0 or max_epoch_seconds <= 0:
        raise BudgetError(f"budgets must be positive, got --max-memory {max_memory} bytes and "
                          f"--max-epoch-seconds {max_epoch_seconds:g}")
    base = load_recipe(recipe, overrides)
    target = pick_target(base, target)
    knobs = find_knobs(base, target)
    trainer = base.stages[target]
    assert isinstance(trainer, Finetune)
    candidates = build_candidates(base, knobs, dict(space or {}), _blocks_counter(base, knobs, store))
    log(f"choose {target} of {base.name} ({base.source}): {len(candidates)} candidates; budgets "
        f"{mib(max_memory)} training memory, {max_epoch_seconds:g} s per epoch")
    metered = meter_candidates(base, candidates, target, max_memory=max_memory, store=store, log=log)
    metering_seconds = time.perf_counter() - start
    fitting = [m.candidate for m in metered if m.excluded is None]
    excluded = [m for m in metered if m.excluded is not None]
    log(f"{len(fitting)} of {len(metered)} candidates fit the memory budget"
        + (f"; excluded before training ({len(excluded)}):" if excluded else ""))
    for m in excluded:
        log(f"  {m.candidate.id} {m.candidate.describe()}: {m.excluded}")
    if not fitting:
        raise _no_fit(metered, max_memory)
    epochs = trainer.train.epochs
    # warmup_epochs must stay below a rung's epochs (TrainConfig checks it)
    min_epochs = int(trainer.train.warmup_epochs) + 1
    halving = successive_halving(
        base, fitting, target=target, epochs=epochs, eta=eta, max_epoch_seconds=max_epoch_seconds,
        store=store, output=Path(output), min_epochs=min_epochs, log=log, train=train,
    )
    won = next(c for c in fitting if c.id == halving.winner)
    return ChooseResult(
        recipe=base, target=target, knobs=knobs, eta=eta, epochs=epochs, max_memory=max_memory,
        max_epoch_seconds=max_epoch_seconds, metered=metered, halving=halving,
        winner=candidate_recipe(base, won, target), metering_seconds=metering_seconds,
        wall_seconds=time.perf_counter() - start,
    )
