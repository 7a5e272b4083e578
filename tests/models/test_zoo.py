"""Backbones as block lists: structure, equivalence with torchvision, cuts and shapes."""

from __future__ import annotations

import pytest
import torch
import torchvision.models as tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from pipeline.errors import ModelError
from pipeline.models.zoo import (
    ARCHITECTURES,
    BlockNet,
    build_backbone,
    count_parameters,
    feature_shape,
    load_torchvision_state_dict,
    replace_classifier,
    split_at,
)

BLOCKS = {"mobilenet_v2": 19, "mobilenet_v3_small": 13, "mobilenet_v3_large": 17, "efficientnet_b0": 9,
          "resnet18": 9, "squeezenet1_1": 13}
# Narrow where the architecture allows it: keeps every test here fast on a shared 2-core CPU.
WIDTH = {"mobilenet_v2": 0.35, "mobilenet_v3_small": 0.5, "mobilenet_v3_large": 0.35}


def tiny(arch: str, num_classes: int = 5, **kw: object) -> BlockNet:
    torch.manual_seed(0)
    return build_backbone(arch, num_classes, width_mult=WIDTH.get(arch, 1.0), **kw).eval()


@pytest.fixture(scope="module")
def mbv2() -> BlockNet:
    return tiny("mobilenet_v2", small_input=True)


@pytest.mark.parametrize("arch", sorted(BLOCKS))
def test_block_counts(arch: str) -> None:
    assert set(BLOCKS) <= set(ARCHITECTURES)
    assert len(tiny(arch).blocks) == BLOCKS[arch]


@pytest.mark.parametrize("arch", sorted(BLOCKS))
def test_forward_equals_torchvision_with_same_weights(arch: str) -> None:
    kwargs = {"width_mult": WIDTH[arch]} if arch in WIDTH else {}
    torch.manual_seed(1)
    ref = ARCHITECTURES[arch].constructor(weights=None, num_classes=7, **kwargs).eval()
    torch.manual_seed(2)  # different init, so equality below proves the weights were loaded
    net = build_backbone(arch, 7, width_mult=WIDTH.get(arch, 1.0)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = ref(x)
        scale = expected.abs().max()  # an untrained EfficientNet's logits are ~1e-13: compare relatively
        assert not torch.allclose(net(x) / scale, expected / scale, rtol=1e-3, atol=1e-3)
        load_torchvision_state_dict(net, ref.state_dict())
        torch.testing.assert_close(net(x) / scale, expected / scale, rtol=1e-5, atol=1e-5)


def test_torchvision_keys_are_renamed_for_resnet_blocks() -> None:
    net = tiny("resnet18")
    mapped = net.from_torchvision_keys(tvm.resnet18(weights=None, num_classes=5).state_dict())
    assert set(mapped) == set(net.state_dict())
    assert "blocks.4.conv1.weight" in mapped  # layer2.1 is the 5th block after the stem
    assert "head.classifier.weight" in mapped


@pytest.mark.parametrize("n", [0, 1, 5, 18, 19])
def test_split_composes_to_full_forward(mbv2: BlockNet, n: int) -> None:
    bottom, top = split_at(mbv2, n)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(top(bottom(x)), mbv2(x))
    assert len(bottom) == 19 - n and len(top.blocks) == n


def test_split_shares_modules_and_keys(mbv2: BlockNet) -> None:
    bottom, top = split_at(mbv2, 5)
    net_params = {id(p) for p in mbv2.parameters()}
    assert {id(p) for p in top.parameters()} <= net_params
    assert {id(p) for p in bottom.parameters()} <= net_params
    assert count_parameters(bottom) + count_parameters(top) == count_parameters(mbv2)
    full = mbv2.state_dict()
    for key, value in top.state_dict().items():  # top weights load straight back into the full net
        assert full[key] is value or torch.equal(full[key], value)


@pytest.mark.parametrize("n", [-1, 20, 100])
def test_out_of_range_cut_names_range_and_arch(mbv2: BlockNet, n: int) -> None:
    with pytest.raises(ModelError, match=r"0\.\.19.*mobilenet_v2"):
        split_at(mbv2, n)


def test_unknown_arch_suggests_nearest() -> None:
    with pytest.raises(ModelError, match="did you mean 'mobilenet_v2'"):
        build_backbone("mobilenet_v22", 10)
    with pytest.raises(ModelError, match="did you mean 'resnet18'"):
        build_backbone("resnet_18", 10)


def test_width_mult_rejected_where_unsupported() -> None:
    with pytest.raises(ModelError, match="resnet18.*width_mult=0.5"):
        build_backbone("resnet18", 10, width_mult=0.5)
    with pytest.raises(ModelError, match="num_classes"):
        build_backbone("resnet18", 0)


def test_width_mult_narrows_mobilenet() -> None:
    assert count_parameters(tiny("mobilenet_v2")) < count_parameters(
        build_backbone("mobilenet_v2", 5, width_mult=1.0)) / 3


def test_feature_shape_mobilenet_v2_224() -> None:
    net = build_backbone("mobilenet_v2", 10).eval()
    assert feature_shape(net, 5, 224) == (96, 14, 14)
    bottom, _ = split_at(net, 5)
    with torch.no_grad():
        assert tuple(bottom(torch.zeros(1, 3, 224, 224)).shape[1:]) == (96, 14, 14)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(sorted(BLOCKS)), frac=st.floats(0, 1), size=st.sampled_from([32, 48, 64]),
       small=st.booleans())
