"""The search space of ``choose``: which recipe fields vary, over which values, as candidates.

A candidate is a dict of overrides (dotted paths, as ``--set`` takes them) applied to the recipe.
Four knobs have short names, found from the recipe around the trainer being tuned (the target
``finetune`` stage):

- ``cut``: ``train_last_blocks`` of the ``frozen_forward`` feeding it (of the trainer itself when
  it trains single_stage from images);
- ``bits``: ``bits`` of the ``quantize`` stage nearest it upstream;
- ``method``: its ``method`` (vanilla / mobiletl / tinytl, or a label such as ``tinytl:lite``);
- ``arch``: ``arch`` of the backbone stage it trains.

Any other dotted path varies too (``stages.top.train.lr=0.002,0.01``). Values a user does not give
come from defaults (:func:`default_values`); ``arch`` varies only when the user lists candidates.
``parse_space`` is the one place ``KEY=V1,V2`` texts are read.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import BaseModel

from ..errors import RecipeError, did_you_mean
from ..graph import Graph
from ..methods.finetune import Finetune
from ..recipe import Recipe
from ..stages.forward import FrozenForward
from ..stages.quantize import Quantize
from ..sweep.grid import GridError, parse_axis

KNOBS = ("arch", "cut", "bits", "method")
DEFAULT_BITS = (2, 4, 8)
DEFAULT_METHODS = ("vanilla", "mobiletl", "tinytl")
# What the part after the colon of a method label sets (``tinytl:lite``, ``mobiletl:all-bn``): the
# labels are those the trainers log (``pipeline.methods.adapters``' ``label()``).
LABEL_FIELD = {"tinytl": "mode", "mobiletl": "variant"}


# ------------------------------------------------------------------------------- KEY=V1,V2
def parse_space(texts: list[str]) -> dict[str, list[Any]]:
    """``["bits=2,4", "method=vanilla,tinytl"]`` -> ``{"bits": [2, 4], "method": ["vanilla", "tinytl"]}``.

    The sweep's ``--grid`` syntax (:func:`pipeline.sweep.grid.parse_axis`): each value is YAML, as
    ``--set`` reads it (``4`` is an int, ``{type: tinytl}`` a mapping); commas inside brackets stay.
    """
    space: dict[str, list[Any]] = {}
    for text in texts:
        try:
            axis = parse_axis(text)
        except GridError as exc:
            raise RecipeError(str(exc).replace("--grid", "--space")) from None
        if axis.key in space:
            raise RecipeError(f"--space {axis.key}: given twice; list every value in one --space "
                              f"{axis.key}=V1,V2")
        space[axis.key] = list(axis.values)
    return space


# ----------------------------------------------------------------------------------- knobs
@dataclass(frozen=True)
class Knobs:
    """Where the short-named knobs live in a recipe, for one target trainer."""

    target: str
    cut: str  # stage whose train_last_blocks is the cut
    backbone: str
    quantize: str | None  # None: the trainer reads float features or images

    def paths(self) -> dict[str, str]:
        paths = {
            "arch": f"stages.{self.backbone}.arch",
            "cut": f"stages.{self.cut}.train_last_blocks",
            "method": f"stages.{self.target}.method",
        }
        if self.quantize is not None:
            paths["bits"] = f"stages.{self.quantize}.bits"
        return paths


def pick_target(recipe: Recipe, target: str | None) -> str:
    """The finetune stage to tune: ``target``, or the recipe's only finetune target."""
    trainers = [n for n, s in recipe.stages.items() if isinstance(s, Finetune)]
    if target is not None:
        if target not in trainers:
            raise RecipeError(f"{recipe.source}: --target {target!r} is not a finetune stage"
                              f"{did_you_mean(target, trainers)}; finetune stages: "
                              f"{', '.join(trainers) or 'none'}")
        return target
    in_targets = [n for n in Graph(recipe).targets if n in trainers]
    if len(in_targets) == 1:
        return in_targets[0]
    if not in_targets:
        raise RecipeError(f"{recipe.source}: no finetune stage among the targets to choose for; "
                          f"finetune stages: {', '.join(trainers) or 'none'}")
    raise RecipeError(f"{recipe.source}: the targets hold {len(in_targets)} finetune stages "
                      f"({', '.join(in_targets)}); name the one to tune with --target STAGE")


def find_knobs(recipe: Recipe, target: str) -> Knobs:
    """The stages that hold ``target``'s cut, bits and backbone (walking its feature stream upward)."""
    trainer = recipe.stages[target]
    assert isinstance(trainer, Finetune)
    if trainer.mode == "single_stage":
        return Knobs(target, target, trainer.model, None)
    edges = Graph(recipe).edges
    name, quantize = trainer.features, None
    while name is not None:
        stage = recipe.stages[name]
        if isinstance(stage, FrozenForward):
            return Knobs(target, name, trainer.model, quantize)
        if isinstance(stage, Quantize) and quantize is None:
            quantize = name
        name = edges[name].get("input")
    raise RecipeError(f"{recipe.source}: stages.{target}.features ({trainer.features}) does not come from a "
                      "frozen_forward stage, so it has no cut to choose")


