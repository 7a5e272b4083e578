"""Channel-wise quantile quantization: error bound, exact ends, degenerate channels, errors.

The bound checked is the one derived in ``pipeline/codec/quantile.py``::

    |x_hat - clip(x, lo, hi)| <= scale16 / 2 * (1 + 2**-13) + 2**-24 * |x_hat|

where the ``2**-13`` term covers the four float32 roundings in computing a code (together less than
2**-14 of a step at 255 levels) and ``2**-24 |x_hat|`` the one rounding of ``lo16 + code * scale16`` in
float32.
All reference values here come from an independent full sort, not from the implementation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeline.codec.bitpack import VALID_BITS, packed_length, unpack
from pipeline.codec.quantile import QuantizedBatch, dequantize, quantize, resolve_k

F16_MAX = 65504.0


def reference_range(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) float64 (N, C): the rank-th smallest and rank-th largest value of each channel."""
    s = x.double().flatten(2).sort(-1).values
    return s[..., rank - 1], s[..., -rank]


def codes_of(q: QuantizedBatch) -> torch.Tensor:
    c, h, w = q.shape
    return unpack(q.codes, q.bits, c * h * w).view(-1, c, h * w)


def check_bound(x: torch.Tensor, q: QuantizedBatch, rank: int) -> None:
    lo, hi = reference_range(x, rank)
    lo16, s16 = q.lo.double(), q.scale.double()
    levels = 2**q.bits - 1
    const = hi == lo
    assert ((s16 == 0) == const).all()
    # the stored grid covers the clipping range (directed rounding of lo and scale) ...
    assert (lo16 <= lo)[~const].all()
    assert (lo16 + levels * s16 >= hi)[~const].all()
    xhat = dequantize(q).double().flatten(2)
    clipped = torch.minimum(torch.maximum(x.double().flatten(2), lo[..., None]), hi[..., None])
    bound = s16[..., None] / 2 * (1 + 2**-13) + 2**-24 * xhat.abs()
    err = (xhat - clipped).abs()
    assert (err <= bound)[~const].all(), f"worst excess {(err - bound)[~const].max().item():g}"
    # ... and a constant channel is its value rounded to the nearest float16, exactly
    assert torch.equal(q.lo[const], lo[const].float().half())
    assert (xhat[const] == lo16[const][:, None]).all()
    assert int(codes_of(q).max()) <= levels


def maps(max_n: int = 3, max_c: int = 4, max_hw: int = 6) -> st.SearchStrategy[torch.Tensor]:
    """Feature maps with ties, constant channels, large offsets and tiny ranges (float16 stress)."""

    @st.composite
    def build(draw: st.DrawFn) -> torch.Tensor:
        shape = (draw(st.integers(1, max_n)), draw(st.integers(1, max_c)),
                 draw(st.integers(1, max_hw)), draw(st.integers(1, max_hw)))
        elements = st.one_of(st.floats(-100, 100, width=32), st.sampled_from([0.0, 0.0, 1.0, 6.0, -2.5]))
        base = draw(hnp.arrays(np.float32, shape, elements=elements))
        spread = draw(st.sampled_from([1.0, 1e-3, 1e-6, 100.0]))
        offset = draw(st.sampled_from([0.0, 0.0, 1000.0, -3.7, 30000.0]))
        x = torch.from_numpy(base).double() * spread + offset
        return x.clamp(-F16_MAX, F16_MAX).float()

    return build()


@given(x=maps(), bits=st.sampled_from(VALID_BITS))
@settings(max_examples=200, deadline=None)
def test_error_bound_k1(x: torch.Tensor, bits: int) -> None:
    check_bound(x, quantize(x, bits), 1)


