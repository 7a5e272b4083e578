"""Decode: dataset samples -> normalized RGB tensors at a set resolution, optionally augmented.

Input-space augmentation (albumentations) belongs to the single-stage path and to
pretraining; the two-stage path caches un-augmented features and augments in
feature space instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from ..data.dataset import DatasetValue
from ..data.decode import Decoder, InputAugment
from ..data.stream import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    AugmentConfig,
    CpuWork,
    DatasetStream,
    placement,
)
from ..spec import DATASET, STREAM, FieldSpec, Spec, SplitSpec
from ..stage import Preprocessing, Stage, StageCall, StageInputs

if TYPE_CHECKING:
    from ..context import RunContext

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "AugmentConfig", "DatasetStream", "Decode"]

class Decode(Stage):
    """Images -> normalized RGB tensors at ``resolution``, optionally augmented in input space."""

    type_name: ClassVar[str] = "decode"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": DATASET}
    # How and where the work is scheduled; never what it computes.
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset(
        {"batch_size", "prefetch", "cpu_work", "decode_threads"}
    )

    input: str
    resolution: int = Field(224, ge=8)
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    augment: AugmentConfig | None = None
    batch_size: int = Field(64, ge=1)
    prefetch: int = Field(2, ge=0, description="batches read ahead by a background thread")
    cpu_work: Literal["auto", CpuWork] = Field(
        "auto",
        description="where decoding and augmentation run: 'background' (prefetch thread, beside compute), "
        "'between_steps' (on decode_threads threads when a batch is taken; files still read ahead); "
        "'auto': between_steps when run.device is cpu, whose cores compute already fills",
    )
    decode_threads: int | None = Field(
        None, ge=1, description="threads for between_steps decoding; default torch's thread count"
    )

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        data = inputs["input"]
        fields = {
            "x": FieldSpec((3, self.resolution, self.resolution), "float32"),
            "y": FieldSpec((), "int64"),
            "id": FieldSpec((), "int64"),
        }
        splits = {name: SplitSpec(s.num_samples, fields) for name, s in data.splits.items()}
        return data.as_stream(splits, resolution=self.resolution)

    def sample_dependence(self) -> str | None:
        if self.augment is not None and self.augment.splits:
            return "input-space augmentation draws its crops by sample position"
        return None

    def preprocessing(self) -> Preprocessing:
        return Preprocessing(self.resolution, tuple(self.mean), tuple(self.std))

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> DatasetStream:
        data: DatasetValue = inputs["input"]
        augment = None
        if self.augment is not None:
            augment = InputAugment(
                random_resized_crop=self.augment.random_resized_crop,
                crop_padding=self.augment.crop_padding,
                hflip=self.augment.hflip,
            )
        decoder = Decoder(self.resolution, mean=self.mean, std=self.std)
        splits = self.augment.splits if self.augment else ()
        cpu_work, threads = placement(self.cpu_work, self.decode_threads, ctx.device)
        return DatasetStream(data, call.spec, decoder, augment, tuple(splits), self.batch_size, self.prefetch,
                             cpu_work=cpu_work, threads=threads,
                             pin_memory=ctx.torch_device.type == "cuda")
