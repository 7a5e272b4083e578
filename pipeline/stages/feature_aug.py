"""Feature-space augmentation: random crop with zero padding and horizontal flip on feature maps.

The two-stage method cannot augment input images (their features are cached once),
so it augments the cached maps instead (Cache & Reuse, Algorithm 2). Parameters
are drawn per sample from (seed, epoch, sample id) by a counter-based hash, so the
augmentation of a sample does not depend on which batch or worker it landed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pydantic import Field

from ..errors import StageError
from ..lazy import lazy_module
from ..ops.batching import Batch, batch_size_of
from ..registry import register
from ..spec import STREAM, Spec
from ..stage import Stage
from ..stream import MapStream, Stream, StreamStats
from .quantize import DequantizedStream

if TYPE_CHECKING:
    import torch

    from ..codec import quantile
else:
    torch = lazy_module("torch")
    quantile = lazy_module("pipeline.codec.quantile")

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
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


@dataclass(frozen=True, eq=False)
class CropFlip:
    """A per-sample random crop (zero padding) and horizontal flip of (H, W) maps.

    Output pixel (r, c) of sample i is input pixel (r + dy_i, c' + dx_i), where c' is c, or its
    mirror W - 1 - c when ``flip_i``, and zero where that falls outside the map (the padding).
    ``dy``, ``dx`` (int32) and ``flip`` (bool) hold one value per sample: the move as the compiled
    kernel takes it (:func:`pipeline.codec.native.dequantize_moved`). For torch ops the same move
    is ``source``, int64 (N, H*W), the input position each output position reads (clamped into
    the map), with the output rows and columns that are padding (``pad_rows`` (N, H), ``pad_cols``
    (N, W), bool), computed on first use. One ``gather`` along the flattened plane with ``source``
    moves every sample's pixels at once; the padding is then zeroed by assignment, row by row and
    column by column, which touches only the padded pixels and stays exactly zero next to inf or
    nan (a 0/1 mask multiplied in would make nan of them).
    """

    dy: np.ndarray
    dx: np.ndarray
    flip: np.ndarray
    h: int
    w: int

    @classmethod
    def draw(cls, n: int, h: int, w: int, padding: int, hflip: float, u: np.ndarray) -> CropFlip:
        """The crop and flip of ``n`` samples from their uniforms ``u`` (n, 3): dy, dx, flip."""
        span = 2 * padding + 1
        dy = (u[:n, 0] * span).astype(np.int32) - padding
        dx = (u[:n, 1] * span).astype(np.int32) - padding
        return cls(dy, dx, u[:n, 2] < hflip, h, w)

    @property
    def move(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.dy, self.dx, self.flip

    @cached_property
    def _as_positions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, h, w = len(self.dy), self.h, self.w
        dy, dx = torch.from_numpy(self.dy.astype(np.int64)), torch.from_numpy(self.dx.astype(np.int64))
        flip = torch.from_numpy(np.asarray(self.flip, dtype=bool))
        rows = dy[:, None] + torch.arange(h)[None, :]  # (n, h) source rows
        cols = torch.arange(w)[None, :].expand(n, w)
        cols = torch.where(flip[:, None], w - 1 - cols, cols) + dx[:, None]  # (n, w) source columns
        source = rows.clamp(0, h - 1)[:, :, None] * w + cols.clamp(0, w - 1)[:, None, :]
        return source.reshape(n, h * w), (rows < 0) | (rows >= h), (cols < 0) | (cols >= w)

    @property
    def source(self) -> torch.Tensor:
        return self._as_positions[0]

    @property
    def pad_rows(self) -> torch.Tensor:
        return self._as_positions[1]

    @property
    def pad_cols(self) -> torch.Tensor:
        return self._as_positions[2]

    def zero_padding(self, x: torch.Tensor) -> torch.Tensor:
        """Set the padded output pixels of ``x`` (N, C, H, W), moved by ``source``, to zero; in place."""
        sample, row = self.pad_rows.nonzero(as_tuple=True)
        if len(sample):
            x[sample, :, row, :] = 0
        sample, col = self.pad_cols.nonzero(as_tuple=True)
        if len(sample):
            x[sample, :, :, col] = 0
        return x

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The cropped and flipped copy of float maps ``x`` (N, C, H, W)."""
        return self.zero_padding(quantile.move_planes(x, self.source))


def crop_and_flip(x: torch.Tensor, padding: int, hflip: float, u: np.ndarray) -> torch.Tensor:
    """Per-sample random crop (zero padding ``padding``) and horizontal flip of ``x``, drawn from ``u``."""
    n, _, h, w = x.shape
    if n == 0:
        return x.clone()
    return CropFlip.draw(n, h, w, padding, hflip, u).apply(x)


class AugmentWhileDequantizing(Stream):
    """feature_aug fused with the dequantize stage before it: the crop and flip move the codes.

    What comes out is bit for bit what dequantizing and then augmenting gives (the moves are
    exact and the padding is +0.0 either way), but the maps are moved while they are made, in
    one pass of the compiled kernel (:mod:`pipeline.codec.native`), or with torch ops that move
    the one-byte codes instead of the four-byte floats. For 134 maps of 320x7x7 at 2 bits (Xeon,
    2 threads): 0.9 ms with the kernel, 2.3-2.8 ms with the fused torch ops, 7.6 ms for the two
    stages one after the other; this runs on the trainer's critical path every epoch. Time is
    booked as the two stages would book it: drawing the crops to feature_aug, making the maps
    (moves and padding included) to dequantize.
    """

    def __init__(self, dequantized: DequantizedStream, augment: Callable[[Batch, int, int], CropFlip],
                 splits: tuple[str, ...]) -> None:
        self.dequantized = dequantized
        self.augment = augment
        self.splits = splits
        self.spec = dequantized.spec
        self.stats = StreamStats()

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        batches = self.dequantized.parent.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start)
        for batch in batches:
            n = batch_size_of(batch)
            t0 = time.perf_counter()
            crop = self.augment(batch, epoch, seed) if split in self.splits and n else None
            t1 = time.perf_counter()
            out = self.dequantized.decode(batch, crop)
            self.dequantized.stats.add(time.perf_counter() - t1, n)
            if crop is not None:
                self.stats.add(t1 - t0, n)
            yield out

    def stored_bytes(self) -> int:
        return self.dequantized.stored_bytes()


