"""Quantize / dequantize feature streams (Cache & Reuse, Eq. 2 and Eq. 3) as recipe stages.

Training splits are stored as bit-packed n-bit codes with per-sample, per-channel
range (``lo``, ``scale``); evaluation splits keep float16 by default, because the
deployed model sees real (unquantized) features at inference and evaluation should
measure that model, not the compression. The coding itself is ``pipeline.codec.features``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from ..codec.features import DequantizedStream, coded_spec, decoded_spec, encoded, quantized_fields
from ..spec import STREAM, Spec
from ..stage import Stage, StageCall, StageInputs
from ..stream import MapStream

if TYPE_CHECKING:
    from ..context import RunContext

__all__ = ["Dequantize", "DequantizedStream", "Quantize", "quantized_fields"]


class Quantize(Stage):
    """Channel-wise quantile quantization to ``bits`` (1/2/4/8), or float16/32 storage (16/32 = none)."""

    type_name: ClassVar[str] = "quantize"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": STREAM}

    input: str
    bits: Literal[1, 2, 4, 8, 16, 32] = 8
    k: float = Field(
        1, gt=0, description="clip at the k-th smallest/largest value per channel (k<1: fraction)"
    )
    splits: tuple[str, ...] = Field(("train",), description="splits to quantize; others use eval_bits")
    eval_bits: Literal[16, 32] = 16

    def _bits_for(self, split: str) -> int:
        return self.bits if split in self.splits else self.eval_bits

    def sample_dependence(self) -> str | None:
        return None  # ranges per sample and channel

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        return coded_spec(inputs["input"], self._bits_for, self.bits, self.k, stage=self.type_name)

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> MapStream:
        return encoded(inputs["input"], call.spec, self._bits_for, self.k)


class Dequantize(Stage):
    """Back to float32 feature maps (Eq. 3); float16 splits are upcast."""

    type_name: ClassVar[str] = "dequantize"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": STREAM}

    input: str

    def sample_dependence(self) -> str | None:
        return None

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        return decoded_spec(inputs["input"])

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> DequantizedStream:
        return DequantizedStream(inputs["input"], call.spec, device=getattr(ctx, "torch_device", None))
