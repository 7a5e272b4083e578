"""A forward pass whose per-sample outputs do not depend on the thread count or the batch they came in.

Used wherever a forward's outputs are stored (the frozen forward of a cache build, NeuroFlux's spills).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

# A stored forward computes every batch as one of a multiple of this many samples (zero rows added,
# their outputs dropped). Why: oneDNN picks how it blocks and splits a convolution by batch size, and
# for a batch that is not a multiple of 16 (an epoch's short last batch) the split depends on the
# thread count, so the same sample gave other bits at 1 and 2 threads; padded, a sample's output is
# the same whatever the thread count and whatever batch it came in (tests/test_determinism.py).
FORWARD_BLOCK = 16


def padded_forward(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                   block: int | None = None) -> torch.Tensor:
    """``module(x)`` computed on ``x`` padded with zero samples to a multiple of ``block`` (default
    ``FORWARD_BLOCK``); the padding's outputs are dropped. Only for a module that treats samples
    independently (eval mode: no batch statistics)."""
    n = len(x)
    extra = -n % (FORWARD_BLOCK if block is None else block)
    if not extra:
        return module(x)
    return module(torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]))[:n]