@register
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

    def resolve(self, inputs: dict[str, Spec], ctx: Any) -> Spec:
        data = inputs["input"]
        for name in self.splits:
            field = data.split(name, stage=self.type_name).fields.get("x")
            if field is None or len(field.shape) != 3 or not field.dtype.startswith("float"):
                raise StageError(
                    f"expected float feature maps 'x' (C,H,W) in split {name!r}, found {field}; "
                    "put a dequantize stage before feature_aug"
                )
        return data

    def run(self, ctx: Any, inputs: dict[str, Any], name: str) -> Stream:
        parent = inputs["input"]

        def uniforms(batch: Batch, epoch: int, seed: int) -> np.ndarray:
            return sample_uniforms(batch["id"], self.seed * 31 + seed, epoch, 3)

        if isinstance(parent, DequantizedStream):
            _, h, w = parent.shape

            def draw(batch: Batch, epoch: int, seed: int) -> CropFlip:
                u = uniforms(batch, epoch, seed)
                return CropFlip.draw(len(u), h, w, self.crop_padding, self.hflip, u)

            return AugmentWhileDequantizing(parent, draw, self.splits)

        def augment(batch: Batch, split: str, epoch: int, seed: int) -> Batch:
            u = uniforms(batch, epoch, seed)
            return {**batch, "x": crop_and_flip(batch["x"], self.crop_padding, self.hflip, u)}

        return MapStream(parent, augment, parent.spec, splits=self.splits)
