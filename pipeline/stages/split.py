"""Class splits (source vs target classes), few-shot limits and train/val/test splits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from ..data.dataset import DatasetValue
from ..data.splits import make_splits
from ..errors import DataError
from ..spec import DATASET
from ..stage import Stage, StageCall

if TYPE_CHECKING:
    from ..context import RunContext


class Split(Stage):
    """Select ``classes`` (relabelled 0..k-1 in that order), cap train samples per class, carve val/test.

    The official test split is kept as ``test`` when the dataset has one and
    ``use_official_test`` is set; otherwise each sample becomes test with probability ``test_fraction``.
    A sample's split is drawn from its own content (and ``seed``), so samples that arrive or leave
    never move another one between splits.
    """

    type_name: ClassVar[str] = "split"
    # 2: train split in a seeded random order (shuffle_train)
    # 3: every draw per sample from its content key (pipeline/data/splits.py): splits stay put as data arrives
    version: ClassVar[int] = 3
    kind: ClassVar[str] = DATASET
    inputs: ClassVar[dict[str, str]] = {"input": DATASET}

    input: str
    classes: list[int] | None = None
    per_class: int | None = Field(None, ge=1, description="train samples per class (few-shot)")
    val_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    test_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    use_official_test: bool = True
    shuffle_train: bool = Field(
        True,
        description="store train in a seeded random order, so a class-by-class source (image_folder) "
        "does not reach a cache class-sorted; false keeps the source's order",
    )
    seed: int = 0

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> DatasetValue:
        data: DatasetValue = inputs["input"]
        splits = make_splits(
            data.splits, classes=self.classes, per_class=self.per_class, val_fraction=self.val_fraction,
            test_fraction=self.test_fraction, seed=self.seed, use_official_test=self.use_official_test,
            shuffle_train=self.shuffle_train,
        )
        for split_name, subset in splits.items():
            if split_name == "train" and len(subset) == 0:
                raise DataError(f"split {split_name!r} is empty; check classes/per_class/fractions")
        names = [data.class_names[c] for c in self.classes] if self.classes else list(data.class_names)
        return DatasetValue(dict(splits), names)
