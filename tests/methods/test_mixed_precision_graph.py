"""Layer graph: topological order, single-tensor cuts with residual connections, untraceable models."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

from pipeline.errors import ModelError
from pipeline.methods.mixed_precision.graph import check_split, layer_graph, respects_edges, split_graph
from pipeline.models.zoo import build_backbone, split_at


class Residual(nn.Module):
    """conv1 -> (conv2 -> conv3) + skip -> conv4 -> pool -> fc: one residual connection."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.conv3 = nn.Conv2d(4, 4, 3, padding=1)
        self.conv4 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        h = self.conv3(torch.relu(self.conv2(h))) + h
        h = self.conv4(h)
        return self.fc(h.mean((2, 3)))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.stem(x))


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on tensor values: not traceable
            return x
        return -x


def brute_force_cuts(lg) -> list[str]:  # noqa: ANN001
    """Independent check: after which nodes does exactly that node's output cross?"""
    g, order = lg.graph, lg.order
    stop = next(i for i, n in enumerate(order) if g.nodes[n]["target"] == lg.classifier)
    out = []
    for i, node in enumerate(order[:stop]):
        before = set(order[: i + 1])
        crossing = {
            u for u, v in g.edges if u in before and v not in before and g.nodes[u]["op"] != "get_attr"
        }
        if crossing == {node} and g.nodes[node]["op"] != "placeholder":
            out.append(node)
    return out


@pytest.mark.parametrize("arch", ["resnet18", "squeezenet1_1", "mobilenet_v2"])
def test_topological_order_respects_every_edge(arch: str) -> None:
    lg = layer_graph(build_backbone(arch, 5, small_input=True))
    assert respects_edges(lg.graph, lg.order)
    assert set(lg.order) == set(lg.graph.nodes)
    assert not respects_edges(lg.graph, list(reversed(lg.order)))  # the check can fail
    assert nx.is_directed_acyclic_graph(lg.graph)
    # quantizable layers come in an order where each depends only on earlier ones
    assert lg.classifier == "head.classifier" if arch == "resnet18" else lg.classifier == "head.classifier.1"
    assert lg.layers[-1] == lg.classifier


def test_cuts_with_a_residual_connection() -> None:
    lg = layer_graph(Residual(), classifier="fc")
    cuts = {c.node: c for c in lg.cut_points()}
    # conv1's output has two consumers (conv2 and the skip) but is one tensor: a valid cut.
    assert [c.layer for c in lg.cut_points()][0] == "conv1"
    # Inside the residual branch the skip tensor crosses too: no cut after conv2 or its relu.
    assert all(c.layer != "conv2" for c in cuts.values())
    with pytest.raises(ModelError, match="not a valid cut.*residual"):
        lg.cut_at("conv2")
    assert lg.cut_at("conv3").node == "add"  # after the add the branch has merged
    assert sorted(cuts) == sorted(brute_force_cuts(lg))
    assert all("fc" not in c.layers_below for c in cuts.values())  # the classifier is never below a cut
    x = torch.randn(2, 3, 8, 8)
    for cut in cuts.values():
        assert check_split(lg, cut, x) == 0.0


def test_resnet18_cuts_are_block_boundaries_and_match_split_at() -> None:
    torch.manual_seed(0)
    net = build_backbone("resnet18", 5).eval()
    lg = layer_graph(net)
    cuts = lg.cut_points()
    assert [c.node for c in cuts] == brute_force_cuts(lg)
    block_cuts = [c for c in cuts if c.train_last_blocks is not None]
    assert [c.train_last_blocks for c in block_cuts] == list(range(8, -1, -1))
    # no cut between a residual block's first conv and its add
    assert not any(c.layer == "blocks.1.conv1" for c in cuts)
    x = torch.randn(2, 3, 32, 32)
    for cut in block_cuts[:3]:
        bottom_fx, _ = split_graph(lg, cut)
        bottom_blocks, _ = split_at(net, cut.train_last_blocks)
        with torch.no_grad():
            torch.testing.assert_close(bottom_fx(x), bottom_blocks(x))
        assert check_split(lg, cut, x) < 1e-5


def test_squeezenet_has_cuts_inside_fire_modules() -> None:
    lg = layer_graph(build_backbone("squeezenet1_1", 5, small_input=True))
    layers = {c.layer: c for c in lg.cut_points()}
    assert layers["blocks.3.squeeze"].train_last_blocks is None  # squeeze output: one tensor, two expands
    assert "blocks.3.expand1x1" not in layers  # expand1x1 and the squeeze output both cross
    assert layers["blocks.3.expand3x3"].train_last_blocks == 9  # after the concat: a block boundary


def test_untraceable_model_names_the_layer_and_suggests_block_cut() -> None:
    with pytest.raises(ModelError) as err:
        layer_graph(DataDependent())
    msg = str(err.value)
    assert "'gate'" in msg and "Gate" in msg and "train_last_blocks" in msg
