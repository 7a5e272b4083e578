"""Maps a recipe's ``type:`` to a stage class.

The built-in stage types are an explicit table (``BUILTIN_STAGES``), and third-party
packages add theirs through the ``ondevice_tl.stages`` entry-point group. Both name a
class as ``module:Class``, so what a recipe can instantiate never depends on which module
happened to be imported first, and is only ever a class somebody deliberately listed (no
code from recipes).
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

from .errors import RecipeError, did_you_mean

if TYPE_CHECKING:
    from .stage import Stage

ENTRY_POINT_GROUP = "ondevice_tl.stages"

# type name -> "module:Class", in the order ``python -m pipeline stages`` groups them by.
BUILTIN_STAGES: dict[str, str] = {
    # data
    "digits": "pipeline.stages.sources:Digits",
    "fashion_mnist": "pipeline.stages.sources:FashionMNIST",
    "image_folder": "pipeline.stages.sources:ImageFolder",
    "cifar10": "pipeline.stages.sources:Cifar10",
    "cifar100": "pipeline.stages.sources:Cifar100",
    "synthetic": "pipeline.stages.sources:Synthetic",
    "split": "pipeline.stages.split:Split",
    # models
    "backbone": "pipeline.stages.model:Backbone",
    "pretrain": "pipeline.methods.pretrain:Pretrain",
    # stage A
    "decode": "pipeline.stages.decode:Decode",
    "frozen_forward": "pipeline.stages.forward:FrozenForward",
    "quantize": "pipeline.stages.quantize:Quantize",
    "cache": "pipeline.stages.cache:Cache",
    # stage B
    "dequantize": "pipeline.stages.quantize:Dequantize",
    "feature_aug": "pipeline.stages.feature_aug:FeatureAugment",
    "rechunk": "pipeline.stages.streamops:Rechunk",
    "prefetch": "pipeline.stages.streamops:Prefetch",
    "shuffle": "pipeline.stages.streamops:Shuffle",
    # trainers
    "finetune": "pipeline.methods.finetune:Finetune",
    "finetune_mixed": "pipeline.methods.mixed_precision.stages:FinetuneMixed",
    "partition_search": "pipeline.methods.mixed_precision.stages:PartitionSearch",
    "neuroflux": "pipeline.methods.neuroflux.stage:NeuroFlux",
    "backprop": "pipeline.methods.neuroflux.stage:Backprop",
}

_REGISTRY: dict[str, type[Stage]] = {}
_loaded = False


def register(cls: type[Stage]) -> type[Stage]:
    """Make ``cls`` available to recipes under ``cls.type_name`` (tests, library use)."""
    name = cls.type_name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise RecipeError(
            f"stage type {name!r} is registered twice: {_REGISTRY[name].__module__} and {cls.__module__}"
        )
    _REGISTRY[name] = cls
    return cls


def _import(name: str, target: str, where: str) -> type[Stage]:
    from .stage import Stage

    module, _, attr = target.partition(":")
    cls: Any = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Stage)) or getattr(cls, "type_name", None) != name:
        raise RecipeError(
            f"{where} {name!r} points to {target!r}, whose type_name is "
            f"{getattr(cls, 'type_name', None)!r}; expected a Stage class with type_name {name!r}"
        )
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name, target in BUILTIN_STAGES.items():
        register(_import(name, target, "built-in stage"))
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        register(_import(ep.name, ep.value, f"entry point in group {ENTRY_POINT_GROUP!r}:"))


def stage_class(type_name: str | None, *, where: str = "") -> type[Stage]:
    """The class for ``type_name``; an unknown name gets the nearest valid one."""
    _load()
    if type_name is not None and type_name in _REGISTRY:
        return _REGISTRY[type_name]
    prefix = f"{where}: " if where else ""
    raise RecipeError(
        f"{prefix}unknown stage type {type_name!r}{did_you_mean(str(type_name), _REGISTRY)}; "
        f"valid types: {', '.join(sorted(_REGISTRY))}"
    )


def stage_types() -> dict[str, type[Stage]]:
    _load()
    return dict(sorted(_REGISTRY.items()))


def stage_from_config(config: dict[str, Any]) -> Stage:
    """A stage from its recipe form (``type`` plus settings): ``Stage.to_config``'s inverse."""
    config = dict(config)
    return stage_class(config.pop("type", None)).model_validate(config)
