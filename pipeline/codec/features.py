"""Feature streams coded for storage and decoded back (Cache & Reuse, Eq. 2 and Eq. 3).

Training splits are coded as bit-packed n-bit codes with a per-sample, per-channel range
(``lo``, ``scale``); other splits keep float16 (or float32). The quantize and dequantize
stages are thin wrappers over this module, and so are NeuroFlux's spills, which store a
block's outputs with the same codec.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from ..errors import StageError
from ..lazy import lazy_module
from ..ops.batching import Batch, batch_size_of
from ..ops.device_feed import to_device
from ..spec import FieldSpec, Quantization, Spec, SplitSpec
from ..stream import MapStream, Stream

if TYPE_CHECKING:
    import torch

    from . import bitpack, moves, native, quantile
    from .moves import CropFlip
else:
    torch = lazy_module("torch")
    bitpack = lazy_module("pipeline.codec.bitpack")
    native = lazy_module("pipeline.codec.native")
    quantile = lazy_module("pipeline.codec.quantile")
    moves = lazy_module("pipeline.codec.moves")

FLOAT_BITS = {16: "float16", 32: "float32"}


def quantized_fields(shape: tuple[int, ...], bits: int) -> dict[str, FieldSpec]:
    c = shape[0]
    n = 1
    for d in shape:
        n *= d
    return {"codes": FieldSpec((bitpack.packed_length(n, bits),), "uint8"), "lo": FieldSpec((c,), "float16"),
            "scale": FieldSpec((c,), "float16")}


def feature_field(spec: Spec, split: str, stage: str) -> FieldSpec:
    field = spec.split(split, stage=stage).fields.get("x")
    if field is None or len(field.shape) != 3:
        raise StageError(f"expected feature maps 'x' of shape (C,H,W) in split {split!r}, found {field}")
    return field


def coded_spec(data: Spec, bits_for: Callable[[str], int], bits: int, k: float, *, stage: str) -> Spec:
    """The spec of ``data``'s feature maps coded at ``bits_for(split)`` bits per value."""
    splits = {}
    for name, s in data.splits.items():
        field = feature_field(data, name, stage)
        split_bits = bits_for(name)
        fields = dict(s.fields)
        del fields["x"]
        if split_bits in FLOAT_BITS:
            fields["x"] = FieldSpec(field.shape, FLOAT_BITS[split_bits])
        else:
            fields.update(quantized_fields(field.shape, split_bits))
        splits[name] = SplitSpec(s.num_samples, fields)
    feature_shape = next(iter(data.splits.values())).fields["x"].shape
    # A stream coded again (an n-bit cache made from a dequantized float one) says how it is coded now.
    data = data.without_coding(quantization=False)
    return data.with_quantization(splits, Quantization(bits, k, feature_shape))


def decoded_spec(data: Spec) -> Spec:
    """The spec of a coded stream decoded back to float32 maps ``x``."""
    q = data.quantization
    if q is None:
        raise StageError("expected a quantized feature stream (from a quantize stage), "
                         f"found a stream with fields {sorted(next(iter(data.splits.values())).fields)}")
    splits, coded_bits = {}, {}
    for name, s in data.splits.items():
        fields = {k: v for k, v in s.fields.items() if k not in ("codes", "lo", "scale", "x")}
        fields["x"] = FieldSpec(q.feature_shape, "float32")
        splits[name] = SplitSpec(s.num_samples, fields)
        x = s.fields.get("x")
        coded_bits[name] = q.bits if x is None else 8 * FieldSpec((), x.dtype).nbytes()
    # Which splits were rounded on the way (a derived cut refuses lossy sources): the float32 maps
    # made here no longer say so.
    return data.as_stream(splits).with_coded_bits(coded_bits)


def encoded(parent: Stream, spec: Spec, bits_for: Callable[[str], int], k: float) -> MapStream:
    """``parent``'s maps coded as ``spec`` (from :func:`coded_spec`) says, batch by batch."""

    def encode(batch: Batch, split: str, epoch: int, seed: int) -> Batch:
        bits = bits_for(split)
        out = {key: v for key, v in batch.items() if key != "x"}
        if bits in FLOAT_BITS:
            out["x"] = batch["x"].to(getattr(torch, FLOAT_BITS[bits]))
        else:
            q = quantile.quantize(batch["x"], bits, k if k < 1 else int(k))
            out.update(codes=q.codes, lo=q.lo, scale=q.scale)
        return out

    return MapStream(parent, encode, spec)


# What a training step needs on its device: the coded maps and the labels (sample ids stay on the
# host, where seeded feature augmentation reads them).
DEVICE_KEYS = ("codes", "lo", "scale", "x", "y")
# A batch's moves (crop and flip) as :meth:`CropFlip.move_tensors` gives them, beside its coded maps.
MOVE_KEYS = ("dy", "dx", "flip")


