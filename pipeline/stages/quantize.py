"""Quantize / dequantize feature streams (Cache & Reuse, Eq. 2 and Eq. 3).

Training splits are stored as bit-packed n-bit codes with per-sample, per-channel
range (``lo``, ``scale``); evaluation splits keep float16 by default, because the
deployed model sees real (unquantized) features at inference and evaluation should
measure that model, not the compression.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from ..errors import StageError
from ..lazy import lazy_module
from ..ops.batching import Batch
from ..spec import STREAM, FieldSpec, Quantization, Spec, SplitSpec
from ..stage import Stage, StageCall
from ..stream import MapStream, Stream

if TYPE_CHECKING:
    import torch

    from ..codec import bitpack, native, quantile
    from ..codec.moves import CropFlip
    from ..context import RunContext
else:
    torch = lazy_module("torch")
    bitpack = lazy_module("pipeline.codec.bitpack")
    native = lazy_module("pipeline.codec.native")
    quantile = lazy_module("pipeline.codec.quantile")

FLOAT_BITS = {16: "float16", 32: "float32"}


def quantized_fields(shape: tuple[int, ...], bits: int) -> dict[str, FieldSpec]:
    c = shape[0]
    n = 1
    for d in shape:
        n *= d
    return {"codes": FieldSpec((bitpack.packed_length(n, bits),), "uint8"), "lo": FieldSpec((c,), "float16"),
            "scale": FieldSpec((c,), "float16")}


def _feature_field(spec: Spec, split: str, stage: str) -> FieldSpec:
    field = spec.split(split, stage=stage).fields.get("x")
    if field is None or len(field.shape) != 3:
        raise StageError(f"expected feature maps 'x' of shape (C,H,W) in split {split!r}, found {field}")
    return field


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

    def resolve(self, inputs: dict[str, Spec], ctx: RunContext) -> Spec:
        data = inputs["input"]
        splits = {}
        for name, s in data.splits.items():
            field = _feature_field(data, name, self.type_name)
            bits = self._bits_for(name)
            fields = dict(s.fields)
            del fields["x"]
            if bits in FLOAT_BITS:
                fields["x"] = FieldSpec(field.shape, FLOAT_BITS[bits])
            else:
                fields.update(quantized_fields(field.shape, bits))
            splits[name] = SplitSpec(s.num_samples, fields)
        feature_shape = next(iter(data.splits.values())).fields["x"].shape
        return data.with_quantization(splits, Quantization(self.bits, self.k, feature_shape))

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> MapStream:
        parent = inputs["input"]

        def encode(batch: Batch, split: str, epoch: int, seed: int) -> Batch:
            bits = self._bits_for(split)
            out = {k: v for k, v in batch.items() if k != "x"}
            if bits in FLOAT_BITS:
                out["x"] = batch["x"].to(getattr(torch, FLOAT_BITS[bits]))
            else:
                q = quantile.quantize(batch["x"], bits, self.k if self.k < 1 else int(self.k))
                out.update(codes=q.codes, lo=q.lo, scale=q.scale)
            return out

        return MapStream(parent, encode, call.spec)


class Dequantize(Stage):
    """Back to float32 feature maps (Eq. 3); float16 splits are upcast."""

    type_name: ClassVar[str] = "dequantize"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": STREAM}

    input: str

    def resolve(self, inputs: dict[str, Spec], ctx: RunContext) -> Spec:
        data = inputs["input"]
        q = data.quantization
        if q is None:
            raise StageError("expected a quantized feature stream (from a quantize stage), "
                             f"found a stream with fields {sorted(next(iter(data.splits.values())).fields)}")
        shape = q.feature_shape
        splits = {}
        for name, s in data.splits.items():
            fields = {k: v for k, v in s.fields.items() if k not in ("codes", "lo", "scale", "x")}
            fields["x"] = FieldSpec(shape, "float32")
            splits[name] = SplitSpec(s.num_samples, fields)
        return data.as_stream(splits)

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> DequantizedStream:
        return DequantizedStream(inputs["input"], call.spec)


class DequantizedStream(MapStream):
    """A quantized stream's batches as float32 feature maps ``x``: the dequantize stage's output.

    :meth:`decode` can also crop and flip each map while it dequantizes, which is how the
    runner's dequantize + feature_aug fusion (``pipeline.fusion``) moves the stored codes
    instead of the floats.
    """

    def __init__(self, parent: Stream, spec: Spec) -> None:
        super().__init__(parent, lambda batch, *_: self.decode(batch), spec)
        q = spec.quantization
        if q is None:
            raise StageError("dequantize: its spec carries no quantization")
        self.shape = q.feature_shape
        self.bits = q.bits

    def decode(self, batch: Batch, crop: CropFlip | None = None) -> Batch:
        """``batch`` with ``codes``/``lo``/``scale`` (or a float16 ``x``) replaced by float32 ``x``.

        ``crop`` moves every map on the way, its padding +0.0: how a feature augmentation fused
        with this stage augments the stored codes instead of the floats. The compiled kernel makes the
        maps in one pass when it can be built here (:mod:`pipeline.codec.native`); torch ops give
        the same bits otherwise.
        """
        out = {k: v for k, v in batch.items() if k not in ("codes", "lo", "scale", "x")}
        if "codes" in batch:
            move = None if crop is None else crop.move
            x = native.dequantize_moved(batch["codes"], batch["lo"], batch["scale"], self.bits, self.shape,
                                        move, threads=torch.get_num_threads())
            if x is None:
                q = quantile.QuantizedBatch(codes=batch["codes"], lo=batch["lo"], scale=batch["scale"],
                                            bits=self.bits, shape=self.shape)
                x = quantile.dequantize(q, None if crop is None else crop.source)
                if crop is not None:
                    crop.zero_padding(x)
        elif crop is not None:  # stored as floats: move the (float16) values, then widen them
            x = crop.zero_padding(quantile.move_planes(batch["x"], crop.source).float())
        else:
            x = batch["x"].float()
        out["x"] = x
        return out
