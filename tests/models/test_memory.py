"""The training-memory meter: hand-computed analytic numbers, measured saved bytes, FLOPs, recipe report."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.context import RunContext
from pipeline.errors import StageError
from pipeline.memory_report import memory_report
from pipeline.methods.layers import frozen_conv
from pipeline.models.memory import footprint, stored_bits
from pipeline.recipe import load_recipe, recipe_from_dict
from stores.catalog import Catalog


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is as fast, and never spins against other jobs on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ROOT = Path(__file__).resolve().parents[2]


def conv_bn_relu_conv() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 2, 1))


def by_layer(fp) -> dict[str, int]:  # noqa: ANN001
    return {layer.name: layer.bytes for layer in fp.layers}


def test_hand_computed_conv_bn_relu_conv() -> None:
    # input (2, 3, 5, 5): conv1 input 150 floats, BN input and ReLU input 200 each, conv2 input 200.
    fp = footprint(conv_bn_relu_conv(), (2, 3, 5, 5))
    assert by_layer(fp) == {"0": 150 * 4, "1": 200 * 4, "2": 200 // 8, "3": 200 * 4}
    assert fp.activation_bytes == 600 + 800 + 25 + 800
    # Frozen first conv: its input is not needed; the BN's scale still trains.
    model = conv_bn_relu_conv()
    model[0].weight.requires_grad_(False)
    assert by_layer(footprint(model, (2, 3, 5, 5))) == {"0": 0, "1": 800, "2": 25, "3": 800}
    # Only the last conv trains: nothing before it is in the gradient path.
    model = conv_bn_relu_conv()
    for p in [*model[0].parameters(), *model[1].parameters()]:
        p.requires_grad_(False)
    fp = footprint(model, (2, 3, 5, 5))
    assert by_layer(fp) == {"0": 0, "1": 0, "2": 0, "3": 800}
    # ... and a lean frozen conv in the gradient path keeps nothing either.
    model = conv_bn_relu_conv()
    model[3] = frozen_conv(model[3])
    assert by_layer(footprint(model, (2, 3, 5, 5)))["3"] == 0


def test_hand_computed_linear_hardswish_dropout_and_optimizer_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Hardswish(), nn.Dropout(0.5), nn.Linear(5, 3))
    fp = footprint(model, (4, 6))
    assert by_layer(fp) == {"0": 24 * 4, "1": 20 * 4, "2": 3, "3": 20 * 4}  # dropout: ceil(20 bits / 8)
    loss = next(g for g in fp.groups if g.name == "loss")
    assert loss.activation_bytes == 12 * 4  # the cross-entropy's log-softmax output (4 x 3)
    assert fp.activation_bytes == 96 + 80 + 3 + 80 + 48
    params = 6 * 5 + 5 + 5 * 3 + 3
    assert fp.trainable_parameters == params and fp.parameter_bytes == params * 4
    assert fp.gradient_bytes == params * 4 and fp.optimizer_bytes == 2 * params * 4  # AdamW: two moments
    assert footprint(model, (4, 6), optimizer="sgd").optimizer_bytes == params * 4
    assert footprint(model, (4, 6), optimizer="sgd", momentum=0.0).optimizer_bytes == 0
    assert fp.total_bytes == fp.parameter_bytes + fp.gradient_bytes + fp.optimizer_bytes + fp.activation_bytes
    # FLOPs: 2 per multiply-add; no input gradient for the first layer (its input needs none).
    assert fp.flops_forward == 2 * 4 * (6 * 5 + 5 * 3)
    assert fp.flops_backward == 2 * 4 * 6 * 5 + 2 * (2 * 4 * 5 * 3)
    assert fp.measured_flops_forward == fp.flops_forward


def test_rules_for_frozen_and_batch_statistics_norms() -> None:
    bn = nn.BatchNorm2d(4)
    bn.weight.requires_grad_(False)
    assert stored_bits(bn.train(), True)[0] == 32  # batch statistics in the gradient path need x_hat
    assert stored_bits(bn.eval(), True)[0] == 0  # frozen affine map
    assert stored_bits(nn.GroupNorm(2, 4), True)[0] == 32
    assert stored_bits(nn.ReLU6(), True)[0] == 1 and stored_bits(nn.ReLU6(), False)[0] == 0
    assert stored_bits(nn.Sigmoid(), True)[0] == 32 and stored_bits(nn.AdaptiveAvgPool2d(1), True)[0] == 0


class SharedInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x * 2)
        return self.a(h) + self.b(h)


def test_measured_counts_each_storage_once_and_reports_weights_apart() -> None:
    fp = footprint(SharedInput(), (2, 4, 3, 3), input_requires_grad=True)
    h = 2 * 4 * 3 * 3 * 4
    # h is saved by relu's backward and by both convs: one storage. x * 2 saves only the scalar.
    assert fp.measured_bytes == h
    assert fp.measured_parameter_refs_bytes == 2 * (4 * 4 * 4)  # the two conv weights, saved by reference
    measured = {g.name: g.measured_bytes for g in fp.groups}
    assert sum(v for v in measured.values() if v) == fp.measured_bytes


def test_footprint_leaves_the_model_untouched() -> None:
    model = conv_bn_relu_conv()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    footprint(model, (2, 3, 5, 5))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_memory_report_for_a_recipe(tmp_path: Path) -> None:
    small = [f"stages.{s}.batch_size=4" for s in ("vanilla", "mobiletl", "mobiletl_images")]
    recipe = load_recipe(ROOT / "recipes" / "mobiletl" / "digits.yaml", small)
    ctx = RunContext(catalog=Catalog(tmp_path / "store"))
    text, data = memory_report(recipe, ctx)
    stages = data["stages"]
    assert set(stages) == {"vanilla", "mobiletl", "mobiletl_images"}
    assert data["device"] == "cpu" and "on cpu" in text.splitlines()[0]
    # No allocator on a CPU: the analytic and saved-tensor views only (tests/test_cuda_train.py reads CUDA's).
    assert all(s["device"] == "cpu" and s["device_peak_bytes"] is None for s in stages.values())
    for name in stages:
        assert f"[{name}]" in text
    vanilla, mtl = stages["vanilla"], stages["mobiletl"]
    assert mtl["activation_bytes"] < vanilla["activation_bytes"]
    assert vanilla["input_shape"][0] == 4 and vanilla["measured_bytes"] > 0
    assert stages["mobiletl_images"]["frozen_bytes"] > 0 == mtl["frozen_bytes"]  # single stage: + bottom
    entries = tmp_path / "store" / "entries"
    assert not entries.exists() or not any(entries.iterdir())  # nothing was built
    only, _ = memory_report(recipe, ctx, stages=["mobiletl"], measure=False)
    assert "[mobiletl]" in only and "[vanilla]" not in only and "(mask convention)" in only
    _, maps = memory_report(recipe, ctx, stages=["vanilla"], measure=False, convention="map")
    assert maps["stages"]["vanilla"]["convention"] == "map"
    assert maps["stages"]["vanilla"]["activation_bytes"] > vanilla["activation_bytes"]  # its ReLU6s as maps
    with pytest.raises(StageError, match="unknown memory convention 'paper'; expected one of mask, map"):
        memory_report(recipe, ctx, convention="paper")
    with pytest.raises(StageError, match="not trainer stages"):
        memory_report(recipe, ctx, stages=["backbone"])
    bare = recipe_from_dict({"name": "b", "stages": {"d": {"type": "digits"}}})
    with pytest.raises(StageError, match="no trainer stage"):
        memory_report(bare, ctx)


def test_device_step_peak_reads_only_a_cuda_allocator() -> None:
    from pipeline.models.memory import device_step_peak

    with pytest.raises(ValueError, match="reads the CUDA allocator; cpu has none"):
        device_step_peak(conv_bn_relu_conv(), (2, 3, 5, 5), "cpu")


# The MobileTL paper's block setting: input and output (8, 96, 7, 7), expansion 1, 5x5 depthwise.
MAP = 8 * 96 * 7 * 7 * 4  # one fp32 activation map of the block's shape, in bytes
MASK = 8 * 96 * 7 * 7 // 8  # its 1-bit mask
# fc1, ReLU, fc2, hsigmoid inputs, and the scale the product x * s keeps for x's gradient
SE_SMALL = {"mask": 3072 + 24 + 768 + 3072 + 3072, "map": 3072 + 768 + 768 + 3072 + 3072}


@pytest.mark.parametrize("convention", ["mask", "map"])
def test_paper_blocks_in_both_conventions(convention: str) -> None:
    from benchmarks.bench_memory import conv_block, v2_block, v3_block

    relu6 = MASK if convention == "mask" else MAP
    expected = {
        "conv": 2 * MAP + relu6,  # conv, BN, ReLU6
        "v2": 4 * MAP + relu6,  # depthwise conv, BN, ReLU6, projection conv, BN (no expansion at t=1)
        "v3": 6 * MAP + SE_SMALL[convention],  # dw conv, BN, Hard-Swish, SE input, projection conv, BN
    }
    for name, block in (("conv", conv_block()), ("v2", v2_block(1)), ("v3", v3_block(1))):
        fp = footprint(block, (8, 96, 7, 7), input_requires_grad=True, convention=convention)
        assert fp.convention == convention and fp.as_dict()["convention"] == convention
        assert fp.activation_bytes == expected[name], name
        # PyTorch keeps ReLU6's input as a float map: "map" is within 0.5% of the measured bytes.
        if convention == "map":
            assert fp.activation_bytes <= fp.measured_bytes <= 1.005 * fp.activation_bytes, name


def test_conventions_agree_on_mobiletl_masks_and_default_is_mask() -> None:
    from benchmarks.bench_memory import v2_block
    from pipeline.methods.mobiletl import mobiletl_block

    block = v2_block(6)
    mobiletl_block(block, "proj-bn")  # sign-mask activations state their own bits (1)
    counts = {c: footprint(block, (8, 96, 7, 7), input_requires_grad=True, measure=False, convention=c)
              for c in ("mask", "map")}
    assert counts["mask"].activation_bytes == counts["map"].activation_bytes
    assert footprint(v2_block(1), (8, 96, 7, 7), measure=False, input_requires_grad=True).convention == "mask"
    assert stored_bits(nn.ReLU6(), True, "map") == (32, "activation map (map convention)")
    assert stored_bits(nn.ReLU6(), False, "map")[0] == 0  # no gradient reaches it: nothing either way
    with pytest.raises(ValueError, match="unknown memory convention 'paper'; expected one of mask, map"):
        footprint(block, (8, 96, 7, 7), convention="paper")