@given(x=maps(max_hw=7), bits=st.sampled_from(VALID_BITS), k=st.integers(1, 8))
@settings(max_examples=150, deadline=None)
def test_error_bound_k_count(x: torch.Tensor, bits: int, k: int) -> None:
    hw = x.shape[2] * x.shape[3]
    k = min(k, (hw + 1) // 2)
    check_bound(x, quantize(x, bits, k), k)


def test_typical_maps_within_half_step() -> None:
    torch.manual_seed(0)
    x = (torch.randn(8, 16, 14, 14) * 2).clamp(0, 6)
    for bits in VALID_BITS:
        q = quantize(x, bits)
        check_bound(x, q, 1)
        rmse = (dequantize(q) - x).pow(2).mean().sqrt().item()
        assert rmse <= 6 / (2**bits - 1) / 2  # well inside the worst case of half a step


@given(x=maps(), bits=st.sampled_from(VALID_BITS))
@settings(max_examples=100, deadline=None)
def test_k1_reconstructs_min_and_max(x: torch.Tensor, bits: int) -> None:
    """The min and max of each channel come back to float16 precision of the stored lo and scale."""
    q = quantize(x, bits)
    flat, xhat = x.double().flatten(2), dequantize(q).double().flatten(2)
    lo, hi = flat.min(-1), flat.max(-1)
    got_lo = xhat.gather(-1, lo.indices[..., None])[..., 0]
    got_hi = xhat.gather(-1, hi.indices[..., None])[..., 0]
    lo16, s16 = q.lo, q.scale
    # lo16 is the float16 at or below lo, so lo is less than one float16 gap above it
    gap_lo = (torch.nextafter(lo16, torch.tensor(float("inf"), dtype=torch.float16)).double() - lo16.double())
    assert ((got_lo - lo.values).abs() <= gap_lo * (1 + 2**-13) + 2**-24 * got_lo.abs()).all()
    # scale16 is the float16 just above the exact step: the top level overshoots by at most levels gaps
    gap_s = s16.double() - torch.nextafter(s16, torch.zeros((), dtype=torch.float16)).double()
    top = torch.minimum((2**bits - 1) * gap_s, s16.double() / 2 * (1 + 2**-13))
    assert ((got_hi - hi.values).abs() <= top + gap_lo + 2**-24 * got_hi.abs()).all()


def test_min_max_exact_when_representable() -> None:
    """With float16-exact steps (15 / (2**bits - 1) for bits <= 4) the extremes are exact."""
    x = torch.tensor([0.0, 1.0, 2.5, 15.0]).view(1, 1, 2, 2)
    for bits in (1, 2, 4):
        xhat = dequantize(quantize(x, bits)).flatten()
        assert xhat[0].item() == 0.0
        assert xhat[3].item() == 15.0


@pytest.mark.parametrize("bits", VALID_BITS)
def test_zero_range_channels(bits: int) -> None:
    x = torch.rand(3, 5, 4, 4) * 6
    x[:, 1] = 0.0  # all-zero ReLU map
    x[0, 2] = 3.0  # constant, float16-representable
    x[1, 3] = 0.1  # constant, not float16-representable
    x[2] = 0.0  # an all-zero sample
    q = quantize(x, bits)
    xhat = dequantize(q)
    assert torch.isfinite(xhat).all()
    codes = codes_of(q)
    for i, c in [(0, 1), (1, 1), (2, 1), (0, 2), (1, 3), (2, 0), (2, 4)]:
        assert q.scale[i, c].item() == 0.0
        assert int(codes[i, c].max()) == 0
        assert torch.equal(xhat[i, c], q.lo[i, c].float().expand(4, 4))  # exactly lo
    assert torch.equal(xhat[:, 1], torch.zeros(3, 4, 4))
    assert torch.equal(xhat[2], torch.zeros(5, 4, 4))
    assert (xhat[0, 2] == 3.0).all()
    assert (xhat[1, 3] == torch.tensor(0.1).half().float()).all()  # nearest float16


def test_single_pixel_maps() -> None:
    x = torch.randn(4, 3, 1, 1)
    for bits in VALID_BITS:
        q = quantize(x, bits)
        assert (q.scale == 0).all()
        assert torch.equal(dequantize(q), x.half().float())


@given(x=maps(), k=st.sampled_from([1, 2]))
@settings(max_examples=60, deadline=None)
def test_one_bit_gives_two_levels(x: torch.Tensor, k: int) -> None:
    k = min(k, (x.shape[2] * x.shape[3] + 1) // 2)
    q = quantize(x, 1, k)
    xhat = dequantize(q).flatten(2)
    levels = torch.stack([q.lo.float(), q.lo.float() + q.scale.float()], -1)  # (N, C, 2)
    on_grid = (xhat[..., None] == levels[:, :, None, :]).any(-1)
    assert on_grid.all()


def test_k_fraction() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 3, 10, 10)
    assert resolve_k(0.1, 100) == 10
    assert resolve_k(0.001, 100) == 1  # rounded to at least one value
    assert resolve_k(0.5, 100) == 50
    assert resolve_k(2.0, 100) == 2
    q = quantize(x, 4, 0.1)
    check_bound(x, q, 10)
    lo, _ = reference_range(x, 10)
    assert (q.lo.double() <= lo).all() and (q.lo.double() > reference_range(x, 9)[0] - 1e-2).all()
    for a, b in [(0.001, 1), (0.05, 5), (5.0, 5)]:
        qa, qb = quantize(x, 4, a), quantize(x, 4, b)
        for field in ("codes", "lo", "scale"):
            assert torch.equal(getattr(qa, field), getattr(qb, field))


def test_clipping_saturates_outliers() -> None:
    x = torch.zeros(1, 1, 4, 4)
    x.view(-1)[:] = torch.arange(16.0)
    x.view(-1)[15] = 1000.0  # outlier
    xhat = dequantize(quantize(x, 8, 2)).flatten()
    assert xhat[15].item() == pytest.approx(14.0, abs=0.05)  # clipped to the 2nd largest
    assert xhat[0].item() == pytest.approx(1.0, abs=0.05)  # and the 2nd smallest


@pytest.mark.parametrize("bad", [0, -1, 1.5, 0.0, float("nan"), 9, "2", True])
def test_bad_k(bad: object) -> None:
    with pytest.raises(ValueError, match="k"):
        quantize(torch.zeros(1, 1, 4, 4), 2, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bits", VALID_BITS)
def test_shapes_and_dtypes(bits: int) -> None:
    x = torch.randn(5, 7, 3, 5)
    before = x.clone()
    q = quantize(x, bits)
    assert torch.equal(x, before)  # input untouched
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (5, packed_length(7 * 3 * 5, bits))
    assert q.lo.dtype == torch.float16 and q.lo.shape == (5, 7)
    assert q.scale.dtype == torch.float16 and q.scale.shape == (5, 7)
    assert q.bits == bits and q.shape == (7, 3, 5)
    assert q.nbytes == q.codes.numel() + 2 * 2 * 5 * 7
    xhat = dequantize(q)
    assert xhat.dtype == torch.float32 and xhat.shape == x.shape
    # the caller builds batches by keyword from stored fields
    again = QuantizedBatch(codes=q.codes.clone(), lo=q.lo.clone(), scale=q.scale.clone(), bits=bits,
                           shape=(7, 3, 5))
    assert torch.equal(dequantize(again), xhat)


@pytest.mark.parametrize("bits", VALID_BITS)
def test_dequantize_rounds_once_and_moves_codes_like_floats(bits: int) -> None:
    # Eq. 3 with one rounding: lo + code * scale is exact in float64 (an 8-bit code times an 11-bit
    # significand, plus a float16), so rounding that to float32 is the one correctly rounded answer.
    x = torch.randn(6, 5, 3, 7, generator=torch.Generator().manual_seed(bits)) * 40
    q = quantize(x, bits)
    codes = codes_of(q).double()
    exact = q.lo.double()[..., None] + codes * q.scale.double()[..., None]
    xhat = dequantize(q)
    assert torch.equal(xhat.view(6, 5, 21), exact.float())
    # ``source`` moves the codes of every channel the same way: what moving the floats would give.
    source = torch.stack([torch.randperm(21, generator=torch.Generator().manual_seed(i)) for i in range(6)])
    moved = torch.gather(xhat.view(6, 5, 21), 2, source[:, None, :].expand(6, 5, 21))
    assert torch.equal(dequantize(q, source).view(6, 5, 21), moved)
    with pytest.raises(ValueError, match=r"source must have shape \(6, 21\)"):
        dequantize(q, source[:, :20])


def test_other_float_dtypes_and_empty_batch() -> None:
    x = torch.randn(2, 3, 4, 4)
    ref = dequantize(quantize(x, 4))
    assert torch.equal(dequantize(quantize(x.double(), 4)), ref)
    x16 = x.half()
    check_bound(x16.float(), quantize(x16, 4), 1)
    empty = quantize(torch.zeros(0, 3, 4, 4), 2)
    assert empty.codes.shape == (0, packed_length(48, 2)) and empty.lo.shape == (0, 3)
    assert dequantize(empty).shape == (0, 3, 4, 4)


@pytest.mark.parametrize("bad", [0, 3, 16, 32])
def test_bad_bits(bad: int) -> None:
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 4, 8\), got"):
        quantize(torch.zeros(1, 1, 2, 2), bad)
    q = quantize(torch.zeros(1, 1, 2, 2), 8)
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 4, 8\)"):
        QuantizedBatch(codes=q.codes, lo=q.lo, scale=q.scale, bits=bad, shape=(1, 2, 2))


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(("value", "found"), [(float("nan"), "NaN"), (float("inf"), "inf"),
                                              (float("-inf"), "-inf"), (7e4, "70000"), (-1e6, "1e+06")])
