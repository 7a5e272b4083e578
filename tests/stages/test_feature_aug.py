"""Feature-space crop and flip: the fast gather matches a per-sample pad/crop/flip, sample by sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.stages.feature_aug import crop_and_flip, sample_uniforms


def reference(x: torch.Tensor, padding: int, hflip: float, u: np.ndarray) -> torch.Tensor:
    """The definition, one sample at a time: zero-pad, crop at (dy, dx), then flip horizontally."""
    n, c, h, w = x.shape
    span = 2 * padding + 1
    out = []
    for i in range(n):
        dy, dx = int(u[i, 0] * span), int(u[i, 1] * span)
        crop = F.pad(x[i], (padding,) * 4)[:, dy : dy + h, dx : dx + w]
        out.append(crop.flip(-1) if u[i, 2] < hflip else crop)
    return torch.stack(out) if out else x.clone()


@settings(deadline=None, max_examples=40)
@given(
    n=st.integers(0, 9),
    c=st.integers(1, 5),
    h=st.integers(1, 9),
    w=st.integers(1, 9),
    padding=st.integers(0, 4),
    hflip=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 3),
)
def test_matches_per_sample_definition(
    n: int, c: int, h: int, w: int, padding: int, hflip: float, seed: int
) -> None:
    x = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(seed))
    u = sample_uniforms(torch.arange(n), seed, 0, 3)
    out = crop_and_flip(x, padding, hflip, u)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, reference(x, padding, hflip, u))


def test_padding_is_exact_zero_even_next_to_non_finite_values() -> None:
    # The padding reads a stored zero, never a masked product: inf/nan beside it cannot leak in as nan.
    x = torch.full((4, 2, 3, 3), float("inf"))
    u = np.array([[0.0, 0.0, 0.9], [0.99, 0.99, 0.9], [0.0, 0.99, 0.1], [0.5, 0.5, 0.9]])
    out = crop_and_flip(x, 1, 0.5, u)
    assert torch.equal(out, reference(x, 1, 0.5, u))
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("shape", [(320, 7, 7), (96, 14, 14)])
def test_identity_and_pure_flip(shape: tuple[int, int, int]) -> None:
    x = torch.randn(6, *shape)
    u = sample_uniforms(torch.arange(6), 0, 0, 3)
    same = crop_and_flip(x, 0, 0.0, u)
    assert torch.equal(same, x) and same.data_ptr() != x.data_ptr()  # a copy: callers may own it
    assert torch.equal(crop_and_flip(x, 0, 1.0, u), x.flip(-1))


def test_non_contiguous_input() -> None:
    x = torch.randn(5, 4, 6, 6).permute(0, 1, 3, 2)  # a view with transposed strides
    u = sample_uniforms(torch.arange(5), 1, 2, 3)
    assert torch.equal(crop_and_flip(x, 2, 0.5, u), reference(x.contiguous(), 2, 0.5, u))
