"""MobileTL: sign-mask backward, bit-packed masks, shift-only BN, the paper's block numbers, bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torchvision.models import mobilenetv2, mobilenetv3

from pipeline.errors import ModelError
from pipeline.methods.adapters import MobileTLMethod, apply_method
from pipeline.methods.finetune import Finetune
from pipeline.methods.layers import (
    ShiftBatchNorm2d,
    SignHardswish,
    SignReLU6,
    convert,
    pack_mask,
    unpack_mask,
)
from pipeline.methods.mobiletl import check_mobiletl_top, main_branch, mobiletl_block
from pipeline.models.memory import footprint
from pipeline.models.zoo import build_backbone, feature_shape, split_at
from pipeline.registry import stage_from_config


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is as fast, and never spins against other jobs on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def saved_tensors(fn):  # noqa: ANN001, ANN201
    """Run ``fn()`` and return (its result, [tensors autograd saved for backward])."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("layer, fn", [(nn.ReLU6(inplace=True), nn.functional.relu6),
                                       (nn.Hardswish(), nn.functional.hardswish)])
def test_sign_mask_backward_equals_the_analytical_masked_gradient(layer: nn.Module, fn) -> None:  # noqa: ANN001
    cls = SignReLU6 if isinstance(layer, nn.ReLU6) else SignHardswish
    m = convert(layer, cls)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 6, 5, 7, generator=g) * 5)
    x[0, 0, 0, :3] = torch.tensor([0.0, -0.0, 7.0])  # the boundary and the ReLU6 saturation
    x.requires_grad_(True)
    y = m(x)
    assert torch.equal(y, fn(x.detach()))
    grad_out = torch.randn(y.shape, generator=g)
    y.backward(grad_out)
    # MobileTL Eq. 8: dL/dx = dL/dy * 1[x >= 0], for both activations (also where ReLU6 saturates).
    assert torch.equal(x.grad, grad_out * (x.detach() >= 0))


