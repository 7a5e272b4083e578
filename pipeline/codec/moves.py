"""Per-sample moves of (H, W) feature planes: a random crop with zero padding and a horizontal flip.

Kept apart from the stages that draw them (feature_aug) and apply them while decoding
(dequantize), so either can use them without importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from ..lazy import lazy_module

if TYPE_CHECKING:
    import torch

    from . import quantile
else:
    torch = lazy_module("torch")
    quantile = lazy_module("pipeline.codec.quantile")


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
