"""The compiled quantize kernel: byte for byte the torch ops, at every vector width and thread count.

``quantize(..., compiled=False)`` (the torch ops) is the specification. Every comparison is of the
stored bytes: packed codes and the bit patterns of the float16 lo and scale, so a sign of zero or one
float16 ulp differing would fail. ``GOLDEN`` pins the digests of what the torch ops stored before the
kernel existed, so neither path can drift with the other. Tests that need the kernel are skipped
where no C compiler is found; the fallback tests run everywhere.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.codec import native, quantile
from pipeline.codec.quantile import QuantizedBatch, quantize, resolve_k
from pipeline.errors import DataError

needs_compiler = pytest.mark.skipif(native._compiler() is None, reason="no C compiler on this machine")
F16_MAX = 65504.0
ISAS = (0, 1, 2)  # the baseline build, AVX2, AVX-512 (capped at what the CPU has; one build elsewhere)


def stored(q: QuantizedBatch) -> tuple[bytes, bytes, bytes]:
    return q.codes.numpy().tobytes(), q.lo.view(torch.int16).numpy().tobytes(), \
        q.scale.view(torch.int16).numpy().tobytes()


def digest(q: QuantizedBatch) -> str:
    h = hashlib.sha256()
    for part in stored(q):
        h.update(part)
    return h.hexdigest()[:16]


def compiled_batch(x: torch.Tensor, bits: int, k: int | float, threads: int, isa: int) -> QuantizedBatch:
    """What ``quantize`` stores through the kernel, at a chosen thread count and vector width."""
    n, c, h, w = x.shape
    flat = x.reshape(n, c, h * w).contiguous().float()
    rank = resolve_k(k, h * w)
    out = native.quantize(flat, bits, threads=threads, isa=isa) if rank == 1 else None
    if out is None or out.status != 0:
        assert out is None or out.status == native.AMBIGUOUS_ZERO, out
        lo, hi, _, _ = quantile._channel_range(flat, rank)
        out = native.quantize(flat, bits, (lo, hi), clip=rank > 1, threads=threads, isa=isa)
    assert out is not None and out.status == 0 and out.where == -1
    return QuantizedBatch(codes=out.codes, lo=out.lo16, scale=out.scale16, bits=bits, shape=(c, h, w))


def assert_same_bytes(x: torch.Tensor, bits: int, k: int | float = 1,
                      threads: tuple[int, ...] = (1, 2)) -> None:
    want = stored(quantize(x, bits, k, compiled=False))
    assert stored(quantize(x, bits, k)) == want
    for isa in ISAS:
        for t in threads:
            assert stored(compiled_batch(x, bits, k, t, isa)) == want, (bits, k, t, isa)


def formula_maps(n: int, c: int, h: int, w: int, salt: int = 0) -> torch.Tensor:
    """Deterministic maps from integer formulas (no random generator, so the golden digests hold
    forever): per channel one of ReLU-like, signed, constant, tiny, huge, few-valued, signed-zero."""
    i = np.arange(n * c * h * w, dtype=np.uint64).reshape(n, c, h * w)
    mixed = (i * np.uint64(2654435761) + np.uint64(salt * 97 + 12345)) % np.uint64(1 << 31)
    u = mixed.astype(np.float64) / float(1 << 31)  # in [0, 1)
    kind = (np.arange(n * c).reshape(n, c, 1) * 7 + salt) % 8
    x = np.select(
        [kind == 0, kind == 1, kind == 2, kind == 3, kind == 4, kind == 5, kind == 6],
        [np.maximum(u * 8 - 2, 0),                      # post-ReLU with zeros
         (u - 0.5) * 10 + 3,                            # signed
         np.full_like(u, 0.1 + salt),                   # constant, not a float16 value
         (u - 0.3) * 1e-6,                              # tiny: lo16 subnormal
         (u - 0.5) * 60000,                             # huge range
         np.floor(u * 3) * 0.25 - 0.25,                 # few values, ties
         np.where(u < 0.5, -0.0, u)],                   # -0 as the minimum, no +0
        default=u * 1e4 + 3e4,                          # large offset, small relative range
    )
    return torch.from_numpy(x.astype(np.float32)).view(n, c, h, w)


# Digests of the bytes the torch ops stored at commit 35e0a86 (before the compiled kernel), for
# formula_maps(5, 16, 7, 9, salt) at each (bits, k). Both paths must still store exactly these.
GOLDEN = {
    "0-1-1": "52d604e7412c7feb",
    "0-1-3": "80707d2791594857",
    "0-1-0.1": "8045b9730de21b8a",
    "0-2-1": "e0e3d710ac2cdf19",
    "0-2-3": "0874775ad0015fdf",
    "0-2-0.1": "88de34f2e27aa8ba",
    "0-4-1": "32ce04938257fa4a",
    "0-4-3": "41807a0b50401a3d",
    "0-4-0.1": "d9bfc08ddb1809db",
    "0-8-1": "27473d82c0b76dcd",
    "0-8-3": "1d6eef5e38ee8bbd",
    "0-8-0.1": "1f59b67a88a5516e",
    "1-1-1": "8e8336871d23fea7",
    "1-1-3": "3e34326970dba6e5",
    "1-1-0.1": "349f4414c884bead",
    "1-2-1": "63bc52a38a410b58",
    "1-2-3": "c0e02719e7b4876e",
    "1-2-0.1": "e65aea959665b220",
    "1-4-1": "952c32811593784b",
    "1-4-3": "b631b41e116bf40d",
    "1-4-0.1": "97459cc332eb4267",
    "1-8-1": "eb1fb7a4c49ae016",
    "1-8-3": "9d39f06df0edf349",
    "1-8-0.1": "1476e3a5eafe182d",
}


def golden_cases() -> list[tuple[int, int, int | float]]:
    return [(salt, bits, k) for salt in (0, 1) for bits in (1, 2, 4, 8) for k in (1, 3, 0.1)]


@pytest.mark.parametrize(("salt", "bits", "k"), golden_cases())
def test_stored_bytes_are_todays(salt: int, bits: int, k: int | float) -> None:
    x = formula_maps(5, 16, 7, 9, salt)
    want = GOLDEN[f"{salt}-{bits}-{k}"]
    assert digest(quantize(x, bits, k, compiled=False)) == want
    assert digest(quantize(x, bits, k)) == want


@needs_compiler
@pytest.mark.parametrize(("salt", "bits", "k"), golden_cases())
def test_golden_at_every_vector_width_and_thread_count(salt: int, bits: int, k: int | float) -> None:
    x = formula_maps(5, 16, 7, 9, salt)
    for isa in ISAS:
        for threads in (1, 2, 5):
            assert digest(compiled_batch(x, bits, k, threads, isa)) == GOLDEN[f"{salt}-{bits}-{k}"]


def stress_channel(draw: st.DrawFn, hw: int) -> np.ndarray:
    kind = draw(st.sampled_from(["normal", "relu", "constant", "ties", "tiny", "extreme", "zeros", "pair"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = 10.0 ** draw(st.floats(-7, 3))
    offset = draw(st.sampled_from([0.0, 1.0, -1.0, 1000.0, -3e4, 1e-5])) * draw(st.floats(0, 2))
    if kind == "normal":
        v = rng.standard_normal(hw) * scale + offset
    elif kind == "relu":
        v = np.maximum(rng.standard_normal(hw) * scale, 0)
    elif kind == "constant":
        v = np.full(hw, draw(st.floats(-F16_MAX, F16_MAX, width=32)))
    elif kind == "ties":
        v = rng.integers(0, 3, hw) * scale + offset
    elif kind == "tiny":
        v = rng.standard_normal(hw) * 10.0 ** draw(st.floats(-44, -5))
    elif kind == "extreme":
        v = rng.choice([-F16_MAX, F16_MAX, 65503.9, -65503.9, 0.0, 1.0], hw)
    elif kind == "zeros":
        v = rng.choice([0.0, -0.0, 0.0], hw) if draw(st.booleans()) else rng.choice([-0.0, 1.5, 2.0], hw)
    else:
        ends = st.floats(-F16_MAX, F16_MAX, width=32)
        v = rng.choice([draw(ends), draw(ends)], hw)
    return np.clip(v, -F16_MAX, F16_MAX).astype(np.float32)


@st.composite
def stress_maps(draw: st.DrawFn) -> torch.Tensor:
    n, c = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    h, w = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    channels = [stress_channel(draw, h * w) for _ in range(n * c)]
    return torch.from_numpy(np.stack(channels)).view(n, c, h, w)


@needs_compiler
@settings(max_examples=150, deadline=None)
@given(x=stress_maps(), bits=st.sampled_from([1, 2, 4, 8]), k=st.sampled_from([1, 2, 0.2]))
def test_kernel_equals_torch_ops(x: torch.Tensor, bits: int, k: int | float) -> None:
    try:
        resolve_k(k, x.shape[2] * x.shape[3])
    except ValueError:  # a rank past the middle of a small map
        k = 1
    try:
        assert_same_bytes(x, bits, k)
    except DataError as exc:  # a range too wide for a float16 scale: both refuse it, alike
        with pytest.raises(DataError) as torch_error:
            quantize(x, bits, k, compiled=False)
        assert str(exc) == str(torch_error.value)


@needs_compiler
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_many_random_maps_of_odd_shapes(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    shapes = ((33, 96, 14, 14), (9, 7, 5, 3), (17, 3, 1, 1), (8, 5, 1, 13), (3, 1, 2, 2), (11, 24, 28, 28))
    for shape in shapes:
        x = torch.randn(*shape, generator=g) * torch.rand(shape[0], shape[1], 1, 1, generator=g) * 50
        x += torch.randn(shape[0], shape[1], 1, 1, generator=g) * 10
        assert_same_bytes(x, bits, threads=(1, 2, 3))
        assert_same_bytes(x.clamp(min=0), bits, threads=(1, 2))
        if shape[2] * shape[3] >= 4:
            assert_same_bytes(x, bits, 2, threads=(1, 2))


@needs_compiler
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_degenerate_channels(bits: int) -> None:
    x = torch.randn(6, 8, 5, 5)
    x[0] = 0.0                       # all zero
    x[1] = -0.0                      # all -0: lo is -0
    x[2, :4] = 3.0                   # constant, a float16 value
    x[2, 4:] = 0.1                   # constant, not one
    x[3] = -torch.rand(8, 5, 5) * 7  # all negative
    x[4, :, :2] = 0.0                # +0 and -0 at the minimum: the kernel asks torch for the range
    x[4, :, 2:] = -0.0
    x[4, :, 4] = 5.0
    x[5] = torch.where(torch.rand(8, 5, 5) < 0.5, -0.0, 1.0)  # -0 as the minimum, no +0
    for k in (1, 2):
        assert_same_bytes(x, bits, k)
    ambiguous = native.quantize(x.reshape(6, 8, 25).contiguous(), bits)
    assert ambiguous is not None and ambiguous.status == native.AMBIGUOUS_ZERO


@needs_compiler
def test_every_constant_rounds_to_the_nearest_float16() -> None:
    """Single-pixel maps are constant channels, whose lo is their value rounded to nearest: here
    every float16 value, the ties between neighbours, and random float32 patterns in range."""
    f16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    f16 = f16[f16.isfinite()].float()
    up = torch.nextafter(f16, torch.tensor(float("inf")))
    gen = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), generator=gen, dtype=torch.int64)
    random = patterns.to(torch.int32).view(torch.float32)
    random = random[random.isfinite() & (random.abs() <= F16_MAX)]
    mids = (f16.double()[:-1] + f16.double()[1:]) / 2
    values = torch.cat([f16, up, random, mids.float()])
    values = values[values.abs() <= F16_MAX]
    x = values[: len(values) // 64 * 64].view(-1, 64, 1, 1)
    for bits in (1, 8):
        assert_same_bytes(x, bits, threads=(2,))


@needs_compiler
def test_grid_rounding_over_random_ranges() -> None:
    """Two-value channels [lo, hi] of every magnitude: lo16 rounded down, scale16 up, the step in float64."""
    gen = torch.Generator().manual_seed(1)
    m = 1 << 16
    exps = torch.randint(-30, 16, (2, m), generator=gen).double()
    signs = torch.where(torch.rand(2, m, generator=gen) < 0.5, -1.0, 1.0).double()
    v = (signs * torch.rand(2, m, generator=gen).double() * 2.0**exps).clamp(-F16_MAX, F16_MAX).float()
    near = v[0] + v[0].abs() * torch.rand(m, generator=gen) * 1e-3  # ranges of a few ulps
    for a, b in ((v[0], v[1]), (v[0], near)):
        x = torch.stack([torch.minimum(a, b), torch.maximum(a, b)], -1).view(-1, 64, 1, 2)
        for bits in (1, 2, 4, 8):
            try:
                assert_same_bytes(x, bits, threads=(1,))
            except DataError:  # some pair's range overflows a float16 scale at this width
                with pytest.raises(DataError):
                    quantize(x, bits, compiled=False)


@needs_compiler
@pytest.mark.parametrize("bits", [2, 8])
def test_values_next_to_half_steps_round_like_torch(bits: int) -> None:
    """Values a few float32 ulps from a midpoint between two levels, where the order of the roundings
    decides the code: a multiply-add fused into one rounding gives other codes for some of them."""
    levels = 2**bits - 1
    rng = np.random.default_rng(bits)
    steps = np.arange(0x0400, 0x7800, dtype=np.uint16).view(np.float16).astype(np.float32)
    steps = rng.choice(steps[steps * levels < F16_MAX], 2048)  # float16 scales; lo = 0
    mids = (rng.integers(0, levels, (2048, 62)) + np.float32(0.5)) * steps[:, None]
    near = (mids.astype(np.float32).view(np.int32) + rng.integers(-3, 4, mids.shape).astype(np.int32))
    values = np.concatenate([np.zeros((2048, 1)), levels * steps[:, None], near.view(np.float32)], 1)
    x = torch.from_numpy(values.astype(np.float32)).view(32, 64, 8, 8)
    assert torch.equal(quantize(x, bits, compiled=False).scale.float().flatten(), torch.from_numpy(steps))
    assert_same_bytes(x, bits)


@needs_compiler
@pytest.mark.parametrize(("value", "found"), [(float("nan"), "NaN"), (float("inf"), "inf"),
                                              (float("-inf"), "-inf"), (70000.0, "70000"),
                                              (-65520.0, "65520")])
def test_bad_values_raise_what_the_torch_ops_raise(value: float, found: str) -> None:
    x = torch.rand(20, 3, 4, 4)
    x[13, 2, 1, 3] = value
    for k in (1, 2):
        with pytest.raises(DataError) as compiled:
            quantize(x, 4, k)
        with pytest.raises(DataError) as torch_ops:
            quantize(x, 4, k, compiled=False)
        assert str(compiled.value) == str(torch_ops.value)
        assert "sample 13" in str(compiled.value) and "channel 2" in str(compiled.value)
        assert found in str(compiled.value)
    status = native.quantize(x.view(20, 3, 16), 4)
    assert status is not None and status.status == native.OUT_OF_RANGE


@needs_compiler
def test_a_scale_overflowing_float16_raises_what_the_torch_ops_raise() -> None:
    x = torch.zeros(3, 2, 1, 2)
    x[1, 1, 0] = torch.tensor([-F16_MAX, F16_MAX])
    with pytest.raises(DataError, match="sample 1 .* channel 1: range .* too wide") as compiled:
        quantize(x, 1)
    with pytest.raises(DataError) as torch_ops:
        quantize(x, 1, compiled=False)
    assert str(compiled.value) == str(torch_ops.value)
    out = native.quantize(x.view(3, 2, 2), 1)
    assert out is not None and out.status == native.SCALE_OVERFLOW and out.where == 3
    assert_same_bytes(x, 2)  # at 2 bits the scale fits


@needs_compiler
def test_views_and_other_float_dtypes() -> None:
    x = torch.randn(4, 9, 6, 5) * 4
    assert_same_bytes(x.transpose(2, 3), 4)  # a transposed view: made contiguous first
    assert_same_bytes(x.half().float(), 2)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        assert stored(quantize(x.to(dtype), 4)) == stored(quantize(x.to(dtype), 4, compiled=False))
    assert stored(quantize(x[:0], 4)) == stored(quantize(x[:0], 4, compiled=False))


@needs_compiler
def test_results_do_not_depend_on_threads() -> None:
    x = torch.randn(37, 12, 7, 7)
    want = stored(quantize(x, 2, compiled=False))
    for threads in (1, 2, 3, 8, 64, 100):
        assert stored(quantize(x, 2, threads=threads)) == want


@needs_compiler
def test_bad_arguments_are_named() -> None:
    x = torch.rand(2, 3, 16)
    with pytest.raises(ValueError, match="x must be contiguous float32"):
        native.quantize(x.double(), 2)
    with pytest.raises(ValueError, match="x must be contiguous float32"):
        native.quantize(x.transpose(1, 2), 2)
    with pytest.raises(ValueError, match=r"value_range must be two float32 tensors of shape \(2, 3\)"):
        native.quantize(x, 2, (torch.zeros(2, 3), torch.zeros(3, 2)))
    with pytest.raises(ValueError, match="rejected its arguments"):
        native.quantize(x, 3)
    with pytest.raises(ValueError, match="rejected its arguments"):
        native.quantize(x, 2, clip=True)  # clipping needs a given range


def test_without_compiler_quantize_runs_the_torch_ops(fresh_kernel, monkeypatch) -> None:
    x = formula_maps(5, 16, 7, 9, 1)
    monkeypatch.setenv("CC", os.path.join(str(fresh_kernel), "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="no C compiler found"):
        assert native.quantize_kernel() is None
    assert native.quantize(x.view(5, 16, 63), 2) is None
    for bits in (1, 2, 4, 8):
        for k in (1, 3):
            assert digest(quantize(x, bits, k)) == GOLDEN[f"1-{bits}-{k}"]
    assert not list(fresh_kernel.glob("*.so"))


def test_turned_off_quantize_runs_the_torch_ops(fresh_kernel, monkeypatch) -> None:
    monkeypatch.setenv(native.ENV, "0")
    assert native.quantize_kernel() is None and native.kernel() is None
    x = formula_maps(5, 16, 7, 9, 0)
    assert digest(quantize(x, 4, 0.1)) == GOLDEN["0-4-0.1"]