# ------------------------------------------------------------------------------- key checks
def _field_model(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def check_key(recipe: Recipe, key: str, target: str) -> None:
    """A dotted path must name a field of the recipe that the target depends on (nearest name if not)."""
    parts = key.split(".")
    if not all(parts):
        raise RecipeError(f"--space {key}: empty component in the key path")
    model: type[BaseModel] | None
    if parts[0] != "stages":
        names = [f for f in Recipe.model_fields if f not in ("stages", "source", "targets")]
        if parts[0] not in names:
            raise RecipeError(f"--space {key}: unknown key {parts[0]!r}"
                              f"{did_you_mean(parts[0], [*KNOBS, *names])}; expected {', '.join(KNOBS)} or a "
                              "dotted recipe path such as stages.STAGE.FIELD")
        model, rest, where = _field_model(Recipe.model_fields[parts[0]].annotation), parts[1:], parts[0]
    else:
        if len(parts) < 3:
            raise RecipeError(f"--space {key}: expected stages.STAGE.FIELD")
        stage = parts[1]
        if stage not in recipe.stages:
            raise RecipeError(f"--space {key}: no stage named {stage!r}{did_you_mean(stage, recipe.stages)}")
        if stage not in Graph(recipe).ancestors([target]):
            raise RecipeError(f"--space {key}: stages.{stage} is not used by the trainer {target!r}, so "
                              "varying it changes nothing")
        model, rest, where = type(recipe.stages[stage]), parts[2:], f"stages.{stage}"
    for part in rest:
        if model is None:
            return  # a union or plain value below: the recipe's own validation checks it per candidate
        valid = [f for f in model.model_fields if f != "source"]
        if part not in valid:
            raise RecipeError(f"--space {key}: unknown key {part!r} in {where}{did_you_mean(part, valid)}; "
                              f"valid keys: {', '.join(valid)}")
        model, where = _field_model(model.model_fields[part].annotation), f"{where}.{part}"


def method_value(value: Any) -> Any:
    """A method as the recipe takes it: ``tinytl:lite`` -> ``{type: tinytl, mode: lite}``."""
    if isinstance(value, str) and ":" in value:
        kind, _, setting = value.partition(":")
        if kind not in LABEL_FIELD:
            raise RecipeError(f"--space method: {value!r}: only {' and '.join(LABEL_FIELD)} take a setting "
                              "after a colon (tinytl:lite, mobiletl:all-bn)")
        return {"type": kind, LABEL_FIELD[kind]: setting}
    return value


# ------------------------------------------------------------------------------- candidates
@dataclass(frozen=True)
class Candidate:
    """One point of the space: its short name, what varies (for tables), the overrides it applies."""

    id: str
    settings: dict[str, Any]
    overrides: dict[str, Any] = field(hash=False)

    def describe(self) -> str:
        return " ".join(f"{k}={short_value(v)}" for k, v in self.settings.items())


def short_value(value: Any) -> str:
    if isinstance(value, Mapping):
        if set(value) <= {"type", *LABEL_FIELD.values()} and "type" in value:
            return ":".join(str(value[k]) for k in ("type", *LABEL_FIELD.values()) if k in value)
        return yaml.safe_dump(dict(value), default_flow_style=True, width=1000).strip()
    return str(value)


def default_cuts(num_blocks: int, recipe_cut: int) -> list[int]:
    """The recipe's cut and a quarter and a half of the backbone's blocks (distinct, ascending)."""
    quarter, half = max(1, -(-num_blocks // 4)), max(1, -(-num_blocks // 2))
    return sorted({quarter, recipe_cut, half})


def build_candidates(
    recipe: Recipe, knobs: Knobs, space: dict[str, list[Any]], num_blocks: Callable[[str | None], int],
) -> list[Candidate]:
    """The cross product of the space (defaults filled in), as candidates in a stable order.

    ``num_blocks(arch)`` is the block count of the backbone with that arch (None: the recipe's), for
    the default cuts. Keys are checked first: an unknown one fails here, before anything is metered.
    """
    paths = knobs.paths()
    by_path = {p: k for k, p in paths.items()}
    dims: dict[str, list[Any]] = {}  # knob name or dotted path -> values
    for key, values in space.items():
        if not values:
            raise RecipeError(f"--space {key}: no values (expected {key}=V1,V2,...)")
        if key in KNOBS:
            if key not in paths:
                raise RecipeError(f"--space {key}: stages.{knobs.target} reads no quantized cache (no "
                                  "quantize stage upstream of it), so there are no bits to choose")
            name = key
        else:
            check_key(recipe, key, knobs.target)
            name = by_path.get(key, key)
        if name in dims:
            raise RecipeError(f"--space {key}: the same field as --space {name} ({paths.get(name, name)}); "
                              "give it once")
        dims[name] = values
    if "method" in dims:
        dims["method"] = [method_value(v) for v in dims["method"]]
    else:
        dims["method"] = list(DEFAULT_METHODS)
    if "bits" in paths and "bits" not in dims:
        dims["bits"] = list(DEFAULT_BITS)
    recipe_cut = getattr(recipe.stages[knobs.cut], "train_last_blocks", None)
    # Varied per arch, in a fixed order: cut, bits, method, then the user's other keys.
    rest: list[str] = [k for k in ("cut", "bits", "method") if k in dims or k == "cut"]
    rest += [k for k in dims if k not in KNOBS]
    out: list[Candidate] = []
    for arch in dims.get("arch", [None]):
        cuts = dims.get("cut")
        if cuts is None:
            blocks = num_blocks(arch)
            cut = recipe_cut if isinstance(recipe_cut, int) and 0 < recipe_cut <= blocks else blocks // 2
            cuts = default_cuts(blocks, cut)
        for combo in itertools.product(*(cuts if k == "cut" else dims[k] for k in rest)):
            settings: dict[str, Any] = {} if arch is None else {"arch": arch}
            settings.update(zip(rest, combo, strict=True))
            overrides = {paths.get(k, k): v for k, v in settings.items()}
            out.append(Candidate(f"c{len(out) + 1:02d}", settings, overrides))
    return out
