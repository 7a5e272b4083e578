"""Channel-wise quantile quantization of feature maps (Cache & Reuse, Eq. 2 and Eq. 3).

Each channel of each sample gets its own clipping range ``[lo, hi]``: the k-th smallest and k-th
largest of its ``H * W`` values (k = 1: min and max). Values are clipped to the range and mapped to
``2**bits`` evenly spaced levels ``lo + code * scale`` with ``scale = (hi - lo) / (2**bits - 1)``;
the codes are bit-packed (:mod:`pipeline.codec.bitpack`) and ``lo``/``scale`` are stored as float16.

Error bound, and why lo/scale are rounded the way they are
----------------------------------------------------------
The stored ``lo`` and ``scale`` are float16, and the codes are computed against those *stored*
values, never against the exact float32 range: dequantization can only use what was stored, so
any code computed against a different grid would carry that difference as extra error. ``lo`` is
rounded toward -inf and ``scale`` toward +inf, so the stored grid ``lo16 + [0, 2**bits - 1] * scale16``
still covers the whole clipping range ``[lo, hi]``. With round-to-nearest the grid could end up to half
a float16 ulp short of ``lo`` or ``hi``, and elements there would exceed the bound below by that much.

For every element, with ``c = clip(x, lo, hi)`` and ``x_hat`` its reconstruction::

    |x_hat - c| <= scale16 / 2 * (1 + 2**-13) + 2**-24 * |x_hat|

- ``scale16 / 2``: rounding to the nearest level of a grid that covers ``[lo, hi]``.
- ``2**-13`` relative: the code is ``trunc(fl(fl(fl(c - lo16) * fl(1 / scale16)) + 1/2))``, rounding half
  up; the first three float32 roundings perturb a value of at most ``2**bits - 1 <= 255`` code units by
  at most ``255 * 3 * 2**-24`` units and the addition of 1/2 (to a value below 256) by at most ``2**-17``,
  together less than ``2**-14`` units, which can only flip a tie, so ``|code - exact| <= 1/2 + 2**-14``.
- ``2**-24 |x_hat|``: dequantization ``lo16 + code * scale16`` in float32. The product is exact (an
  8-bit integer times an 11-bit float16 significand fits in float32's 24 bits), so only the final
  addition rounds, by at most half a float32 ulp.

The float16 storage costs accuracy only at the ends of the range, not in between: ``lo16`` is less
than one float16 ulp below ``lo``, and since ``scale16`` is the float16 just above the exact step, the
top level ``lo16 + (2**bits - 1) * scale16`` overshoots ``hi`` by at most ``2**bits - 1`` float16 ulps
of the scale (at most ``(hi - lo) * 2**-10``; the reconstruction of ``hi`` is also within the half step
above). So k = 1 reconstructs each channel's min and max to float16 precision. A channel with ``hi == lo``
(a constant map, e.g. an all-zero ReLU output) gets ``scale = 0``, codes 0 and ``lo`` rounded to the
nearest float16, which reconstructs exactly whenever the constant is a float16 value (0 always is).

Where it runs
-------------
On the CPU, :func:`quantize` hands the work to the compiled kernel (``quantize.c`` through
:mod:`pipeline.codec.native`) when it can be built: the same operations in the same order, one pass
per channel, bytes equal to the torch ops' (tests/codec/test_native_quantize.py). The torch ops below
are the specification, and what runs on a GPU, without a compiler and for every error message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import DataError
from . import native
from .bitpack import check_bits, pack, packed_length, unpack

FLOAT16_MAX = 65504.0
_NEG_INF16 = torch.tensor(float("-inf"), dtype=torch.float16)
_POS_INF16 = torch.tensor(float("inf"), dtype=torch.float16)


@dataclass
class QuantizedBatch:
    """A batch of quantized feature maps: everything :func:`dequantize` needs, as stored on disk.

    ``codes``: uint8 (N, packed_length(C*H*W, bits)), the bit-packed codes of each sample in C, H, W
    order; ``lo``, ``scale``: float16 (N, C), the grid of each channel; ``bits``; ``shape``: (C, H, W).
    """

    codes: torch.Tensor
    lo: torch.Tensor
    scale: torch.Tensor
    bits: int
    shape: tuple[int, int, int]

    def __post_init__(self) -> None:
        self.bits = check_bits(self.bits)
        if len(self.shape) != 3:
            raise ValueError(f"shape must be (C, H, W), got {self.shape!r}")
        self.shape = (int(self.shape[0]), int(self.shape[1]), int(self.shape[2]))
        c, h, w = self.shape
        n = self.codes.shape[0] if self.codes.dim() else -1
        expect = {"codes": ((n, packed_length(c * h * w, self.bits)), torch.uint8),
                  "lo": ((n, c), torch.float16), "scale": ((n, c), torch.float16)}
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                found = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"QuantizedBatch.{name}: expected {shape} {dtype} for {n} sample(s) of "
                                 f"shape {self.shape} at {self.bits} bits, found {found}")

    @property
    def nbytes(self) -> int:
        """Bytes of stored payload: packed codes plus float16 lo and scale."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.lo, self.scale))


