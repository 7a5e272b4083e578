"""The int8 bottom: agrees with fp32 within quantization error; falls back to fp32 with a warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from pipeline.models import int8 as int8_mod
from pipeline.models.int8 import Int8UnavailableWarning, int8_bottom, int8_support
from pipeline.models.zoo import build_backbone, split_at

needs_int8 = pytest.mark.skipif(int8_support()[0] is None, reason=f"no int8 kernels: {int8_support()[1]}")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def bottom_and_data() -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    net = build_backbone("resnet18", 5).eval()
    bottom, _ = split_at(net, 5)  # stem + 3 residual blocks, one with a downsample branch
    calibration = [torch.randn(16, 3, 32, 32) for _ in range(4)]
    return bottom, calibration, torch.randn(16, 3, 32, 32)


@needs_int8
def test_int8_and_fp32_bottoms_agree_within_quantization_error(bottom_and_data) -> None:  # noqa: ANN001
    bottom, calibration, x = bottom_and_data
    q, used = int8_bottom(bottom, calibration)
    assert used == "int8"
    # real int8 kernels (torch.ao.nn.quantized modules: quantized::conv2d), not fake quantization
    kinds = {type(m).__module__ for m in q.modules()}
    assert any(k.startswith(("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized")) for k in kinds)
    with torch.inference_mode():
        ref, out = bottom(x), q(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # 8-bit activations (~1/255 of the range per step) through ~7 conv layers: a few percent, not more
    assert relative_error(out, ref) < 0.1
    # and it is not trivially equal (it really is quantized)
    assert relative_error(out, ref) > 1e-4


def test_without_int8_kernels_falls_back_to_fp32_with_a_warning(bottom_and_data, monkeypatch) -> None:  # noqa: ANN001
    bottom, calibration, x = bottom_and_data
    monkeypatch.setattr(int8_mod, "int8_support", lambda: (None, "the CPU capability is DEFAULT"))
    with pytest.warns(Int8UnavailableWarning, match="int8 requested but the CPU capability is DEFAULT.*fp32"):
        q, used = int8_bottom(bottom, calibration, where="stage 'f'")
    assert used == "fp32" and q is bottom
    with torch.inference_mode():
        torch.testing.assert_close(q(x), bottom(x), rtol=0, atol=0)


def test_bottom_without_layers_stays_as_it_is() -> None:
    empty = torch.nn.Sequential()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q, used = int8_bottom(empty, [torch.randn(2, 3, 4, 4)])
    assert q is empty and used == "fp32"
