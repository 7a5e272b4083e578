"""Memory profiler: training memory of each layer (with its auxiliary head) vs batch size.

NeuroFlux profiles every layer on the device at a few batch sizes and fits a line,
``memory(b) = slope * b + intercept``, which the partitioner inverts to find the largest
batch under a budget. On a CUDA device it reads the allocator, as the paper does: the peak
of ``torch.cuda.max_memory_allocated`` over one real training step (forward, loss, backward,
optimizer step) of a copy of the module, above what was allocated before the copy was made
(``pipeline.models.memory.device_step_peak``). On a CPU there is no allocator to read, so
"memory" is the toolkit's training-memory meter
(``pipeline.models.memory.footprint``), measured on one real training step: the bytes of
every tensor autograd saves for backward, plus weights and buffers, gradients and the
optimizer state. The intercept is the static part (weights, gradients, optimizer state),
the slope what one more sample costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...lazy import lazy_module

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...models import memory
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")
    memory = lazy_module("pipeline.models.memory")

# From 2: batch norm cannot train on one sample of a 1x1 map (late VGG layers); b=1 is extrapolated.
DEFAULT_BATCHES = (2, 4, 8, 16)


@dataclass(frozen=True)
class MemoryFit:
    """``bytes(b) = slope * b + intercept`` fitted to measurements at ``batches``."""

    name: str
    slope: float
    intercept: float
    r2: float
    batches: tuple[int, ...]
    measured: tuple[int, ...]

    def bytes_at(self, batch: int) -> float:
        return self.slope * batch + self.intercept

    def max_batch(self, budget: float, cap: int) -> int:
        """Largest batch (at most ``cap``) whose predicted memory fits ``budget``; 0 if none does."""
        if self.slope <= 0:
            return cap if self.intercept <= budget else 0
        return int(max(0, min(cap, np.floor((budget - self.intercept) / self.slope))))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_line(name: str, batches: Sequence[int], measured: Sequence[int]) -> MemoryFit:
    b = np.asarray(batches, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    slope, intercept = np.polyfit(b, m, 1)
    residual = float(((m - (slope * b + intercept)) ** 2).sum())
    total = float(((m - m.mean()) ** 2).sum())
    r2 = 1.0 - residual / total if total > 0 else 1.0
    return MemoryFit(
        name,
        float(slope),
        float(intercept),
        r2,
        tuple(int(x) for x in batches),
        tuple(int(x) for x in measured),
    )


def profile_module(
    name: str,
    module: nn.Module,
    sample_shape: tuple[int, ...],
    *,
    num_classes: int,
    optimizer: str,
    batches: Sequence[int] = DEFAULT_BATCHES,
    device: torch.device | str = "cpu",
) -> MemoryFit:
    """Measure one training step of ``module`` at each batch size on ``device`` and fit the line."""
    if len(batches) < 2:
        raise ValueError(f"profiling needs at least two batch sizes to fit a line, got {list(batches)}")
    measured = []
    for b in batches:
        if torch.device(device).type == "cuda":
            measured.append(memory.device_step_peak(module, (b, *sample_shape), device,
                                                    num_classes=num_classes, optimizer=optimizer))
            continue
        fp = memory.footprint(module, (b, *sample_shape), num_classes=num_classes, optimizer=optimizer)
        assert fp.total_measured_bytes is not None  # measure=True is footprint()'s default
        measured.append(int(fp.total_measured_bytes))
    return fit_line(name, batches, measured)
