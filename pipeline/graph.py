"""The recipe as a graph: references checked, order fixed, only what a target needs."""

from __future__ import annotations

import graphlib
from typing import TYPE_CHECKING

from .errors import RecipeError, StageError, did_you_mean

if TYPE_CHECKING:
    from .recipe import Recipe


class Graph:
    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.stages = recipe.stages
        self.edges: dict[str, dict[str, str]] = {}  # stage -> {field: parent}
        problems = []
        for name, stage in self.stages.items():
            try:
                refs = stage.input_refs()
            except StageError as exc:  # an input the stage's settings need but the recipe does not set
                problems.append(f"{recipe.source}: stages.{name} ({stage.type_name}): {exc}")
                continue
            for field, parent in refs.items():
                where = f"{recipe.source}: stages.{name}.{field}"
                if parent not in self.stages:
                    problems.append(
                        f"{where}: no stage named {parent!r}{did_you_mean(parent, self.stages)}; "
                        f"stages: {', '.join(self.stages)}"
                    )
                    continue
                want, got = stage.inputs[field], self.stages[parent].kind
                if want != got:
                    problems.append(
                        f"{where}: expected a stage producing a {want}, but {parent!r} "
                        f"({self.stages[parent].type_name}) produces a {got}"
                    )
            self.edges[name] = refs
        if problems:
            raise RecipeError("invalid recipe:\n  " + "\n  ".join(problems))
        sorter = graphlib.TopologicalSorter({n: set(r.values()) for n, r in self.edges.items()})
        try:
            self.order = list(sorter.static_order())
        except graphlib.CycleError as exc:
            raise RecipeError(f"{recipe.source}: stages form a cycle: {' -> '.join(exc.args[1])}") from None
        # keep recipe order where the graph allows it, so plans read top to bottom
        position = {n: i for i, n in enumerate(self.stages)}
        self.order = self._stable_order(position)
        consumed = {p for refs in self.edges.values() for p in refs.values()}
        targets = list(recipe.targets) if recipe.targets else [n for n in self.stages if n not in consumed]
        for t in targets:
            if t not in self.stages:
                raise RecipeError(
                    f"{recipe.source}: targets: no stage named {t!r}{did_you_mean(t, self.stages)}"
                )
        self.targets = targets
        self.needed = self.ancestors(targets)

    def _stable_order(self, position: dict[str, int]) -> list[str]:
        done: list[str] = []
        placed: set[str] = set()
        remaining = sorted(self.stages, key=position.__getitem__)
        while remaining:
            for n in remaining:
                if set(self.edges[n].values()) <= placed:
                    done.append(n)
                    placed.add(n)
                    remaining.remove(n)
                    break
        return done

    def ancestors(self, names: list[str]) -> set[str]:
        seen: set[str] = set()
        stack = list(names)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(self.edges[n].values())
        return seen

    def consumers(self, name: str) -> list[str]:
        return [n for n, refs in self.edges.items() if name in refs.values()]