class DequantizedStream(MapStream):
    """A coded stream's batches as float32 feature maps ``x``, made on ``device``.

    :meth:`decode` can also crop and flip each map while it dequantizes, which is how the
    runner's dequantize + feature_aug fusion (``pipeline.fusion``) moves the stored codes
    instead of the floats.

    On a GPU the stored bytes go to the device as they are (packed codes, float16 ``lo`` and
    ``scale``: at 2 bits 16x fewer than float32 maps), pinned and copied a few batches ahead
    (:func:`pipeline.ops.device_feed.to_device`), and the unpacking, Eq. 3 and the moves run there
    with the same torch ops the CPU falls back to, which give the CPU's bits: the unpacking is
    integer work, the moves are gathers and assignments of +0.0, and Eq. 3 is an exact product and
    one float32 addition, correctly rounded on both (``tests/test_cuda_data.py`` checks it).
    """

    def __init__(self, parent: Stream, spec: Spec, *, device: torch.device | None = None,
                 feed_depth: int = 3) -> None:
        super().__init__(parent, lambda batch, *_: self.decode(batch), spec)
        q = spec.quantization
        if q is None:
            raise StageError("dequantize: its spec carries no quantization")
        c, h, w = q.feature_shape  # (C, H, W) maps, as quantize required
        self.shape = (c, h, w)
        self.bits = q.bits
        self.device = device if device is not None else torch.device("cpu")
        self.feed_depth = feed_depth

    def fed(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """``batches`` (as stored) on this stream's device, copied ``feed_depth`` batches ahead."""
        return to_device(batches, self.device, DEVICE_KEYS, depth=self.feed_depth)

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        batches = self.fed(self.parent.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start))
        for batch in batches:
            t0 = time.perf_counter()
            out = self.decode(batch)
            self.stats.add(time.perf_counter() - t0, batch_size_of(out))
            yield out

    def open_coded(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
                   start: int = 0) -> Iterator[Batch]:
        """``split``'s batches as stored (``codes``/``lo``/``scale`` or a float16 ``x``, and ``y``), on this
        stream's device: :meth:`decode_coded` makes the maps. A trainer that decodes in its own step can
        capture the decoding with the step (``pipeline.methods.graphed``)."""
        for batch in self.fed(self.parent.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start)):
            yield {key: value for key, value in batch.items() if key in DEVICE_KEYS}

    def decode_coded(self, batch: Batch, grid: tuple[int, int, int] | None = None) -> torch.Tensor:
        """float32 maps of a batch of :meth:`open_coded`, moved by its ``dy``/``dx``/``flip`` where it has
        them (on the (prefix, h, w) ``grid``, default the maps' own): the bits :meth:`decode` gives, made
        with torch ops alone, which wait for nothing on the host (capturable in a CUDA graph)."""
        moved = all(key in batch for key in MOVE_KEYS)
        source = pad_rows = pad_cols = None
        prefix, h, w = grid if grid is not None else (0, self.shape[1], self.shape[2])
        if moved:
            source, pad_rows, pad_cols = moves.move_positions(batch["dy"], batch["dx"], batch["flip"], h, w,
                                                              prefix)
        if "codes" in batch:
            q = quantile.QuantizedBatch(codes=batch["codes"], lo=batch["lo"], scale=batch["scale"],
                                        bits=self.bits, shape=self.shape)
            x = quantile.dequantize(q, source)
        elif source is not None:
            x = quantile.move_planes(batch["x"], source).float()
        else:
            return batch["x"].float()
        if pad_rows is not None and pad_cols is not None:
            moves.zero_padding_masked(x, pad_rows, pad_cols, prefix)
        return x

    def decode(self, batch: Batch, crop: CropFlip | None = None) -> Batch:
        """``batch`` with ``codes``/``lo``/``scale`` (or a float16 ``x``) replaced by float32 ``x``.

        ``crop`` moves every map on the way, its padding +0.0. On the CPU the compiled kernel makes
        the maps in one pass when it can be built here (:mod:`pipeline.codec.native`); torch ops give
        the same bits otherwise, and are what runs on a GPU, where the batch already is.
        """
        out = {k: v for k, v in batch.items() if k not in ("codes", "lo", "scale", "x")}
        if "codes" in batch:
            device = batch["codes"].device
            x = None
            if device.type == "cpu" and (crop is None or not crop.prefix):  # the kernel moves whole maps
                move = None if crop is None else crop.move
                x = native.dequantize_moved(batch["codes"], batch["lo"], batch["scale"], self.bits,
                                            self.shape, move, threads=torch.get_num_threads())
            if x is None:
                q = quantile.QuantizedBatch(codes=batch["codes"], lo=batch["lo"], scale=batch["scale"],
                                            bits=self.bits, shape=self.shape)
                x = quantile.dequantize(q, None if crop is None else crop.source_on(device))
                if crop is not None:
                    crop.zero_padding(x)
        elif crop is not None:  # stored as floats: move the (float16) values, then widen them
            x = crop.zero_padding(quantile.move_planes(batch["x"], crop.source_on(batch["x"].device)).float())
        else:
            x = batch["x"].float()
        out["x"] = x
        return out
