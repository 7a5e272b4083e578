"""Feature codec of Cache & Reuse: channel-wise quantile quantization to 1/2/4/8 bits, bit-packed.

``quantile.quantize`` / ``quantile.dequantize`` convert float feature maps (N, C, H, W) to a
:class:`~pipeline.codec.quantile.QuantizedBatch` and back; ``bitpack`` holds the on-disk bit layout;
``features`` codes whole feature streams with them; ``moves`` crops and flips feature planes.

The names below are looked up on first use, so importing a submodule (as stage modules do
when a recipe is only validated) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "VALID_BITS": "bitpack", "pack": "bitpack", "packed_length": "bitpack", "unpack": "bitpack",
    "QuantizedBatch": "quantile", "dequantize": "quantile", "quantize": "quantile",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
