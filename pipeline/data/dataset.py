"""A dataset as the stages hand it on: named splits of sample sets sharing class names."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import DATASET, Spec, SplitSpec
from .identity import hash_json
from .sampleset import SampleSet


@dataclass
class DatasetValue:
    """Named splits of one dataset, sharing class names."""

    splits: dict[str, SampleSet]
    class_names: list[str]

    @property
    def spec(self) -> Spec:
        return Spec(
            DATASET,
            num_classes=len(self.class_names),
            splits={name: SplitSpec(len(s), {}) for name, s in self.splits.items()},
            meta={"class_names": list(self.class_names)},
        )

    def identity(self) -> str:
        return hash_json({name: s.identity() for name, s in sorted(self.splits.items())})
