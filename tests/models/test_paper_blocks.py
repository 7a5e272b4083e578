"""The MobileTL paper's block convention of the meter (``block="paper"``) and ``bench_memory --block paper``.

The expected bytes are counted here from the paper's own description of what a block stores for
backward: the input of every convolution and normalization layer at 32 bits, a 1-bit mask for
ReLU/ReLU6, Hard-Swish's input at 32 bits, and what the squeeze-and-excitation product needs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torchvision.models import mobilenetv2, mobilenetv3, resnet

from benchmarks import bench_memory
from benchmarks.bench_memory import conv_block, paper_findings, table1_entry, v2_block, v3_block
from pipeline.methods.layers import ShiftBatchNorm2d, SignHardswish, SignReLU6
from pipeline.methods.mobiletl import mobiletl_block
from pipeline.models.memory import footprint
from pipeline.models.paper_blocks import check_block, to_paper_block, to_paper_blocks
from pipeline.models.zoo import build_backbone


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SHAPE = (8, 96, 7, 7)  # the paper's Table 1 setting: input and output, expansion 1, 5x5 depthwise
N, C = SHAPE[:2]
MAP = N * C * 7 * 7 * 4  # one fp32 activation map of the block's shape
MASK = N * C * 7 * 7 // 8  # its 1-bit mask
SQUEEZE = 24  # torchvision's SE width for 96 channels: make_divisible(96 // 4, 8)
# SE: the product x * s keeps x (a map) and s (N x C floats); its own layers keep fc1's input (N x C),
# a ReLU mask (N x SQUEEZE bits), fc2's input (N x SQUEEZE) and the Hard-sigmoid's input (N x C)
SE = MAP + 4 * N * C + 4 * N * C + N * SQUEEZE // 8 + 4 * N * SQUEEZE + 4 * N * C

PAPER_T1 = {
    "conv": 2 * MAP + MASK,  # conv, BN inputs; ReLU6 mask
    "v2": 3 * (2 * MAP) + 2 * MASK,  # expand, depthwise, project: conv and BN inputs; two ReLU6 masks
    "v3": 3 * (2 * MAP) + 2 * MAP + SE,  # the same convs and BNs, two Hard-Swish inputs, the SE layer
}


def activation_bytes(module: nn.Module, **kw: object) -> int:
    return footprint(module, SHAPE, input_requires_grad=True, measure=False, **kw).activation_bytes  # type: ignore[arg-type]


def test_the_paper_block_has_one_depthwise_and_two_pointwise_convs_each_with_a_norm() -> None:
    for make in (v2_block, v3_block):
        tv, paper = make(1), make(1, "paper")
        for block, n_convs in ((tv, 2), (paper, 3)):  # torchvision leaves the expanding conv out at t=1
            convs = [m for name, m in block.named_modules() if isinstance(m, nn.Conv2d) and "fc" not in name]
            assert len(convs) == n_convs
            assert sum(isinstance(m, nn.BatchNorm2d) for m in block.modules()) == n_convs
        convs = [m for name, m in paper.named_modules() if isinstance(m, nn.Conv2d) and "fc" not in name]
        assert [(c.kernel_size, c.groups) for c in convs] == [((1, 1), 1), ((5, 5), 96), ((1, 1), 1)]
        assert paper(torch.randn(2, 96, 7, 7)).shape == (2, 96, 7, 7)
        assert not to_paper_block(paper)  # already the paper's: nothing added twice
    assert not to_paper_block(v2_block(6))  # a block that expands is the paper's already


def test_paper_convention_counts_table1_blocks_from_first_principles() -> None:
    assert activation_bytes(conv_block()) == PAPER_T1["conv"]
    for kind, make in (("v2", v2_block), ("v3", v3_block)):
        built = activation_bytes(make(1, "paper"))
        fp = footprint(make(1), SHAPE, input_requires_grad=True, measure=False, block="paper")
        assert built == fp.activation_bytes == PAPER_T1[kind], kind
        assert fp.block == "paper" and fp.extra["paper_expansions_added"] == 1
        assert fp.as_dict()["block"] == "paper"
        # torchvision's form keeps two maps (the expanding conv's and BN's inputs) and an activation less
        act = MASK if kind == "v2" else MAP
        assert activation_bytes(make(1)) == PAPER_T1[kind] - 2 * MAP - act
    # the measured side meters the same paper block (PyTorch's ReLU6 keeps a float map: "map" counts it)
    fp = footprint(v2_block(1), SHAPE, input_requires_grad=True, block="paper", convention="map")
    assert fp.activation_bytes <= fp.measured_bytes <= 1.005 * fp.activation_bytes


@pytest.mark.parametrize("kind, paper", [("v2", 0.463), ("v3", 0.533)])
def test_mobiletl_reduction_at_expansion_6_holds_in_the_paper_convention(kind: str, paper: float) -> None:
    make = v2_block if kind == "v2" else v3_block
    vanilla = activation_bytes(make(6), block="paper")
    block = make(6)
    mobiletl_block(block)
    assert abs(1 - activation_bytes(block, block="paper") / vanilla - paper) <= 0.01


def test_the_added_layer_follows_the_block_method_and_leaves_the_random_stream() -> None:
    for make, act in ((v2_block, SignReLU6), (v3_block, SignHardswish)):
        block = make(1)
        mobiletl_block(block)  # then the paper's conv: a copy of the depthwise layer's shift BN, sign mask
        state = torch.random.get_rng_state()
        assert to_paper_block(block)
        assert torch.equal(torch.random.get_rng_state(), state)
        expand = (block.conv if isinstance(block, mobilenetv2.InvertedResidual) else block.block)[0]
        assert isinstance(expand[1], ShiftBatchNorm2d) and isinstance(expand[2], act)
        other = make(1, "paper")  # the paper's block first, MobileTL on it: the same count
        mobiletl_block(other)
        assert activation_bytes(block) == activation_bytes(other)
    frozen = v2_block(1)
    for p in frozen.parameters():
        p.requires_grad_(False)
    to_paper_block(frozen)
    assert not any(p.requires_grad for p in frozen.parameters())


def test_networks_get_the_paper_block_where_torchvision_left_the_expansion_out() -> None:
    for arch in ("mobilenet_v2", "mobilenet_v3_small"):
        net = build_backbone(arch, 10, width_mult=0.35 if arch == "mobilenet_v2" else 0.5)
        irbs = [b for b in net.modules() if isinstance(b, (mobilenetv2.InvertedResidual,
                                                            mobilenetv3.InvertedResidual))]
        assert to_paper_blocks(net) == 1  # each has one expansion-1 block
        assert all(not to_paper_block(b) for b in irbs)
        assert net(torch.randn(1, 3, 64, 64)).shape == (1, 10)


def test_the_paper_block_is_refused_where_it_does_not_apply() -> None:
    valid = ("It applies to mobilenet_v2, mobilenet_v3_small, mobilenet_v3_large; "
             "block conventions: torchvision, paper")
    with pytest.raises(ValueError, match="resnet18 has none. " + valid):
        footprint(build_backbone("resnet18", 10), (1, 3, 32, 32), measure=False, block="paper")
    with pytest.raises(ValueError, match="BasicBlock has none"):
        footprint(resnet.BasicBlock(8, 8), (1, 8, 4, 4), measure=False, block="paper")
    with pytest.raises(ValueError, match="unknown block convention 'timm'; expected one of torchvision, pap"):
        footprint(v2_block(1), SHAPE, measure=False, block="timm")
    with pytest.raises(ValueError, match="swin_t has none"):
        check_block("paper", "swin_t")
    check_block("paper", "mobilenet_v3_large")
    check_block("torchvision", "resnet18")
    with pytest.raises(ValueError, match="not a MobileNetV2/V3 inverted residual block"):
        to_paper_block(conv_block())


@pytest.mark.parametrize("argv, says", [
    (["--block", "resnet"], "invalid choice: 'resnet' (choose from 'torchvision', 'paper')"),
    (["--block", "paper", "--paper-table1", "v4=1MB"], "BLOCK one of conv, v2, v3"),
    (["--block", "paper", "--paper-table1", "v2=0.87"], "a unit, one of B, KB, KiB, MB, MiB"),
    (["--paper-table1", "v2=0.87MiB"], "it needs --block paper"),
])
def test_bench_refuses_bad_block_options_with_exit_2(argv: list[str], says: str,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_memory", *argv])
    with pytest.raises(SystemExit) as exc:
        bench_memory.main()
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_bench_compares_with_table1_numbers_given_in_their_unit() -> None:
    assert table1_entry("v2=0.87MiB") == ("v2", 0.87 * 2**20)
    assert table1_entry("conv=300KB") == ("conv", 300e3)
    rows = []
    for kind, t, bytes_ in (("conv", None, 100), ("v2", 1, 300), ("v3", 1, 450), ("v2", 6, 1000),
                            ("v3", 6, 2000)):
        rows.append({"block": kind, "expansion": t, "method": "vanilla", "activation_bytes": bytes_,
                     "activation_bytes_torchvision": bytes_ * 2 // 3 if t == 1 else bytes_})
        if t == 6:
            rows.append({"block": kind, "expansion": t, "method": "mobiletl:proj-bn",
                         "reduction_vs_vanilla": 0.455 if kind == "v2" else 0.55})
    found = paper_findings(rows, {"conv": 101.0, "v2": 310.0})
    assert found["conv_within_2pct_of_table1"] and not found["v2_within_2pct_of_table1"]
    assert "v3_over_table1" not in found and found["v3_table1_bytes"] == 450
    assert found["v2_t6_within_1pt_of_paper"] and not found["v3_t6_within_1pt_of_paper"]
    assert found["v2_torchvision_over_paper_form"] == pytest.approx(2 / 3)
