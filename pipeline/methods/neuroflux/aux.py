"""Auxiliary classifiers: the local loss each layer trains against.

Every layer gets ``conv 3x3 -> BN -> ReLU -> adaptive average pool -> linear``. What
differs is the conv's filter count:

- **adaptive** (NeuroFlux's AAN-LL): half the *smallest* layer width of the CNN for layers
  that work at full resolution (before the first downsampling), where activations are
  largest and a wide auxiliary conv would dominate memory; half the *largest* width after
  (VGG: 32 and 256);
- **classic** local learning: the same filter count everywhere, half the largest width
  (256 for a full-width VGG, the paper's baseline).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from .models import LayerInfo

AuxKind = Literal["adaptive", "classic"]


class AuxHead(nn.Module):
    def __init__(self, in_channels: int, filters: int, num_classes: int, pool: int = 2) -> None:
        super().__init__()
        self.filters = filters
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, filters, 3, padding=1, bias=False),
            nn.BatchNorm2d(filters),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(pool),
            nn.Flatten(),
        )
        self.fc = nn.Linear(filters * pool * pool, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


def aux_filters(info: list[LayerInfo], kind: AuxKind) -> list[int]:
    """Filter count of each layer's auxiliary conv under the ``kind`` rule."""
    widths = [layer.width for layer in info]
    small, large = max(1, min(widths) // 2), max(1, max(widths) // 2)
    if kind == "classic":
        return [large] * len(info)
    if kind != "adaptive":
        raise ValueError(f"unknown auxiliary network kind {kind!r}; expected 'adaptive' or 'classic'")
    return [small if layer.before_downsampling else large for layer in info]


def build_aux_heads(
    info: list[LayerInfo], kind: AuxKind, num_classes: int, *, pool: int = 2, seed: int | None = None
) -> nn.ModuleList:
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed + 1)
        return nn.ModuleList(
            AuxHead(layer.out_shape[0], filters, num_classes, pool)
            for layer, filters in zip(info, aux_filters(info, kind), strict=True)
        )


class LocalLayer(nn.Module):
    """One layer with its auxiliary head: what trains (and is profiled) as a unit."""

    def __init__(self, layer: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.layer, self.head = layer, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


class ExitModel(nn.Module):
    """The layers up to an exit followed by that exit's auxiliary head: the compact model."""

    def __init__(self, layers: list[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))
