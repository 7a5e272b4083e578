"""The stage contract: a typed, configurable operator in a recipe's graph.

A stage is a frozen pydantic model (its config) plus class-level facts: the
``type_name`` recipes use, a ``version`` bumped whenever its output changes for the
same config (it is part of every fingerprint), the ``kind`` it produces, and which
config fields name other stages (``inputs``). It declares its output ``Spec`` from
its inputs' specs before any data flows (``resolve``) and does the work in ``run``.

Stages whose output is worth keeping (``cacheable``) split ``run`` into ``build``
(write into a staging directory of the store) and ``load`` (open a committed entry),
so the runner can reuse an entry instead of recomputing it.

What a stage may know of the rest of the run, it is given; it never reads the recipe or other
stages' fingerprints from the run context:

- ``resolve`` gets its inputs as ``StageInputs``: their specs by config field and the
  fingerprints of the stages they come from (``parents``: a feature stream records which
  backbone made it, a trainer checks it trains that backbone's top);
- the work methods get a ``StageCall``, made once by the runner after resolving every stage:
  the stage's name, its resolved output spec, its inputs' specs, its own and its parents'
  fingerprints, its lineage, and ``upstream``: what the recipe's graph says about each data
  input (the decode preprocessing and the dataset it went through, the batch period of its
  stream), found by the engine from the graph so that no stage walks it.

A stage never resolves itself again, and never looks at another stage's output beyond the
value and spec it is given.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
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


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


class StageInputs(Mapping[str, Spec]):
    """What ``resolve`` is given: its inputs' specs by config field (``inputs["model"]``), and
    ``parents``, the fingerprints of the stages they come from by the same fields.

    The runner resolves stages in graph order, so every parent's fingerprint is known when a
    stage resolves. A stage that is resolved outside a run (a test) and reads no fingerprint can
    be given its specs alone.
    """

    __slots__ = ("_specs", "parents")

    def __init__(self, specs: Mapping[str, Spec], parents: Mapping[str, str] | None = None) -> None:
        self._specs: Mapping[str, Spec] = _frozen(specs)
        self.parents: Mapping[str, str] = _frozen(parents)

    def __getitem__(self, field: str) -> Spec:
        return self._specs[field]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __repr__(self) -> str:
        return f"StageInputs({dict(self._specs)!r}, parents={dict(self.parents)!r})"

    def parent(self, field: str) -> str | None:
        """The fingerprint of the stage ``field`` names; None where it was not given."""
        return self.parents.get(field)


@dataclass(frozen=True)
class Preprocessing:
    """How images became the network's input: RGB at ``resolution``, normalized by mean and std (decode's
    settings). A model file records it, so an image is prepared as it was in training."""

    resolution: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True)
class Upstream:
    """What the recipe's graph says about where one data input comes from, found by the engine.

    It walks up from the input through every input but a model's, nearest stage first:
    ``preprocessing`` is that of the first decode it meets, ``dataset`` the first dataset stage,
    ``on_bad_sample`` the rule of the image dataset(s) it meets (``"fail"`` where none says
    otherwise). ``batch_period``: samples after which the input stream is back on a batch boundary
    (the least common multiple of the batch sizes of the stream stages up to it), so a resumed or
    partitioned build forms the batches an uninterrupted one forms.
    """

    preprocessing: Preprocessing | None = None
    dataset: str | None = None
    on_bad_sample: str = "fail"
    batch_period: int = 1


@dataclass(frozen=True)
class StageCall:
    """One stage's place in a resolved run, handed to ``run``/``build``/``load``.

    ``spec`` is the output spec the runner resolved (a dataset stage runs while its spec is
    being established, so it gets an empty DATASET spec and no fingerprint or lineage).
    ``parents``: input field -> fingerprint of the stage it reads. ``upstream``: input field ->
    where that input comes from (model inputs have none).
    """

    name: str
    spec: Spec = field(default_factory=lambda: Spec(DATASET))
    inputs: Mapping[str, Spec] = field(default_factory=dict)
    fingerprint: str = ""
    lineage: Lineage | None = None
    parents: Mapping[str, str] = field(default_factory=dict)
    upstream: Mapping[str, Upstream] = field(default_factory=dict)

    def upstream_of(self, field: str) -> Upstream:
        """Where input ``field`` comes from; nothing known (the defaults) where the runner did not say."""
        return self.upstream.get(field) or Upstream()


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

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        """Output spec from input specs (and their parents' fingerprints); raise StageError on anything
        inconsistent."""
        raise NotImplementedError

    def identity(self, ctx: RunContext) -> str | None:
        """Content identity of what this stage reads from outside the graph (data, weights file).

        Raise ``UnhashableInput`` when it cannot be established: the runner then
        recomputes the stage and warns, rather than risking a wrong cache hit.
        """
        return None

    # --- what the engine reads of a stage when it walks the graph for a downstream stage (Upstream)
    def preprocessing(self) -> Preprocessing | None:
        """How this stage turns images into a network's input (decode); None for any other stage."""
        return None

    def bad_sample_rule(self) -> str | None:
        """What this dataset does with an unreadable image (image_folder's ``on_bad_sample``); None: not
        a dataset of image files."""
        return None

    def sample_dependence(self) -> str | None:
        """What makes one output sample depend on more than the same input sample (other samples, its
        position, a statistic of the dataset); None when nothing does: each sample in, one sample out,
        in order. A cache fed only through such stages extends sample by sample as data arrives
        (pipeline.growth)."""
        return f"{self.type_name} is not known to treat each sample on its own"

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
