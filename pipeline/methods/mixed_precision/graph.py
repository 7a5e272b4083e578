"""A model as a layer graph: where can it be cut so that exactly one tensor crosses?

Mixed-precision partitioning runs everything below a cut as integer inference and
trains everything above it, so the cut must be a point where the bottom hands the
top a single tensor. A block list (``split_at``) gives such points by construction;
a layer graph finds all of them, including those inside blocks (after a SqueezeNet
Fire's squeeze layer), and rules out those a residual connection jumps over.

The model is traced with ``torch.fx`` (symbolic tracing: no data, no weights
touched) into a NetworkX DiGraph of its operations. Definition 3 of the paper orders
the layers topologically; we use the lexicographic topological sort keyed by the
traced program order, which is deterministic and, like every topological order,
puts each layer after all of its inputs. A cut after node ``v`` in that order is
valid when the only tensor produced at or before ``v`` and consumed after it is
``v``'s own output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn

from ...errors import ModelError

QUANTIZABLE = (nn.Conv2d, nn.Linear)
_BLOCK = re.compile(r"^blocks\.(\d+)(\.|$)")


@dataclass(frozen=True)
class CutPoint:
    """A valid cut: after ``node`` (an fx node name), with ``layers_below`` run as the frozen bottom.

    ``layer`` is the cut layer in the paper's sense: the last quantizable layer below
    the cut. ``train_last_blocks`` is the same cut in block-list terms when it falls on
    a block boundary of a ``BlockNet`` (None inside a block or for other models).
    """

    node: str
    position: int
    layer: str
    layers_below: tuple[str, ...]
    train_last_blocks: int | None = None


class _PathTracer(fx.Tracer):
    """An fx tracer that remembers which module it was inside when tracing failed."""

    def __init__(self) -> None:
        super().__init__()
        self.failed_at: str | None = None

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        path = self.path_of_module(m)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_at is None:  # the innermost module is the first to see the exception
                self.failed_at = path
            raise


def trace(model: nn.Module) -> fx.GraphModule:
    """``torch.fx`` trace of ``model``; a ModelError names the layer where tracing failed."""
    tracer = _PathTracer()
    name = getattr(model, "arch", type(model).__name__)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # noqa: BLE001 - any trace failure gets the same advice
        where = tracer.failed_at or "<root forward>"
        layer_type = type(model.get_submodule(where)).__name__ if tracer.failed_at else type(model).__name__
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(
            f"cannot trace {name} into a layer graph: layer {where!r} ({layer_type}) failed: {first}; "
            "a layer whose control flow depends on tensor values cannot be traced. Use the block-list cut "
            "instead (frozen_forward with train_last_blocks: N), which needs no layer graph"
        ) from None
    return fx.GraphModule(model, graph)


def _block_of(node: fx.Node) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    for path in stack:
        match = _BLOCK.match(str(path))
        if match:
            return int(match.group(1))
    if node.op == "call_module":
        match = _BLOCK.match(str(node.target))
        if match:
            return int(match.group(1))
    return None


@dataclass
class LayerGraph:
    """Operations of a traced model as a DAG, in a topological order, with its valid cuts."""

    module: fx.GraphModule
    graph: nx.DiGraph
    order: list[str]
    layers: list[str]  # quantizable layers (Conv2d/Linear module paths), in topological order
    classifier: str | None
    num_blocks: int | None = None
    _cuts: list[CutPoint] | None = field(default=None, repr=False)

    def layer_of(self, node: str) -> str | None:
        data = self.graph.nodes[node]
        return data["target"] if data["quantizable"] else None

    def cut_points(self) -> list[CutPoint]:
        """Every valid cut (one tensor crosses) with at least one layer below and the classifier above."""
        if self._cuts is not None:
            return self._cuts
        position = {n: i for i, n in enumerate(self.order)}
        cuts: list[CutPoint] = []
        below: list[str] = []
        open_outputs: set[str] = set()  # nodes at or before the cut still consumed after it
        for i, name in enumerate(self.order):
            data = self.graph.nodes[name]
            if data["op"] == "output":
                break
            if data["quantizable"]:
                below.append(data["target"])
            open_outputs = {u for u in open_outputs if any(position[w] > i for w in self.graph.successors(u))}
            if data["op"] != "get_attr" and any(position[w] > i for w in self.graph.successors(name)):
                open_outputs.add(name)
            if open_outputs != {name} or not below or data["op"] == "placeholder":
                continue
            if self.classifier is not None and self.classifier in below:
                break  # the classifier always trains: no cut at or above it
            cuts.append(CutPoint(name, i, below[-1], tuple(below), self._train_last_blocks(name, i)))
        self._cuts = cuts
        return cuts

    def _train_last_blocks(self, name: str, i: int) -> int | None:
        if self.num_blocks is None:
            return None
        block = self.graph.nodes[name]["block"]
        if block is None:
            return None
        following = [n for n in self.order[i + 1:] if self.graph.nodes[n]["op"] not in ("get_attr", "output")]
        next_block = self.graph.nodes[following[0]]["block"] if following else None
        if next_block == block:
            return None  # inside a block: not expressible as a block-list cut
        return self.num_blocks - (block + 1)

    def cut_at(self, layer_or_node: str) -> CutPoint:
        """The valid cut named by a layer (the highest cut whose cut layer it is) or by an fx node name."""
        cuts = self.cut_points()
        hits = [c for c in cuts if c.node == layer_or_node] or [c for c in cuts if c.layer == layer_or_node]
        if not hits:
            valid = sorted({c.layer for c in cuts}, key=self.layers.index)
            raise ModelError(f"{layer_or_node!r} is not a valid cut of this model (a residual connection or "
                             f"a second branch crosses it, or no such layer); valid cut layers: {valid}")
        return hits[-1]


def layer_graph(model: nn.Module, classifier: str | None = None) -> LayerGraph:
    """Trace ``model`` into a ``LayerGraph``; ``classifier`` defaults to a BlockNet's final layer."""
    gm = trace(model)
    modules = dict(gm.named_modules())
    if classifier is None and hasattr(model, "final_layer_name"):
        classifier = str(model.final_layer_name)
    g = nx.DiGraph()
    program_order: dict[str, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        program_order[node.name] = i
        target = str(node.target) if node.op in ("call_module", "get_attr") else getattr(
            node.target, "__name__", str(node.target))
        quantizable = node.op == "call_module" and isinstance(modules.get(str(node.target)), QUANTIZABLE)
        g.add_node(node.name, op=node.op, target=target, quantizable=quantizable, block=_block_of(node))
        for parent in node.all_input_nodes:
            g.add_edge(parent.name, node.name)
    if not nx.is_directed_acyclic_graph(g):
        raise ModelError(f"the traced graph of {getattr(model, 'arch', type(model).__name__)} has a cycle")
    order = list(nx.lexicographical_topological_sort(g, key=program_order.__getitem__))
    layers = [g.nodes[n]["target"] for n in order if g.nodes[n]["quantizable"]]
    layers = list(dict.fromkeys(layers))  # a module called twice is one layer
    blocks = getattr(model, "blocks", None)
    num_blocks = len(blocks) if isinstance(blocks, nn.ModuleList) else None
    return LayerGraph(gm, g, order, layers, classifier, num_blocks)


def respects_edges(graph: nx.DiGraph, order: list[str]) -> bool:
    """True when every edge u -> v has u before v in ``order`` (a topological order, Definition 3)."""
    position = {n: i for i, n in enumerate(order)}
    return len(position) == graph.number_of_nodes() and all(position[u] < position[v] for u, v in graph.edges)


def split_graph(lg: LayerGraph, cut: CutPoint) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(bottom, top) GraphModules at a valid cut: bottom returns the crossing tensor, top consumes it."""
    nodes = list(lg.module.graph.nodes)
    by_name = {n.name: n for n in nodes}
    keep_bottom = set(lg.order[: cut.position + 1])
    bottom_graph, top_graph = fx.Graph(), fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.name in keep_bottom:
            env[node] = bottom_graph.node_copy(node, lambda n: env[n])
    bottom_graph.output(env[by_name[cut.node]])
    top_env: dict[fx.Node, fx.Node] = {by_name[cut.node]: top_graph.placeholder("h")}
    for node in nodes:
        if node.name in keep_bottom and node.name != cut.node and node.op == "get_attr":
            top_env[node] = top_graph.node_copy(node, lambda n: top_env[n])
    for node in nodes:
        if node.name not in keep_bottom:
            top_env[node] = top_graph.node_copy(node, lambda n: top_env[n])
    bottom, top = fx.GraphModule(lg.module, bottom_graph), fx.GraphModule(lg.module, top_graph)
    bottom.graph.eliminate_dead_code()
    bottom.recompile()
    return bottom, top


def check_split(lg: LayerGraph, cut: CutPoint, x: torch.Tensor) -> float:
    """Max |top(bottom(x)) - model(x)|: zero up to float rounding for a valid cut."""
    bottom, top = split_graph(lg, cut)
    with torch.no_grad():
        return float((top(bottom(x)) - lg.module(x)).abs().max())
