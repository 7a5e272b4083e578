"""Rebuilding a model file's network from its description, with the toolkit's own constructors.

The description names a family and its settings; the network is constructed exactly as the
stage that trained it constructed it (the same backbone builder, the same cut, the same method
applied to the top), so the file's state_dict loads with strict key and shape checks. The random
initialisation this construction draws is thrown away (the weights are loaded over it) and happens
on a forked RNG, so loading a model never changes a caller's random numbers.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import TypeAdapter, ValidationError
from torch import nn

from ..errors import ModelError
from ..methods import adapters
from ..methods.neuroflux import aux as aux_heads
from ..methods.neuroflux import models as layer_nets
from ..models import zoo

FAMILIES = ("backbone", "transfer", "neuroflux_exit")


class TransferNet(nn.Module):
    """The frozen bottom followed by the trained top: the whole network of a transfer-learning result.

    State dict keys are ``bottom.*`` and ``top.*``, as in the trainer's ``FrozenBottomNet``; unlike it,
    the bottom runs as stored (no batch-norm folding at the first forward), so ``torch.export`` and
    ONNX see the plain graph.
    """

    def __init__(self, bottom: nn.Module, top: nn.Module) -> None:
        super().__init__()
        self.bottom, self.top = bottom, top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.top(self.bottom(x))


def _method(config: Any) -> Any:
    try:
        return TypeAdapter(adapters.MethodConfig).validate_python(config)
    except ValidationError as exc:
        raise ValueError(f"unknown or invalid method {config!r}: {exc.errors()[0]['msg']}") from None


def rebuild(network: Mapping[str, Any]) -> nn.Module:
    """A freshly constructed network of the described family (weights to be loaded by the caller)."""
    family = network.get("family")
    if family not in FAMILIES:
        raise ValueError(f"unknown network family {family!r}; this toolkit rebuilds {list(FAMILIES)}")
    num_classes = int(network["num_classes"])
    with torch.random.fork_rng(devices=[]):
        try:
            if family == "neuroflux_exit":
                c, h, _w = (int(d) for d in network["in_shape"])
                net = layer_nets.build_layer_net(str(network["arch"]), num_classes,
                                                 width_mult=float(network["width_mult"]), in_channels=c,
                                                 resolution=h)
                k = int(network["exit_layer"])
                if network.get("head", "aux") == "classifier":  # NeuroFlux's planner trained it end to end
                    return aux_heads.ExitModel(list(net.layers), net.classifier)
                heads = aux_heads.build_aux_heads(net.info, network["aux"], num_classes)
                return aux_heads.ExitModel(list(net.layers[: k + 1]), heads[k])
            backbone = zoo.build_backbone(str(network["arch"]), num_classes,
                                          width_mult=float(network["width_mult"]),
                                          small_input=bool(network["small_input"]),
                                          resolution=int(network.get("resolution", 224)))
            if family == "backbone":
                return backbone
            n = int(network["train_last_blocks"])
            bottom, top = zoo.split_at(backbone, n)
            c, h, w = (int(d) for d in network["top_input_shape"])
            adapters.apply_method(_method(network["method"]), backbone.arch, list(backbone.blocks), top, n,
                                  (c, h, w))
            return TransferNet(bottom, top)
        except ModelError as exc:
            raise ValueError(str(exc)) from None


class OnnxModule(nn.Module):
    """An exported ONNX file run by onnxruntime, called like a module (float32 NCHW in, logits out)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        try:
            import onnxruntime
        except ModuleNotFoundError:
            raise ModelError(f"{path} is an ONNX model: running it needs onnxruntime "
                             "(pip install onnxruntime)") from None
        self.path = path
        self.session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.session.run(None, {self.input_name: x.detach().cpu().numpy()})[0]
        return torch.from_numpy(out)


def torchscript(path: Path) -> nn.Module:
    """A TorchScript file (``export --format torchscript``); torch's deprecation warning is not repeated."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return torch.jit.load(str(path))  # type: ignore[no-any-return]
        except Exception as exc:  # noqa: BLE001 - a damaged archive fails in many ways
            raise ModelError(f"{path}: cannot load the TorchScript file ({type(exc).__name__}); corrupt or "
                             "truncated") from None
