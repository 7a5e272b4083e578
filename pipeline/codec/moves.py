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

    ``prefix`` > 0: the planes are transformer tokens, ``prefix`` tokens that are no grid position
    (ViT's class token) followed by the (h, w) grid row by row, stored as (N, C, 1, prefix + h*w).
    Only the grid moves; the prefix tokens stay where they are, never padding. ``source`` then has
    ``prefix + h*w`` positions and the padding is zeroed by a mask over the flattened plane.
    """

    dy: np.ndarray
    dx: np.ndarray
    flip: np.ndarray
    h: int
    w: int
    prefix: int = 0

    @classmethod
    def draw(cls, n: int, h: int, w: int, padding: int, hflip: float, u: np.ndarray,
             prefix: int = 0) -> CropFlip:
        """The crop and flip of ``n`` samples from their uniforms ``u`` (n, 3): dy, dx, flip."""
        span = 2 * padding + 1
        dy = (u[:n, 0] * span).astype(np.int32) - padding
        dx = (u[:n, 1] * span).astype(np.int32) - padding
        return cls(dy, dx, u[:n, 2] < hflip, h, w, prefix)

    @property
    def move(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.dy, self.dx, self.flip

    @cached_property
    def _positions(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return {}

    def positions(
        self, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(source, pad_rows, pad_cols) on ``device``, computed there on first use (one implementation
        for the CPU and a GPU: only the per-sample dy, dx and flip cross to a GPU, a few bytes each)."""
        device = torch.device(device)
        key = str(device)
        if key not in self._positions:
            self._positions[key] = move_positions(*self.move_tensors(device), self.h, self.w, self.prefix)
        return self._positions[key]

    def move_tensors(
        self, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dy, dx, flip) as int64, int64 and bool tensors on ``device``: the move in a form
        :func:`move_positions` takes (a CUDA graph's inputs, ``pipeline.methods.graphed``)."""
        device = torch.device(device)

        def put(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(a))
            if device.type == "cuda":  # pinned + non_blocking: no wait for the GPU's queue here
                t = t.pin_memory().to(device, non_blocking=True)
            return t

        return put(self.dy.astype(np.int64)), put(self.dx.astype(np.int64)), put(np.asarray(self.flip, bool))

    @property
    def source(self) -> torch.Tensor:
        return self.positions()[0]

    @property
    def pad_rows(self) -> torch.Tensor:
        return self.positions()[1]

    @property
    def pad_cols(self) -> torch.Tensor:
        return self.positions()[2]

    def source_on(self, device: torch.device) -> torch.Tensor:
        """``source`` on ``device`` (where the maps it moves are)."""
        return self.positions(device)[0]

    def zero_padding(self, x: torch.Tensor) -> torch.Tensor:
        """Set the padded output pixels of ``x`` (N, C, H, W), moved by ``source``, to zero; in place."""
        if x.device.type != "cpu" or self.prefix:
            return self.zero_padding_masked(x)
        _, pad_rows, pad_cols = self.positions(x.device)
        sample, row = pad_rows.nonzero(as_tuple=True)
        if len(sample):
            x[sample, :, row, :] = 0
        sample, col = pad_cols.nonzero(as_tuple=True)
        if len(sample):
            x[sample, :, :, col] = 0
        return x

    def zero_padding_masked(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`zero_padding` as a GPU does it: one masked fill, with no host round trip to find the
        padded rows (``nonzero`` would wait for the GPU). It assigns +0.0 exactly where the indexed
        assignment does, so the two give the same bits, on any device."""
        _, pad_rows, pad_cols = self.positions(x.device)
        return zero_padding_masked(x, pad_rows, pad_cols, self.prefix)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The cropped and flipped copy of float maps ``x`` (N, C, H, W)."""
        return self.zero_padding(quantile.move_planes(x, self.source_on(x.device)))


def move_positions(dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor, h: int, w: int,
                   prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source, pad_rows, pad_cols) of :class:`CropFlip` from per-sample ``dy``, ``dx`` (int64) and
    ``flip`` (bool) tensors, computed where they are with torch ops alone: no host round trip, so a
    CUDA graph can capture it (``pipeline.methods.graphed``) and the moves of a batch cross to the
    device as a few bytes per sample."""
    device = dy.device
    n = dy.shape[0]
    rows = dy[:, None] + torch.arange(h, device=device)[None, :]  # (n, h) source rows
    cols = torch.arange(w, device=device)[None, :].expand(n, w)
    cols = torch.where(flip[:, None], w - 1 - cols, cols) + dx[:, None]  # (n, w) source columns
    source = rows.clamp(0, h - 1)[:, :, None] * w + cols.clamp(0, w - 1)[:, None, :]
    pad_rows, pad_cols = (rows < 0) | (rows >= h), (cols < 0) | (cols >= w)
    source = source.reshape(n, h * w)
    if prefix:  # prefix tokens read themselves; the grid's positions shift past them
        kept = torch.arange(prefix, device=device)[None, :].expand(n, prefix)
        source = torch.cat([kept, source + prefix], dim=1)
    return source, pad_rows, pad_cols


def zero_padding_masked(x: torch.Tensor, pad_rows: torch.Tensor, pad_cols: torch.Tensor,
                        prefix: int = 0) -> torch.Tensor:
    """Zero, in place, the padded pixels of moved maps ``x`` (N, C, H, W), or of token maps (N, C, 1,
    ``prefix`` + h*w) whose grid is (h, w) = (``pad_rows.shape[1]``, ``pad_cols.shape[1]``): one masked
    fill, no host round trip (:meth:`CropFlip.zero_padding_masked`)."""
    pad = pad_rows[:, None, :, None] | pad_cols[:, None, None, :]
    if not prefix:
        return x.masked_fill_(pad, 0)
    n, c = x.shape[:2]
    h, w = pad_rows.shape[1], pad_cols.shape[1]
    pad = torch.cat([pad.new_zeros(n, 1, prefix), pad.reshape(n, 1, h * w)], dim=2)
    x.view(n, c, -1).masked_fill_(pad, 0)
    return x


def crop_and_flip(x: torch.Tensor, padding: int, hflip: float, u: np.ndarray,
                  grid: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Per-sample random crop (zero padding ``padding``) and horizontal flip of ``x``, drawn from ``u``.

    ``grid`` = (prefix, h, w) for token maps (see :class:`CropFlip`); default: the maps' own (0, H, W).
    """
    n, _, h, w = x.shape
    if n == 0:
        return x.clone()
    prefix, h, w = grid if grid is not None else (0, h, w)
    return CropFlip.draw(n, h, w, padding, hflip, u, prefix).apply(x)
