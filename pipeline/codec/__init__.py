"""Feature codec of Cache & Reuse: channel-wise quantile quantization to 1/2/4/8 bits, bit-packed.

``quantile.quantize`` / ``quantile.dequantize`` convert float feature maps (N, C, H, W) to a
:class:`~pipeline.codec.quantile.QuantizedBatch` and back; ``bitpack`` holds the on-disk bit layout.
"""

from __future__ import annotations

from .bitpack import VALID_BITS, pack, packed_length, unpack
from .quantile import QuantizedBatch, dequantize, quantize

__all__ = ["VALID_BITS", "QuantizedBatch", "dequantize", "pack", "packed_length", "quantize", "unpack"]
