"""The stage contract: a typed, configurable operator in a recipe's graph.

A stage is a frozen pydantic model (its config) plus class-level facts: the
``type_name`` recipes use, a ``version`` bumped whenever its output changes for the
same config (it is part of every fingerprint), the ``kind`` it produces, and which
config fields name other stages (``inputs``). It declares its output ``Spec`` from
its inputs' specs before any data flows (``resolve``) and does the work in ``run``.

Stages whose output is worth keeping (``cacheable``) split ``run`` into ``build``
(write into a staging directory of the store) and ``load`` (open a committed entry),
so the runner can reuse an entry instead of recomputing it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from .spec import Spec

if TYPE_CHECKING:
    from stores.catalog import Entry

    from .context import RunContext


class Stage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

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

    # --- wiring -----------------------------------------------------------------
    def input_refs(self) -> dict[str, str]:
        """Config field -> name of the stage it reads from, for the inputs this config uses."""
        refs = {}
        for field in self.inputs:
            value = getattr(self, field)
            if value is not None:
                refs[field] = value
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
    def run(self, ctx: RunContext, inputs: dict[str, Any], name: str) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is cacheable: the runner calls build/load")

    def build(self, ctx: RunContext, inputs: dict[str, Any], staging: Path, name: str) -> dict[str, Any]:
        """Write the output into ``staging``; return extra manifest fields."""
        raise NotImplementedError

    def load(self, ctx: RunContext, entry: Entry, name: str) -> Any:
        """Open a committed entry as this stage's output (inputs are not computed on a hit)."""
        raise NotImplementedError

    def estimate_bytes(self, spec: Spec) -> int | None:
        """Expected size of the stored output, for budgets and plans; None if unknown."""
        return None

    # --- config round trip ------------------------------------------------------
    def to_config(self) -> dict[str, Any]:
        """The recipe form: ``type`` plus every non-default setting (JSON-able)."""
        return {"type": self.type_name, **self.model_dump(mode="json", exclude_defaults=True)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Stage:
        from .registry import stage_class

        config = dict(config)
        type_name = config.pop("type", cls.type_name if cls is not Stage else None)
        target = stage_class(type_name) if cls is Stage else cls
        return target.model_validate(config)

    def fingerprint_config(self) -> dict[str, Any]:
        """Settings that define the output: non-default config minus wiring and excluded fields."""
        skip = set(self.inputs) | set(self.fingerprint_exclude)
        return {k: v for k, v in self.model_dump(mode="json", exclude_defaults=True).items() if k not in skip}
