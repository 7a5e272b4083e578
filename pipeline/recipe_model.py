"""The base of every model a recipe fills in: what any recipe value must be, whatever its field.

Stages, their nested settings (``train:``, ``augment:``, ``method:``, ``spill:``) and the recipe's own
sections all derive from :class:`RecipeModel`, so these rules hold everywhere and are checked when
the recipe is validated, before any work:

- frozen, and no field the model does not declare (a typo is named with the nearest valid name);
- numbers are finite: ``.nan`` and ``.inf`` are refused (``lr: .inf`` would otherwise pass every
  ``gt=0`` bound and diverge hours later);
- a YAML boolean is not a number (``bits: true`` would otherwise be read as 1);
- every field named ``seed`` holds a value every random generator takes: 0 to 2**32 - 1.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

SEED_MAX = 2**32 - 1


def _numeric(annotation: Any) -> bool:
    """True when ``annotation`` accepts a number but not a boolean (int, float, unions of them, None)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _numeric(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and bool not in args and any(_numeric(a) for a in args)
    if origin is Literal:  # e.g. bits: Literal[1, 2, 4, 8]: True == 1 would pass it
        values = typing.get_args(annotation)
        return bool(values) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    return annotation in (int, float)


def plain_value(model: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """``value`` for ``model``'s field ``info.field_name``, refused when it is a boolean given for a number
    or a seed out of range (the rules of :class:`RecipeModel`)."""
    name = info.field_name
    field = model.model_fields.get(name) if name is not None else None
    if field is None:
        return value
    if isinstance(value, bool) and _numeric(field.annotation):
        raise ValueError("expected a number, not a YAML boolean")
    if name == "seed" and isinstance(value, int) and not isinstance(value, bool) \
            and not 0 <= value <= SEED_MAX:
        raise ValueError(f"expected a seed from 0 to {SEED_MAX}")
    return value


class FiniteModel(BaseModel):
    """Frozen settings, no undeclared field, finite numbers: the base of models whose fields include a
    union's discriminator (which no validator may touch before pydantic picks the member); such a model
    checks its own numeric fields with :func:`plain_value`."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class RecipeModel(FiniteModel):
    """Frozen settings with finite numbers, no booleans for numbers, and seeds in range (see the module)."""

    @field_validator("*", mode="before")
    @classmethod
    def _plain_values(cls, value: Any, info: ValidationInfo) -> Any:
        return plain_value(cls, value, info)
