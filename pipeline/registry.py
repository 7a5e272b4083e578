"""Maps a recipe's ``type:`` to a stage class.

Built-in stages register on import of ``pipeline.stages``; third-party packages
register through the ``ondevice_tl.stages`` entry-point group, so a recipe can only
ever instantiate classes somebody deliberately registered (no code from recipes).
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, TypeVar

from .errors import RecipeError, did_you_mean

if TYPE_CHECKING:
    from .stage import Stage

ENTRY_POINT_GROUP = "ondevice_tl.stages"

_REGISTRY: dict[str, type[Stage]] = {}
_loaded = False

S = TypeVar("S", bound="type[Stage]")


def register(cls: S) -> S:
    """Class decorator: make ``cls`` available to recipes under ``cls.type_name``."""
    name = cls.type_name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise RecipeError(
            f"stage type {name!r} is registered twice: {_REGISTRY[name].__module__} and {cls.__module__}"
        )
    _REGISTRY[name] = cls
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import stages  # noqa: F401  (registers the built-in stages)

    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        cls = ep.load()
        if getattr(cls, "type_name", None) != ep.name:
            raise RecipeError(
                f"entry point {ep.name!r} in group {ENTRY_POINT_GROUP!r} points to {ep.value!r}, "
                f"whose type_name is {getattr(cls, 'type_name', None)!r}; expected {ep.name!r}"
            )
        register(cls)


def stage_class(type_name: str, *, where: str = "") -> type[Stage]:
    """The class for ``type_name``; an unknown name gets the nearest valid one."""
    _load()
    try:
        return _REGISTRY[type_name]
    except KeyError:
        prefix = f"{where}: " if where else ""
        raise RecipeError(
            f"{prefix}unknown stage type {type_name!r}{did_you_mean(type_name, _REGISTRY)}; "
            f"valid types: {', '.join(sorted(_REGISTRY))}"
        ) from None


def stage_types() -> dict[str, type[Stage]]:
    _load()
    return dict(sorted(_REGISTRY.items()))