def test_saved_mask_storage_is_one_32nd_of_the_activation() -> None:
    x = torch.randn(8, 96, 7, 7, requires_grad=True)  # numel divisible by 8
    m = convert(nn.ReLU6(), SignReLU6)
    _, saved = saved_tensors(lambda: m(x))
    assert len(saved) == 1
    (mask,) = saved
    assert mask.dtype == torch.uint8
    assert mask.untyped_storage().nbytes() * 32 == x.numel() * x.element_size()


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(shape: list[int], seed: int) -> None:
    mask = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.5
    packed = pack_mask(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == (mask.numel() + 7) // 8
    assert torch.equal(unpack_mask(packed, mask.shape).bool(), mask)


def small_top(arch: str = "mobilenet_v2", n: int = 4, size: int = 16) -> tuple[nn.Module, nn.Module, tuple]:
    torch.manual_seed(0)
    net = build_backbone(arch, 3, width_mult=0.35, small_input=True)
    for m in net.modules():  # non-trivial statistics, so "unchanged" means something
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    shape = feature_shape(net, n, size)
    _, top = split_at(net, n)
    return net, top, shape


def test_shift_only_bn_leaves_scale_and_running_stats_untouched() -> None:
    net, top, shape = small_top()
    apply_method(MobileTLMethod(type="mobiletl"), net.arch, list(net.blocks), top, 4, shape)
    irb = next(b for b in top.blocks.values() if isinstance(b, mobilenetv2.InvertedResidual))
    bns = [m for m in main_branch(irb).modules() if isinstance(m, nn.BatchNorm2d)]
    inner, last = bns[:-1], bns[-1]
    assert inner and all(isinstance(b, ShiftBatchNorm2d) for b in inner)
    assert type(last) is nn.BatchNorm2d
    assert all(not b.weight.requires_grad and b.bias.requires_grad for b in inner)
    before = {k: v.clone() for k, v in top.state_dict().items()}
    params = [p for p in top.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, weight_decay=0.01)
    top.train()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, *shape, generator=g)
        loss = nn.functional.cross_entropy(top(x), torch.randint(0, 3, (8,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = top.state_dict()
    names = {id(m): n for n, m in top.named_modules()}
    for b in inner:
        p = names[id(b)]
        for key in ("weight", "running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(before[f"{p}.{key}"], after[f"{p}.{key}"]), f"{p}.{key} moved"
        assert not torch.equal(before[f"{p}.bias"], after[f"{p}.bias"]), f"{p}.bias did not train"
    p = names[id(last)]
    for key in ("weight", "bias", "running_mean", "running_var"):
        assert not torch.equal(before[f"{p}.{key}"], after[f"{p}.{key}"]), f"{p}.{key} did not change"


@pytest.mark.parametrize("variant, shift_all", [("all-bn-shift", True), ("all-bn", False)])
def test_ablation_variants(variant: str, shift_all: bool) -> None:
    net, top, shape = small_top()
    apply_method(MobileTLMethod(type="mobiletl", variant=variant), net.arch, list(net.blocks), top, 4, shape)
    for block in top.blocks.values():
        if isinstance(block, mobilenetv2.InvertedResidual):
            bns = [m for m in main_branch(block).modules() if isinstance(m, nn.BatchNorm2d)]
            assert all(isinstance(b, ShiftBatchNorm2d) == shift_all for b in bns)
            acts = [m for m in main_branch(block).modules() if isinstance(m, nn.ReLU6)]
            assert acts and all(isinstance(a, SignReLU6) for a in acts)


def test_mobilenet_v3_blocks_with_se_train() -> None:
    net, top, shape = small_top("mobilenet_v3_small", n=3)
    details = apply_method(MobileTLMethod(type="mobiletl"), net.arch, list(net.blocks), top, 3, shape).details
    assert details["irbs"] == 2 and details["sign_act"] >= 2
    out = top(torch.randn(4, *shape))
    out.sum().backward()
    se = [m for m in top.modules() if type(m).__name__ == "SqueezeExcitation"]
    assert se and all(p.grad is not None for m in se for p in m.parameters())


def paper_block(kind: str, t: int) -> nn.Module:
    """The MobileTL paper's block setting: 96 -> 96 channels, 5x5 depthwise, expansion ``t``."""
    if kind == "v2":
        b = mobilenetv2.InvertedResidual(96, 96, 1, t)
        dw = b.conv[-3][0]
        b.conv[-3][0] = nn.Conv2d(dw.in_channels, dw.out_channels, 5, 1, 2, groups=dw.groups, bias=False)
        return b
    cnf = mobilenetv3.InvertedResidualConfig(96, 5, 96 * t, 96, True, "HS", 1, 1, 1.0)
    return mobilenetv3.InvertedResidual(cnf, partial(nn.BatchNorm2d, eps=0.001, momentum=0.01))


@pytest.mark.parametrize("kind, paper", [("v2", 0.463), ("v3", 0.533)])
def test_paper_block_reduction_and_measured_bytes(kind: str, paper: float) -> None:
    torch.manual_seed(0)
    vanilla = footprint(paper_block(kind, 6), (8, 96, 7, 7), input_requires_grad=True)
    block = paper_block(kind, 6)
    mobiletl_block(block)
    mtl = footprint(block, (8, 96, 7, 7), input_requires_grad=True)
    reduction = 1 - mtl.activation_bytes / vanilla.activation_bytes
    assert abs(reduction - paper) < 0.015, reduction
    assert abs(mtl.measured_bytes / mtl.activation_bytes - 1) < 0.10


def test_unsupported_backbone_and_bad_block_counts_are_clear_errors() -> None:
    resnet = build_backbone("resnet18", 3)
    with pytest.raises(ModelError, match="Supported models: mobilenet_v2, mobilenet_v3_small"):
        check_mobiletl_top("resnet18", list(resnet.blocks), 2)
    mnv2 = build_backbone("mobilenet_v2", 3, width_mult=0.35)
    with pytest.raises(ModelError, match=r"valid range 0\.\.19"):
        check_mobiletl_top("mobilenet_v2", list(mnv2.blocks), 25)
    with pytest.raises(ModelError, match=r"no inverted residual block.*train_last_blocks in 2\.\.19"):
        check_mobiletl_top("mobilenet_v2", list(mnv2.blocks), 1)


def test_stage_config_round_trips_and_accepts_shorthand() -> None:
    stage = Finetune(model="m", features="f", method={"type": "mobiletl", "variant": "all-bn"})
    again = stage_from_config(json.loads(json.dumps(stage.to_config())))
    assert again == stage and again.method.variant == "all-bn"
    short = Finetune(model="m", features="f", method="mobiletl")
    assert short.method == MobileTLMethod(type="mobiletl")
    assert short.to_config()["method"] == {"type": "mobiletl"}
    assert "method" not in Finetune(model="m", features="f").to_config()  # default stays out of fingerprints
