"""Decode: dataset samples -> normalized RGB tensors at a set resolution, optionally augmented.

Input-space augmentation (albumentations) belongs to the single-stage path and to
pretraining; the two-stage path caches un-augmented features and augments in
feature space instead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..data.decode import Decoder, InputAugment
from ..lazy import lazy_module
from ..ops.batching import Batch
from ..ops.prefetch import prefetch
from ..registry import register
from ..spec import DATASET, STREAM, FieldSpec, Spec, SplitSpec
from ..stage import Stage
from ..stream import Stream, StreamStats
from .sources import DatasetValue

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class AugmentConfig(BaseModel):
    """Input-space augmentation; applied to the splits in ``splits`` only."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    random_resized_crop: tuple[float, float] | None = Field(None, description="scale range, e.g. [0.5, 1.0]")
    crop_padding: int | None = Field(None, ge=0, description="pad then random crop back to size")
    hflip: float = Field(0.0, ge=0.0, le=1.0)
    splits: tuple[str, ...] = ("train",)


class DatasetStream(Stream):
    def __init__(
        self,
        data: DatasetValue,
        spec: Spec,
        decoder: Decoder,
        augment: InputAugment | None,
        augment_splits: tuple[str, ...],
        batch_size: int,
        prefetch_depth: int,
    ) -> None:
        self.data = data
        self.spec = spec
        self.decoder = decoder
        self.augment = augment
        self.augment_splits = augment_splits
        self.batch_size = batch_size
        self.prefetch_depth = prefetch_depth
        self.stats = StreamStats()

    def open(
        self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0, start: int = 0
    ) -> Iterator[Batch]:
        samples = self.data.splits[split]
        n = len(samples)
        if shuffle:
            if start:
                raise ValueError("start (resume) is only defined for the unshuffled order")
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).numpy()
        else:
            order = np.arange(start, n)
        n = len(order)
        augment = self.augment if split in self.augment_splits else None
        labels = np.asarray(samples.labels)

        def loaded() -> Iterator[tuple[np.ndarray, Any]]:
            # Background thread: file reads, image decoding and augmentation (PIL, OpenCV and
            # albumentations release the GIL in their heavy parts, so this overlaps compute).
            for pos in range(0, n, self.batch_size):
                t0 = time.perf_counter()
                idx = order[pos : pos + self.batch_size]
                images = samples.load(idx)
                if augment is not None:
                    images = augment(images, idx, epoch=epoch, seed=seed)
                self.stats.add(time.perf_counter() - t0, len(idx))
                yield idx, images

        # The consumer's thread: resize + normalize are parallel torch ops. Run from a second
        # thread they start a second OpenMP team that fights the consumer's (frozen forward,
        # training) for the same cores and slows it by more than their own cost; here they run
        # on the consumer's team, between its own ops, for ~0.1 ms per 224px image.
        ready = prefetch(loaded(), self.prefetch_depth, name=f"decode-{split}")
        try:
            for idx, images in ready:
                t0 = time.perf_counter()
                x = self.decoder(images)
                self.stats.add(time.perf_counter() - t0, batches=0)  # counted by the loader
                yield {
                    "x": x,
                    "y": torch.from_numpy(labels[idx].astype(np.int64)),
                    "id": torch.from_numpy(idx.astype(np.int64)),
                }
        finally:
            ready.close()  # an abandoned stream stops its loader thread now, not at garbage collection


@register
class Decode(Stage):
    """Images -> normalized RGB tensors at ``resolution``, optionally augmented in input space."""

    type_name: ClassVar[str] = "decode"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": DATASET}
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"batch_size", "prefetch"})

    input: str
    resolution: int = Field(224, ge=8)
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    augment: AugmentConfig | None = None
    batch_size: int = Field(64, ge=1)
    prefetch: int = Field(2, ge=0, description="decoded batches kept ready by a background thread")

    def resolve(self, inputs: dict[str, Spec], ctx: Any) -> Spec:
        data = inputs["input"]
        fields = {
            "x": FieldSpec((3, self.resolution, self.resolution), "float32"),
            "y": FieldSpec((), "int64"),
            "id": FieldSpec((), "int64"),
        }
        splits = {name: SplitSpec(s.num_samples, fields) for name, s in data.splits.items()}
        return Spec(STREAM, data.num_classes, splits, {**data.meta, "resolution": self.resolution})

    def run(self, ctx: Any, inputs: dict[str, Any], name: str) -> DatasetStream:
        data: DatasetValue = inputs["input"]
        spec = self.resolve({"input": data.spec}, ctx)
        augment = None
        if self.augment is not None:
            augment = InputAugment(
                random_resized_crop=self.augment.random_resized_crop,
                crop_padding=self.augment.crop_padding,
                hflip=self.augment.hflip,
            )
        decoder = Decoder(self.resolution, mean=self.mean, std=self.std)
        splits = self.augment.splits if self.augment else ()
        return DatasetStream(data, spec, decoder, augment, tuple(splits), self.batch_size, self.prefetch)
