"""Batch norms folded into the convolutions of frozen parts: same outputs, fewer layers, state dict kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.models.fold import fold_batch_norms
from pipeline.models.zoo import FrozenBottomNet, build_backbone, split_at

from .test_zoo import BLOCKS, tiny


def with_real_statistics(net: nn.Module) -> nn.Module:
    """Batch norms with statistics and affine parameters far from the identity they start as."""
    g = torch.Generator().manual_seed(1)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            for t, lo, hi in ((m.running_mean, -0.5, 0.5), (m.running_var, 0.2, 2.0), (m.weight, 0.5, 1.5),
                              (m.bias, -0.3, 0.3)):
                t.data.copy_(torch.rand(t.shape, generator=g) * (hi - lo) + lo)
    return net


def frozen_bottom(arch: str, cut_from_top: int) -> nn.Module:
    bottom, _ = split_at(with_real_statistics(tiny(arch, small_input=True)), cut_from_top)
    for p in bottom.parameters():
        p.requires_grad_(False)
    return bottom.eval()


@pytest.mark.parametrize("arch", sorted(BLOCKS))
def test_folded_bottom_computes_what_the_bottom_does(arch: str) -> None:
    bottom = frozen_bottom(arch, 1)
    state = {k: v.clone() for k, v in bottom.state_dict().items()}
    folded = fold_batch_norms(bottom)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = bottom(x), folded(x)
    # The folded weights round differently: agreement to float32 precision of the output's scale.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    norms = [m for m in bottom.modules() if isinstance(m, nn.BatchNorm2d)]
    left = [m for m in folded.modules() if isinstance(m, nn.BatchNorm2d)]
    if arch.startswith(("mobilenet", "efficientnet")):
        assert norms and not left  # every batch norm follows a convolution in a Sequential
    elif arch == "resnet18":
        assert 0 < len(left) < len(norms)  # BasicBlock's bn1/bn2 are attributes, not Sequential children
    assert all(torch.equal(v, state[k]) for k, v in bottom.state_dict().items())  # the original is untouched
    assert not any(p.requires_grad for p in folded.parameters()) and not folded.training


def test_nothing_to_fold_returns_the_module_itself_and_a_training_module_is_refused() -> None:
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).requires_grad_(False)
    assert fold_batch_norms(plain) is plain
    trains = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="0.weight requires grad"):
        fold_batch_norms(trains)


def test_frozen_bottom_net_runs_folded_but_keeps_its_state_dict() -> None:
    torch.manual_seed(0)
    net = with_real_statistics(build_backbone("mobilenet_v2", 5, width_mult=0.35, small_input=True))
    bottom, top = split_at(net, 2)
    bottom.requires_grad_(False)
    model = FrozenBottomNet(bottom, top)
    keys = list(model.state_dict())
    model.train()
    x = torch.randn(4, 3, 32, 32)
    top.eval()  # dropout off, so the two forwards compare
    with torch.no_grad():
        want = top(bottom(x))
        got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(model._folded) == 1 and model._folded[0] is not bottom
    assert list(model.state_dict()) == keys  # checkpoints hold the backbone's own layout
    model.load_state_dict(model.state_dict())
    assert not model._folded  # folded again from the loaded weights at the next forward
    model(x)
    model.to(torch.float64)
    assert not model._folded
    assert model(x.double()).dtype == torch.float64
