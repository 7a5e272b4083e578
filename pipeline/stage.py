"""The stage contract: a typed, configurable operator in a recipe's graph.

A stage is a frozen pydantic model (its config) plus class-level facts: the
``type_name`` recipes use, a ``version`` bumped whenever its output changes for the
same config (it is part of every fingerprint), the ``kind`` it produces, and which
config fields name other stages (``inputs``). It declares its output ``Spec`` from
its inputs' specs before any data flows (``resolve``) and does the work in ``run``.

Stages whose output is worth keeping (``cacheable``) split ``run`` into ``build``
(write into a staging directory of the store) and ``load`` (open a committed entry),
so the runner can reuse an entry instead of recomputing it.

The runner resolves every stage once, before any work, and hands the result to the work
methods as a ``StageCall``: the stage's name, its resolved output spec, its inputs' specs,
its fingerprint and its lineage. A stage never resolves itself again, and never looks at
another stage's output beyond the value and spec it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .recipe_model import RecipeModel
from .spec import DATASET, Spec

if TYPE_CHECKING:
    from stores.catalog import Entry

    from .context import RunContext


@dataclass(frozen=True)
class Lineage:
    """What produced a stored value: built once by the runner, written by whoever stores it.

    ``manifest`` is the form the catalog keeps beside an entry; ``entry_attrs`` the form a
    stored stream carries in its own attributes. Neither holds a timestamp, so a resumed
    build writes exactly what an uninterrupted one would.
    """

    recipe: str
    recipe_file: str | None
    stage: str
    type: str
    config: Mapping[str, Any]
    inputs: Mapping[str, str]
    fingerprint: str
    # What the stored numbers depend on beyond the inputs: whether they are the same at every
    # thread count, and if not, the thread setting they were computed under.
    numerics: Mapping[str, Any] = field(default_factory=lambda: {"thread_invariant": True})

    def manifest(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "recipe_file": self.recipe_file,
            "stage": self.stage,
            "type": self.type,
            "config": dict(self.config),
            "inputs": dict(self.inputs),
            "numerics": dict(self.numerics),
        }

    def entry_attrs(self, spec: Spec) -> dict[str, Any]:
        return {"stage": self.stage, "fingerprint": self.fingerprint, "recipe": self.recipe,
                "meta": dict(spec.meta)}


@dataclass(frozen=True)
class StageCall:
    """One stage's place in a resolved run, handed to ``run``/``build``/``load``.

    ``spec`` is the output spec the runner resolved (a dataset stage runs while its spec is
    being established, so it gets an empty DATASET spec and no fingerprint or lineage).
    """

    name: str
    spec: Spec = field(default_factory=lambda: Spec(DATASET))
    inputs: Mapping[str, Spec] = field(default_factory=dict)
    fingerprint: str = ""
    lineage: Lineage | None = None


class Stage(RecipeModel):

    type_name: ClassVar[str]
    version: ClassVar[int] = 1
    kind: ClassVar[str]
    # config field -> kind of stage it must name; a None value means "not connected"
    inputs: ClassVar[dict[str, str]] = {}
    cacheable: ClassVar[bool] = False
    # build() can continue a staging directory an interrupted build left behind
    resumable: ClassVar[bool] = False
    # config fields that never change the output (thread counts, prefetch depth, progress)
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset()
    # trains a model: its numbers follow the thread count unless run.deterministic (the default)
    trains: ClassVar[bool] = False

    # --- wiring -----------------------------------------------------------------
    def input_refs(self) -> dict[str, str]:
        """Config field -> name of the stage it reads from, for the inputs this config uses."""
        refs: dict[str, str] = {}
        for name in self.inputs:
            value = getattr(self, name)
            if value is not None:
                refs[name] = value
        return refs

    def resolve(self, inputs: dict[str, Spec], ctx: RunContext) -> Spec:
        """Output spec from input specs; raise StageError on anything inconsistent."""
        raise NotImplementedError

    def identity(self, ctx: RunContext) -> str | None:
        """Content identity of what this stage reads from outside the graph (data, weights file).

        Raise ``UnhashableInput`` when it cannot be established: the runner then
        recomputes the stage and warns, rather than risking a wrong cache hit.
        """
        return None

    # --- work -------------------------------------------------------------------
    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is cacheable: the runner calls build/load")

    def build(
        self, ctx: RunContext, inputs: dict[str, Any], staging: Path, call: StageCall
    ) -> dict[str, Any] | None:
        """Write the output into ``staging``; return extra manifest fields."""
        raise NotImplementedError

    def load(self, ctx: RunContext, entry: Entry, call: StageCall) -> Any:
        """Open a committed entry as this stage's output (inputs are not computed on a hit)."""
        raise NotImplementedError

    def plan_action(self, call: StageCall) -> str | None:
        """The action a plan shows for this stage when it is not the runner's default (None)."""
        return None

    def plan_note(self, call: StageCall) -> str | None:
        """One line a plan shows beside the stage (e.g. which cut a derived forward goes from and to)."""
        return None

    def estimate_bytes(self, spec: Spec) -> int | None:
        """Expected size of the stored output, for budgets and plans; None if unknown."""
        return None

    # --- config round trip ------------------------------------------------------
    def to_config(self) -> dict[str, Any]:
        """The recipe form: ``type`` plus every non-default setting (JSON-able)."""
        return {"type": self.type_name, **self.model_dump(mode="json", exclude_defaults=True)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Stage:
        """This stage class from its recipe form; ``pipeline.registry.stage_from_config`` picks the class."""
        own = getattr(cls, "type_name", None)
        if own is None:
            raise TypeError(f"{cls.__name__} is not a stage type; use pipeline.registry.stage_from_config")
        config = dict(config)
        type_name = config.pop("type", own)
        if type_name != own:
            raise ValueError(f"{cls.__name__} has type {cls.type_name!r}, the config says {type_name!r}")
        return cls.model_validate(config)

    def fingerprint_config(self) -> dict[str, Any]:
        """Settings that define the output: non-default config minus wiring and excluded fields."""
        skip = set(self.inputs) | set(self.fingerprint_exclude)
        return {k: v for k, v in self.model_dump(mode="json", exclude_defaults=True).items() if k not in skip}