def resolve_k(k: int | float, hw: int) -> int:
    """The clipping rank as a count of values: an int k >= 1 as is, a fraction 0 < k < 1 of ``hw``.

    A fraction is rounded to the nearest count, at least 1. The rank may not pass the middle of the
    channel (``k <= ceil(hw / 2)``), where the k-th smallest value would exceed the k-th largest.
    """
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k <= 0:
        raise ValueError(f"k must be an int >= 1 or a fraction 0 < k < 1, got {k!r}")
    if k < 1:
        count = max(1, round(k * hw))
    elif k == int(k):
        count = int(k)
    else:
        raise ValueError(f"k must be an int >= 1 or a fraction 0 < k < 1, got {k!r}")
    if count > (hw + 1) // 2:
        raise ValueError(f"k={k!r} clips {count} of {hw} values per channel at each end; at most "
                         f"{(hw + 1) // 2} (half the channel) is allowed")
    return count


def _check_finite(x: torch.Tensor, vmin: torch.Tensor, vmax: torch.Tensor) -> None:
    """Raise a DataError naming the first (sample, channel) whose extremes are not finite float16 values.

    ``vmin``/``vmax`` are the per-channel extremes, already computed for the range: max and min
    propagate NaN and top-k ranks NaN above everything, so checking them checks every element.
    """
    ok = (vmin >= -FLOAT16_MAX) & (vmax <= FLOAT16_MAX)  # False for NaN too
    if bool(ok.all()):
        return
    i, c = (int(v) for v in (~ok).nonzero()[0])
    values = x[i, c]
    if torch.isnan(values).any():
        found = "NaN"
    elif torch.isinf(values).any():
        found = "inf" if bool((values == float("inf")).any()) else "-inf"
    else:
        found = f"{values.abs().max().item():g}"
    raise DataError(f"quantize: sample {i} (index within the batch), channel {c}: expected finite values "
                    f"within the float16 range [-{FLOAT16_MAX:g}, {FLOAT16_MAX:g}], found {found}")


