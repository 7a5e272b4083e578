"""TinyTL and the FT baselines: lite residual identity, bias-only training, kernel shrinking, GN swap,
and both memory-efficient trainers fed by a cache through the real Runner."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.context import RunContext
from pipeline.errors import ModelError
from pipeline.methods.adapters import FTLastMethod, FTNormLastMethod, TinyTLMethod, apply_method, check_method
from pipeline.methods.layers import FrozenConv2d, ShiftBatchNorm2d
from pipeline.methods.tinytl import BranchWithLiteResidual, LiteResidual, lite_kernel, replace_bn_with_gn
from pipeline.models.zoo import build_backbone, feature_shape, split_at
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is as fast, and never spins against other jobs on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small(arch: str = "mobilenet_v2", n: int = 5, size: int = 16, small_input: bool = True):  # noqa: ANN201
    torch.manual_seed(0)
    net = build_backbone(arch, 3, width_mult=0.35, small_input=small_input)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.bias.data.uniform_(-0.2, 0.2)
    shape = feature_shape(net, n, size)
    return net, split_at(net, n)[1], shape


def train_steps(top: nn.Module, shape: tuple, steps: int = 3) -> None:
    params = [p for p in top.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, weight_decay=0.01)
    top.train()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, *shape, generator=g)
        loss = nn.functional.cross_entropy(top(x), torch.randint(0, 3, (8,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()


def changed(before: dict, after: dict) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


def test_lite_residual_modules_are_an_exact_identity_at_initialisation() -> None:
    net, top, shape = small()
    reference = copy.deepcopy(top).eval()
    apply_method(TinyTLMethod(type="tinytl", mode="lite"), net.arch, list(net.blocks), top, 5, shape)
    top.eval()
    branches = [m for m in top.modules() if isinstance(m, BranchWithLiteResidual)]
    assert len(branches) == 4  # the IRBs among the last 5 blocks
    x = torch.randn(4, *shape)
    with torch.no_grad():
        h = x
        for block in top.blocks.values():
            for branch in [m for m in block.modules() if isinstance(m, BranchWithLiteResidual)]:
                main = h
                for name in branch._main_names:
                    main = branch._modules[name](main)
                assert torch.equal(branch(h), main)  # the lite branch adds exact zeros
                assert not branch.lite_residual(h, main.shape[-2:]).any()
            h = block(h)
        # Against the untouched pretrained top: equal up to float rounding of the frozen-BN rewrite.
        torch.testing.assert_close(top(x), reference(x), rtol=1e-5, atol=1e-5)
    keys = set(top.state_dict())
    assert set(reference.state_dict()) <= keys  # pretrained keys unchanged; lite modules only add keys


def test_bias_only_training_changes_only_biases() -> None:
    net, top, shape = small()
    apply_method(TinyTLMethod(type="tinytl", mode="bias"), net.arch, list(net.blocks), top, 5, shape)
    before = {k: v.clone() for k, v in top.state_dict().items()}
    train_steps(top, shape)
    moved = changed(before, top.state_dict())
    classifier = {"head.classifier.1.weight", "head.classifier.1.bias"}
    assert classifier <= moved
    assert all(k.endswith(".bias") for k in moved - classifier), sorted(moved - classifier)
    assert any(k.startswith("blocks.") for k in moved)
    assert all(isinstance(m, FrozenConv2d) for m in top.blocks.modules() if isinstance(m, nn.Conv2d))
    assert all(isinstance(m, ShiftBatchNorm2d) for m in top.modules() if isinstance(m, nn.BatchNorm2d))


def test_lite_bias_trains_lite_modules_and_biases_only() -> None:
    net, top, shape = small()
    apply_method(TinyTLMethod(type="tinytl"), net.arch, list(net.blocks), top, 5, shape)
    before = {k: v.clone() for k, v in top.state_dict().items()}
    train_steps(top, shape)
    moved = changed(before, top.state_dict())
    assert any("lite_residual" in k for k in moved)
    assert all("lite_residual" in k or k.endswith(".bias") or k.startswith("head.") for k in moved)


def test_ft_last_and_ft_norm_last_baselines() -> None:
    net, top, shape = small()
    apply_method(FTLastMethod(type="ft_last"), net.arch, list(net.blocks), top, 5, shape)
    before = {k: v.clone() for k, v in top.state_dict().items()}
    train_steps(top, shape)
    assert changed(before, top.state_dict()) == {"head.classifier.1.weight", "head.classifier.1.bias"}
    net, top, shape = small()
    apply_method(FTNormLastMethod(type="ft_norm_last"), net.arch, list(net.blocks), top, 5, shape)
    before = {k: v.clone() for k, v in top.state_dict().items()}
    train_steps(top, shape)
    moved = changed(before, top.state_dict())
    norm_keys = {k for k in moved if k.rsplit(".", 1)[-1] in ("weight", "bias", "running_mean", "running_var",
                                                             "num_batches_tracked")}
    assert moved == norm_keys and any(k.endswith("running_mean") for k in moved)
    conv_weights = {f"{n}.weight" for n, m in top.named_modules() if isinstance(m, nn.Conv2d)}
    assert not moved & conv_weights


@pytest.mark.parametrize("resolution, kernel, downsample", [
    (1, 1, None), (2, 1, None), (3, 1, None), (4, 1, 2), (6, 3, 2), (8, 3, 2), (10, 5, 2), (56, 5, 2)])
def test_lite_kernel_shrinks_for_small_maps(resolution: int, kernel: int, downsample: int | None) -> None:
    assert lite_kernel(resolution, 2, 5) == (kernel, downsample)


def test_lite_residual_on_maps_smaller_than_the_kernel_never_crashes() -> None:
    # 32x32 input without small_input: the last blocks see 1x1 and 2x2 maps.
    net, top, shape = small(n=10, size=32, small_input=False)
    assert shape[-1] <= 2
    method = TinyTLMethod(type="tinytl", lite_kernel=7)
    details = apply_method(method, net.arch, list(net.blocks), top, 10, shape).details
    assert set(details["lite_kernels"]) == {1}
    out = top(torch.randn(2, *shape))
    out.sum().backward()
    lite = [m for m in top.modules() if isinstance(m, LiteResidual)]
    assert lite and all(m.conv1.weight.grad is not None for m in lite)


def test_bn_to_gn_copies_scale_and_shift() -> None:
    net, top, shape = small()
    bns = {n: (m.weight.detach().clone(), m.bias.detach().clone()) for n, m in top.named_modules()
           if isinstance(m, nn.BatchNorm2d)}
    assert replace_bn_with_gn(top) == len(bns)
    for name, (w, b) in bns.items():
        gn = top.get_submodule(name)
        assert isinstance(gn, nn.GroupNorm) and torch.equal(gn.weight, w) and torch.equal(gn.bias, b)


def test_bad_input_names_supported_models_and_valid_range() -> None:
    resnet = build_backbone("resnet18", 3)
    with pytest.raises(ModelError, match="Supported models: mobilenet_v2"):
        check_method(TinyTLMethod(type="tinytl"), "resnet18", list(resnet.blocks), 3)
    check_method(TinyTLMethod(type="tinytl", mode="bias"), "resnet18", list(resnet.blocks), 3)  # any model
    mnv2 = build_backbone("mobilenet_v2", 3, width_mult=0.35)
    with pytest.raises(ModelError, match=r"train_last_blocks in 2\.\.19"):
        check_method(TinyTLMethod(type="tinytl"), "mobilenet_v2", list(mnv2.blocks), 1)
    from pipeline.methods.adapters import FTFullMethod

    with pytest.raises(ModelError, match="train_last_blocks: 19"):
        check_method(FTFullMethod(type="ft_full"), "mobilenet_v2", list(mnv2.blocks), 7)


RECIPE = {
    "name": "cache_fed_trainers",
    "stages": {
        "digits": {"type": "digits"},
        "target": {"type": "split", "input": "digits", "classes": [5, 6, 7, 8, 9], "per_class": 20,
                   "val_fraction": 0.2, "test_fraction": 0.2},
        # A seeded random backbone keeps the test fast; recipes/*/digits.yaml pretrain one instead.
        "backbone": {"type": "backbone", "arch": "mobilenet_v2", "num_classes": 5, "width_mult": 0.35,
                     "small_input": True, "resolution": 16},
        "images": {"type": "decode", "input": "target", "resolution": 16},
        "features": {"type": "frozen_forward", "input": "images", "model": "backbone",
                     "train_last_blocks": 4},
        "q4": {"type": "quantize", "input": "features", "bits": 4},
        "cache": {"type": "cache", "input": "q4"},
        "deq": {"type": "dequantize", "input": "cache"},
        "mobiletl": {"type": "finetune", "model": "backbone", "features": "deq", "batch_size": 16,
                     "method": "mobiletl", "train": {"epochs": 2, "lr": 0.01}},
        "tinytl": {"type": "finetune", "model": "backbone", "features": "deq", "batch_size": 16,
                   "method": {"type": "tinytl", "mode": "lite_bias"}, "train": {"epochs": 2, "lr": 0.01}},
    },
    "targets": ["mobiletl", "tinytl"],
}


def test_both_trainers_run_from_a_cache_through_the_runner(tmp_path: Path) -> None:
    recipe = recipe_from_dict(RECIPE)
    ctx = RunContext(catalog=Catalog(tmp_path / "store"), output_dir=tmp_path / "run")
    reports = {r.name: r for r in Runner(recipe, ctx).run()}
    assert reports["cache"].status == "computed" and reports["cache"].bytes_written > 0
    for name, label in (("mobiletl", "mobiletl:proj-bn"), ("tinytl", "tinytl:lite_bias")):
        m = reports[name].metrics
        assert m["method"] == label and m["mode"] == "two_stage" and m["bits"] == 4
        assert 0.0 <= m["accuracy"] <= 1.0 and m["train_last_blocks"] == 4
        assert 0 < m["memory_activation_bytes"] <= m["memory_total_bytes"]
        assert m["memory_activation_bytes_measured"] > 0
    trained = {name: reports[name].metrics["trainable_parameters"] for name in ("mobiletl", "tinytl")}
    assert trained["tinytl"] < trained["mobiletl"]
    # A method that cannot apply fails at plan time with the stage named.
    bad = copy.deepcopy(RECIPE)
    bad["stages"]["mobiletl"]["train_last_blocks"] = 1
    bad["stages"]["features"]["train_last_blocks"] = 1
    with pytest.raises(ModelError, match=r"stages\.mobiletl \(finetune\).*no inverted residual block"):
        Runner(recipe_from_dict(bad), RunContext(catalog=Catalog(tmp_path / "store")))
