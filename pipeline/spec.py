"""Declared shapes of what flows between stages, known before any data flows.

A recipe is checked by resolving every stage's output spec from its inputs' specs
(FFCV's "declare state before data" habit): a wrong cut, a missing split or a
stage fed the wrong kind of input fails at load time, not an hour into a build.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The kinds of value a stage can produce; a stage input declares which kind it needs.
DATASET, STREAM, MODEL, RESULT = "dataset", "stream", "model", "result"
KINDS = (DATASET, STREAM, MODEL, RESULT)


@dataclass(frozen=True)
class FieldSpec:
    """One per-sample field of a stream batch: shape without the batch axis, dtype name."""

    shape: tuple[int, ...]
    dtype: str

    def nbytes(self) -> int:
        import numpy as np

        n = 1
        for d in self.shape:
            n *= d
        return n * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class SplitSpec:
    """A named split (train/val/test): its size and the fields of each sample."""

    num_samples: int
    fields: Mapping[str, FieldSpec]

    def sample_bytes(self) -> int:
        return sum(f.nbytes() for f in self.fields.values())


@dataclass(frozen=True)
class Spec:
    """What a stage produces.

    ``splits`` maps split name to its spec (for datasets, fields may be empty because
    raw images can differ in size). ``meta`` carries facts downstream stages check,
    such as the cut a feature stream was taken at or the bits of a quantized stream.
    """

    kind: str
    num_classes: int = 0
    splits: Mapping[str, SplitSpec] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def split(self, name: str, *, stage: str) -> SplitSpec:
        from .errors import StageError

        if name not in self.splits:
            raise StageError(
                f"stage {stage!r}: expected a split named {name!r} in its input, found {sorted(self.splits)}"
            )
        return self.splits[name]

    def with_fields(
        self, fields: Mapping[str, FieldSpec], splits: list[str] | None = None, **meta: Any
    ) -> Spec:
        """A copy whose splits (all, or the named ones) carry ``fields``, with ``meta`` merged in."""
        new_splits = {
            name: SplitSpec(s.num_samples, dict(fields)) if splits is None or name in splits else s
            for name, s in self.splits.items()
        }
        return Spec(self.kind, self.num_classes, new_splits, {**self.meta, **meta})


# The JSON form of a spec is part of every stored entry's attributes (an on-disk format):
# a change here is a format change, caught by the golden files.
def spec_to_json(spec: Spec) -> dict[str, Any]:
    return {
        "kind": spec.kind,
        "num_classes": spec.num_classes,
        "splits": {
            name: {
                "num_samples": s.num_samples,
                "fields": {k: [list(f.shape), f.dtype] for k, f in s.fields.items()},
            }
            for name, s in spec.splits.items()
        },
        "meta": dict(spec.meta),
    }


def spec_from_json(data: dict[str, Any]) -> Spec:
    splits = {
        name: SplitSpec(
            s["num_samples"], {k: FieldSpec(tuple(shape), dtype) for k, (shape, dtype) in s["fields"].items()}
        )
        for name, s in data["splits"].items()
    }
    return Spec(data["kind"], data["num_classes"], splits, data["meta"])
