"""Fake quantizers: error bounds per bit width; per-layer schemes on a model copy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.methods.mixed_precision.fakequant import (
    BIT_CHOICES,
    FakeQuantModel,
    affine_params,
    fake_quant_affine,
    fake_quant_weight,
    symmetric_scale,
)
from pipeline.models.zoo import build_backbone

ranges = st.tuples(st.floats(-50, 50), st.floats(1e-3, 100)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=40, deadline=None)
@given(bounds=ranges, bits=st.sampled_from(BIT_CHOICES), seed=st.integers(0, 10_000))
def test_affine_error_at_most_half_a_step_inside_the_range(
    bounds: tuple[float, float], bits: int, seed: int
) -> None:
    lo, hi = bounds
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(512, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    scale, zp = affine_params(lo, hi, bits)
    assert 0 <= zp <= (1 << bits) - 1
    err = (fake_quant_affine(x, lo, hi, bits) - x).abs().max().item()  # written-out arithmetic
    assert err <= scale / 2 * (1 + 1e-9) + 1e-12
    x32 = x.float()  # the fused float32 kernel: same bound up to float32 rounding
    err32 = (fake_quant_affine(x32, lo, hi, bits).double() - x32.double()).abs().max().item()
    assert err32 <= scale / 2 + 1e-6 * max(abs(lo), abs(hi), 1.0)
    assert scale <= (max(hi, 0) - min(lo, 0)) / ((1 << bits) - 1) * (1 + 1e-12)


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from(BIT_CHOICES), seed=st.integers(0, 10_000), spread=st.floats(1e-3, 10))
def test_weight_error_at_most_half_a_step_per_channel(bits: int, seed: int, spread: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 3, 3, 3, generator=gen, dtype=torch.float64) * spread
    q = fake_quant_weight(w, bits)
    step = symmetric_scale(w, bits)
    assert bool(((q - w).abs() <= step / 2 * (1 + 1e-9)).all())
    # at most 2^(bits-1)-1 positive and as many negative levels per channel (+ zero)
    levels = torch.round(q / step)
    assert levels.abs().max().item() <= (1 << (bits - 1)) - 1


def test_error_shrinks_with_bits_and_zero_is_exact() -> None:
    x = torch.linspace(-1, 3, 1001)
    errs = [(fake_quant_affine(x, -1, 3, b) - x).abs().max().item() for b in BIT_CHOICES]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 1e-4
    assert fake_quant_affine(torch.zeros(3), -1, 3, 4).abs().max().item() == 0.0  # zero padding stays 0
    assert (
        fake_quant_affine(torch.tensor([10.0, -10.0]), -1, 3, 8) - torch.tensor([3.0, -1.0])
    ).abs().max() < 0.02


@pytest.fixture(scope="module")
def small_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_backbone("squeezenet1_1", 3, small_input=True).eval()


def test_fake_quant_model_schemes(small_net: torch.nn.Module) -> None:
    layers = [n for n, m in small_net.named_modules() if isinstance(m, torch.nn.Conv2d)][:6]
    torch.manual_seed(1)
    x = torch.randn(16, 3, 32, 32)
    fq = FakeQuantModel(small_net, layers, [x[:8], x[8:]])  # static ranges cover every input

    def features(net: torch.nn.Module) -> torch.Tensor:  # after two Fire modules: O(1) values at random init
        return torch.nn.Sequential(*net.blocks[:5])(x)

    with torch.no_grad():
        ref = features(small_net)
        fq.set_scheme({})
        torch.testing.assert_close(features(fq.model), ref)  # float scheme = the model
        fq.set_scheme(dict.fromkeys(layers, 16))
        err16 = (features(fq.model) - ref).abs().max().item()
        fq.set_scheme(dict.fromkeys(layers, 4))
        err4 = (features(fq.model) - ref).abs().max().item()
        fq.set_scheme({})
        torch.testing.assert_close(features(fq.model), ref)  # float weights restored exactly
    assert err16 < 1e-3 * ref.abs().max().item() + 1e-5 < err4
    # the caller's model is untouched
    assert all(not h for m in small_net.modules() for h in (m._forward_pre_hooks,))