def test_feature_shape_matches_real_forward(arch: str, frac: float, size: int, small: bool) -> None:
    net = tiny(arch, small_input=small)
    n = round(frac * len(net.blocks))
    bottom, _ = split_at(net, n)
    with torch.no_grad():
        real = tuple(bottom(torch.zeros(1, 3, size, size)).shape[1:])
    assert feature_shape(net, n, size) == real


def test_feature_shape_leaves_modes_alone(mbv2: BlockNet) -> None:
    mbv2.train()
    feature_shape(mbv2, 3, 32)
    assert all(m.training for m in mbv2.modules())
    mbv2.eval()


def test_feature_shape_too_small_input_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="input_size 8 is too small for squeezenet1_1"):
        feature_shape(tiny("squeezenet1_1"), 0, 8)


@pytest.mark.parametrize("arch", sorted(BLOCKS))
def test_small_input_keeps_spatial_size_larger(arch: str) -> None:
    big, small = tiny(arch), tiny(arch, small_input=True)
    n = len(big.blocks) // 2
    _, h, w = feature_shape(big, n, 32)
    _, hs, ws = feature_shape(small, n, 32)
    assert hs > h and ws > w
    # Only strides change, so the same weights fit both variants.
    shapes = [{k: v.shape for k, v in m.state_dict().items()} for m in (big, small)]
    assert shapes[0] == shapes[1]


@pytest.mark.parametrize("arch", ["mobilenet_v2", "resnet18", "squeezenet1_1", "mobilenet_v3_small"])
def test_replace_classifier_changes_only_the_final_layer(arch: str) -> None:
    net = tiny(arch, num_classes=10)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    replace_classifier(net, 3)
    assert net.num_classes == 3
    with torch.no_grad():
        assert net.eval()(torch.randn(2, 3, 64, 64)).shape == (2, 3)
    after = net.state_dict()
    changed = {k for k in before if before[k].shape != after[k].shape or not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(net.final_layer_name + ".") for k in changed)
    assert set(before) == set(after)


def test_count_parameters_trainable_only() -> None:
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    m[0].weight.requires_grad_(False)
    assert count_parameters(m) == 12 + 4 + 8 + 2
    assert count_parameters(m, trainable_only=True) == 4 + 8 + 2
