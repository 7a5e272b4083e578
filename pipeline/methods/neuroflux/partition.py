"""The partitioner: NeuroFlux's Algorithm 1, layers -> blocks with their own batch sizes.

1. For every layer, the largest batch whose profiled memory fits the budget ``M``,
   capped at ``B`` (a layer that cannot take even one sample is an error naming it).
2. Consecutive layers are grouped while their batch sizes stay within ``rho`` of each
   other, relative to the larger (``(max - min) / max <= rho``); ``rho = 0.4`` as in the paper.
3. A block trains with the smallest batch of its layers.

One addition the paper leaves implicit: a block's layers train together, batch by batch,
so their weights, gradients and optimizer states are all in memory while only one layer's
activations are (each layer's graph is freed after its local step). A block is therefore
also kept within ``M`` as a whole, ``sum(intercepts) + max(slopes) * b <= M``: a layer joins a
block only if the block's batch under that rule stays within ``rho`` of its smallest per-layer
batch (else it starts a new block), and the block's batch is the largest that fits the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import StageError
from .profiler import MemoryFit


class MemoryBudgetError(StageError):
    """The budget cannot hold some layer even at batch size 1."""


@dataclass(frozen=True)
class Block:
    index: int
    layers: tuple[int, ...]
    batch_size: int
    layer_batches: tuple[int, ...]  # step 1's per-layer maxima
    predicted_bytes: int  # the block's memory at its batch size

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_by_batch(batches: Sequence[int], rho: float) -> list[list[int]]:
    """Step 2 alone: consecutive layer indices grouped while ``(max - min) / max <= rho``."""
    if rho < 0:
        raise ValueError(f"rho must be >= 0, got {rho}")
    groups: list[list[int]] = []
    for i, b in enumerate(batches):
        if groups:
            current = [batches[j] for j in groups[-1]] + [b]
            if (max(current) - min(current)) / max(current) <= rho + 1e-12:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def block_bytes(fits: Sequence[MemoryFit], batch: int) -> float:
    """Memory of training ``fits``' layers together at ``batch``: all statics, one layer's activations."""
    return sum(f.intercept for f in fits) + max(f.slope for f in fits) * batch


def block_max_batch(fits: Sequence[MemoryFit], budget: float, cap: int) -> int:
    slope = max(f.slope for f in fits)
    room = budget - sum(f.intercept for f in fits)
    if slope <= 0:
        return cap if room >= 0 else 0
    return int(max(0, min(cap, room // slope)))


def partition(
    fits: Sequence[MemoryFit], budget: int, *, cap: int, rho: float = 0.4, names: Sequence[str] | None = None
) -> list[Block]:
    """Blocks of consecutive layers, each with the batch size it trains at under ``budget`` bytes."""
    if cap < 1:
        raise ValueError(f"the batch size cap must be >= 1, got {cap}")
    names = list(names) if names is not None else [f.name for f in fits]
    batches = []
    for fit, name in zip(fits, names, strict=True):
        b = fit.max_batch(budget, cap)
        if b < 1:
            raise MemoryBudgetError(
                f"memory budget {budget / 2**20:.2f} MiB is too small for layer {name}: it needs "
                f"{fit.bytes_at(1) / 2**20:.2f} MiB to train at batch size 1 "
                f"({fit.intercept / 2**20:.2f} MiB weights, gradients and optimizer state, "
                f"{fit.slope / 2**20:.2f} MiB per sample); raise the budget or use a narrower model"
            )
        batches.append(b)
    blocks: list[list[int]] = []
    for group in group_by_batch(batches, rho):
        for i in group:  # split a group where its layers together would exceed the budget
            if blocks and blocks[-1][-1] == i - 1 and blocks[-1][0] >= group[0]:
                members = [*blocks[-1], i]
                together = [fits[j] for j in members]
                # Joining must not cost the block more than rho of its smallest per-layer batch.
                floor = max(1.0, (1 - rho) * min(batches[j] for j in members))
                if block_max_batch(together, budget, cap) >= floor:
                    blocks[-1].append(i)
                    continue
            blocks.append([i])
    out = []
    for k, layers in enumerate(blocks):
        member_fits = [fits[i] for i in layers]
        b = min(min(batches[i] for i in layers), block_max_batch(member_fits, budget, cap))
        out.append(
            Block(k, tuple(layers), b, tuple(batches[i] for i in layers), int(block_bytes(member_fits, b)))
        )
    return out