def test_non_finite_or_out_of_range_input(k: int, value: float, found: str) -> None:
    x = torch.rand(3, 4, 3, 3)
    x[1, 2, 0, 1] = value
    with pytest.raises(ValueError, match="sample 1") as info:
        quantize(x, 2, k)
    msg = str(info.value)
    assert "channel 2" in msg and found in msg and "float16 range" in msg


def test_float16_limits_accepted() -> None:
    x = torch.zeros(1, 2, 2, 2)
    x[0, 0] = F16_MAX
    x[0, 1, 0, 0] = -F16_MAX
    x[0, 1, 1, 1] = F16_MAX
    for bits in (2, 4, 8):
        check_bound(x, quantize(x, bits), 1)
    with pytest.raises(ValueError, match=r"sample 0 .*channel 1: range .* too wide for a float16 scale"):
        quantize(x, 1)  # a 1-bit step of 131008 does not fit in float16


def test_bad_input_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        quantize(torch.zeros(2, 3, 4), 2)
    with pytest.raises(ValueError, match="float tensor"):
        quantize(torch.zeros(1, 1, 2, 2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="H \\* W >= 1"):
        quantize(torch.zeros(1, 1, 0, 2), 2)


def test_batch_validation() -> None:
    q = quantize(torch.rand(2, 3, 4, 4), 2)
    with pytest.raises(ValueError, match=r"QuantizedBatch.codes: expected \(2, 12\)"):
        QuantizedBatch(codes=q.codes[:, :-1], lo=q.lo, scale=q.scale, bits=2, shape=(3, 4, 4))
    with pytest.raises(ValueError, match="QuantizedBatch.lo"):
        QuantizedBatch(codes=q.codes, lo=q.lo.float(), scale=q.scale, bits=2, shape=(3, 4, 4))
    with pytest.raises(ValueError, match="QuantizedBatch.codes"):
        QuantizedBatch(codes=q.codes, lo=q.lo, scale=q.scale, bits=4, shape=(3, 4, 4))
