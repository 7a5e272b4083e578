"""Feature-space augmentation: random crop with zero padding and horizontal flip on feature maps.

The two-stage method cannot augment input images (their features are cached once),
so it augments the cached maps instead (Cache & Reuse, Algorithm 2). Parameters
are drawn per sample from (seed, epoch, sample id) by a counter-based hash, so the
augmentation of a sample does not depend on which batch or worker it landed in.

Right after a dequantize stage, the runner fuses the two (``pipeline.fusion``): the crop
and flip then move the stored codes while they are decoded. This stage only says how its
moves are drawn (``crop_drawer``); it never looks at the stage before it.

Transformer tokens (ViT's (D, 1, 1 + H*W), the cut's ``token_layout``) are cropped and flipped on
their patch grid; tokens before the grid (the class token) are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pydantic import Field

from ..codec.moves import CropFlip, crop_and_flip
from ..errors import StageError
from ..ops.batching import Batch
from ..spec import STREAM, Spec
from ..stage import Stage, StageCall, StageInputs
from ..stream import MapStream, Stream

if TYPE_CHECKING:
    import torch

    from ..context import RunContext

__all__ = ["CropFlip", "FeatureAugment", "crop_and_flip", "sample_uniforms"]

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: Any) -> Any:
    """splitmix64 finalizer: well-spread 64-bit values from consecutive integers."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def sample_uniforms(ids: torch.Tensor, seed: int, epoch: int, count: int) -> np.ndarray:
    """(n, count) floats in [0, 1), a pure function of (seed, epoch, id, column)."""
    base = _mix(np.uint64(seed & 0xFFFFFFFF) * np.uint64(1_000_003) + np.uint64(epoch & 0xFFFFFFFF))
    ids64 = ids.numpy().astype(np.uint64)
    cols = np.arange(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        keys = _mix(base ^ _mix(ids64[:, None] * np.uint64(count) + cols[None, :]))
    return (keys >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class FeatureAugment(Stage):
    """Random crop (zero padding) and horizontal flip of feature maps, per sample, seeded."""

    type_name: ClassVar[str] = "feature_aug"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": STREAM}

    input: str
    crop_padding: int = Field(1, ge=0, description="zero padding before a random crop back to size")
    hflip: float = Field(0.5, ge=0.0, le=1.0, description="probability of a horizontal flip")
    splits: tuple[str, ...] = ("train",)
    seed: int = 0

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        data = inputs["input"]
        for name in self.splits:
            field = data.split(name, stage=self.type_name).fields.get("x")
            if field is None or len(field.shape) != 3 or not field.dtype.startswith("float"):
                raise StageError(
                    f"expected float feature maps 'x' (C,H,W) in split {name!r}, found {field}; "
                    "put a dequantize stage before feature_aug"
                )
            prefix, h, w = data.feature_grid(field.shape)
            if field.shape[1] * field.shape[2] != prefix + h * w:
                raise StageError(f"feature maps {field.shape} in split {name!r} do not hold the cut's token "
                                 f"layout ({prefix} prefix token(s) + a {h}x{w} grid)")
        return data

    def _uniforms(self, batch: Batch, epoch: int, seed: int) -> np.ndarray:
        return sample_uniforms(batch["id"], self.seed * 31 + seed, epoch, 3)

    def crop_drawer(self, h: int, w: int, prefix: int = 0) -> Callable[[Batch, int, int], CropFlip]:
        """How the moves of a batch of (h, w) maps (or token grids after ``prefix`` tokens) are drawn:
        ``draw(batch, epoch, seed)``."""

        def draw(batch: Batch, epoch: int, seed: int) -> CropFlip:
            u = self._uniforms(batch, epoch, seed)
            return CropFlip.draw(len(u), h, w, self.crop_padding, self.hflip, u, prefix)

        return draw

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> Stream:
        parent = inputs["input"]
        grid = None
        if self.splits:
            field = call.spec.split(self.splits[0], stage=self.type_name).fields["x"]
            grid = call.spec.feature_grid(field.shape)

        def augment(batch: Batch, split: str, epoch: int, seed: int) -> Batch:
            u = self._uniforms(batch, epoch, seed)
            return {**batch, "x": crop_and_flip(batch["x"], self.crop_padding, self.hflip, u, grid)}

        return MapStream(parent, augment, call.spec, splits=self.splits)