def _float16_grid(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (lo16, scale16) with ``lo16 <= lo`` and ``lo16 + (2**bits - 1) * scale16 >= hi``.

    Directed rounding keeps the grid covering [lo, hi] (see the module docstring). The step is computed
    in float64 and rounded up to float16, then coverage is verified with exact float64 arithmetic and
    the scale bumped by one float16 ulp where the float64 step was rounded too low (a float16 ulp is
    far larger than that error). Constant channels keep the nearest float16 lo.
    """
    levels = (1 << bits) - 1
    lo64, hi64 = lo.double(), hi.double()
    const = hi64 == lo64
    lo16 = lo.half()
    # The infinities nextafter steps towards, where the values are (a CPU constant would not do on a GPU).
    neg_inf, pos_inf = _NEG_INF16.to(lo.device), _POS_INF16.to(lo.device)
    lo16 = torch.where((lo16.double() > lo64) & ~const, torch.nextafter(lo16, neg_inf), lo16)
    step = torch.where(const, 0.0, (hi64 - lo16.double()) / levels)
    scale16 = step.half()
    scale16 = torch.where(scale16.double() < step, torch.nextafter(scale16, pos_inf), scale16)
    # ``step`` itself was rounded (hi = 2e-16, lo16 = -2 loses hi entirely), so check coverage exactly:
    # float16 values are multiples of 2**-24 below 2**16, so lo16 + levels * scale16 is exact in float64.
    short = (lo16.double() + levels * scale16.double() < hi64) & ~const
    scale16 = torch.where(short, torch.nextafter(scale16, pos_inf), scale16)
    if bool(torch.isinf(scale16).any()):
        i, c = (int(v) for v in torch.isinf(scale16).nonzero()[0])
        raise DataError(f"quantize: sample {i} (index within the batch), channel {c}: range "
                        f"[{lo[i, c].item():g}, {hi[i, c].item():g}] is too wide for a float16 scale at "
                        f"{bits} bit(s); expected hi - lo <= {FLOAT16_MAX * levels:g}")
    return lo16, scale16


def _channel_range(flat: torch.Tensor, rank: int) -> tuple[torch.Tensor, ...]:
    """(lo, hi, vmin, vmax) (N, C) of ``flat`` (N, C, L): the clipping range at ``rank`` and the extremes."""
    if rank == 1:
        lo, hi = flat.amin(-1), flat.amax(-1)
        return lo, hi, lo, hi
    top = flat.topk(rank, dim=-1, largest=True, sorted=True).values
    bottom = flat.topk(rank, dim=-1, largest=False, sorted=True).values
    return bottom[..., -1], top[..., -1], bottom[..., 0], top[..., 0]


def _quantize_compiled(x: torch.Tensor, flat: torch.Tensor, bits: int, rank: int,
                       shape: tuple[int, int, int], threads: int) -> QuantizedBatch | None:
    """The compiled kernel's batch (the same bytes), or None: not built here, or an error to raise.

    For k > 1 the range comes from torch.topk (the kernel does not select); for k = 1 the kernel
    finds it, unless a channel's minimum is zero with both signs present, where torch's sign of
    zero (stored in lo) depends on its vector lanes: then torch's amin/amax give the range. Any
    error (NaN, inf, beyond float16, a scale overflowing float16) returns None, and the torch ops
    raise it with their message.
    """
    out = None
    if rank == 1:
        out = native.quantize(flat, bits, threads=threads)
        if out is None:
            return None
        if out.status not in (0, native.AMBIGUOUS_ZERO):
            return None
    elif native.quantize_kernel() is None:
        return None
    if out is None or out.status != 0:
        lo, hi, vmin, vmax = _channel_range(flat, rank)
        _check_finite(x, vmin, vmax)
        out = native.quantize(flat, bits, (lo, hi), clip=rank > 1, threads=threads)
        if out is None or out.status != 0:
            return None
    return QuantizedBatch(codes=out.codes, lo=out.lo16, scale=out.scale16, bits=bits, shape=shape)


def quantize(x: torch.Tensor, bits: int, k: int | float = 1, *, compiled: bool = True,
             threads: int | None = None) -> QuantizedBatch:
    """Quantize feature maps ``x`` (N, C, H, W) to ``bits`` per value, clipping each channel at rank ``k``.

    The range is ``[k-th smallest, k-th largest]`` of each channel (k = 1: min/max; 0 < k < 1: that
    fraction of H*W values). ``x`` is not modified. Values must be finite and within float16 range (a
    DataError, a ValueError, names the offending sample and channel). On the CPU the compiled kernel
    does the work where it can be built (one pass per channel, plus torch.topk for k > 1);
    ``compiled=False`` runs the torch ops, the same bytes: for k = 1 two reductions (min, max), a dozen
    small ops on the (N, C) grid and five elementwise passes (subtract, scale, +1/2, two narrowing
    casts) plus packing. ``threads``: how many threads the kernel splits the samples between (default
    torch's intra-op thread count; at most one per 8 samples, as waking a sleeping pool worker, or
    starting a thread where the kernels run without OpenMP, costs about as much as a few maps take); no
    byte depends on it.
    """
    bits = check_bits(bits)
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        found = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize: expected a float tensor of feature maps (N, C, H, W), found {found}")
    n, c, h, w = x.shape
    hw = h * w
    if hw == 0:
        raise ValueError(f"quantize: feature maps must have H * W >= 1, found shape {tuple(x.shape)}")
    rank = resolve_k(k, hw)
    # contiguous: a transformer's token maps arrive as transposed views, and the codes are viewed flat below
    flat = x.detach().reshape(n, c, hw).contiguous()
    if flat.dtype != torch.float32:
        flat = flat.float()
    if compiled and flat.device.type == "cpu" and n and c:
        wanted = torch.get_num_threads() if threads is None else threads
        done = _quantize_compiled(x, flat, bits, rank, (c, h, w), max(1, min(wanted, n // 8)))
        if done is not None:
            return done

    lo, hi, vmin, vmax = _channel_range(flat, rank)
    _check_finite(x, vmin, vmax)
    lo16, scale16 = _float16_grid(lo, hi, bits)

    base = lo16.float()
    s32 = scale16.float()
    inv = torch.where(s32 > 0, 1.0 / s32, 0.0)[..., None]  # zero-range channels: every code is 0
    t = torch.sub(flat, base[..., None])
    if rank > 1:
        # clipping after the shift is exact: rounding is monotonic, so clip(fl(x - b)) == fl(clip(x) - b)
        torch.maximum(t, (lo - base)[..., None], out=t)
        torch.minimum(t, (hi - base)[..., None], out=t)
    t.mul_(inv)
    t.add_(0.5)  # + truncation below = round half up; t is in [0, 2**bits - 1] up to 2**-14 (docstring)
    # float -> int16 -> uint8 is much faster than float -> uint8 in torch's CPU kernels
    codes = t.to(torch.int16).to(torch.uint8).view(n, c * hw)
    return QuantizedBatch(codes=pack(codes, bits), lo=lo16, scale=scale16, bits=bits, shape=(c, h, w))


def move_planes(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``x`` (N, C, ...) with each sample's planes rearranged alike: ``out[i, c, p] = x[i, c, source[i, p]]``.

    ``source`` is int64 (N, P), P the number of elements per plane (e.g. H*W), positions in the
    flattened plane; the result has ``x``'s shape. One ``gather`` moves every plane of every sample.
    """
    n, c = x.shape[:2]
    plane = x[0, 0].numel() if n and c else source.shape[-1]
    if source.shape != (n, plane):
        raise ValueError(f"source must have shape {(n, plane)} (samples, elements per plane), "
                         f"got {tuple(source.shape)}")
    moved = torch.gather(x.reshape(n, c, plane), 2, source.view(n, 1, plane).expand(n, c, plane))
    return moved.view(x.shape)


def dequantize(q: QuantizedBatch, source: torch.Tensor | None = None) -> torch.Tensor:
    """float32 (N, C, H, W) feature maps ``lo + code * scale`` (Eq. 3); exact product, one rounding.

    ``source``, int64 (N, H*W), rearranges every map on the way: output position ``p`` of each
    channel of sample ``i`` is read from stored position ``source[i, p]`` (a crop or flip, see
    :mod:`pipeline.codec.moves`). Moving the one-byte codes before they become four-byte
    floats gives what moving the floats would, at a quarter of the memory traffic.
    """
    c, h, w = q.shape
    n = q.codes.shape[0]
    codes = unpack(q.codes, q.bits, c * h * w).view(n, c, h * w)
    if source is not None:
        codes = move_planes(codes, source)
    # Three simple passes beat one addcmul here: torch's addcmul is slower than to/mul_/add_ on
    # feature-map shapes. The product is exact, so this rounds once.
    out = codes.to(torch.float32)
    out.mul_(q.scale.float()[..., None])
    out.add_(q.lo.float()[..., None])
    return out.view(n, c, h, w)
