"""Fake quantization of single layers: how much accuracy does q-bit arithmetic in layer l cost?

The robustness exploration quantizes the weights *and* the input activation of each
layer to the same q bits (q in {4, 6, 8, 16}) and measures accuracy in float
arithmetic ("fake" quantization: quantize, then dequantize). The quantizers mirror
what the int8 kernels of ``int8.py`` do, so an 8-bit scheme predicts the int8 bottom:

- weights: symmetric, per output channel (fbgemm/x86 default). Per-channel scaling
  commutes with the BatchNorm that follows a conv, so quantizing the unfolded weight
  equals quantizing the BN-folded one that the int8 kernel uses;
- activations: affine, per tensor, with a static range calibrated once on float
  activations (min/max over a few calibration batches, widened to include 0 so that
  zero padding is exact), like the observers of static int8 quantization.

Uniform quantization with step ``s`` rounds to the nearest level, so every value
inside the range is off by at most ``s / 2`` (tests check that bound per bit width).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import TypeAlias

import torch
from torch import nn

from ...errors import ModelError

BIT_CHOICES = (4, 6, 8, 16)


def affine_params(lo: float, hi: float, bits: int) -> tuple[float, int]:
    """(scale, zero_point) of an unsigned ``bits``-bit grid covering [min(lo, 0), max(hi, 0)]."""
    if bits < 2:
        raise ModelError(f"fake quantization needs at least 2 bits, found {bits}")
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels if hi > lo else 1.0
    zero_point = int(round(-lo / scale))
    return scale, min(max(zero_point, 0), levels)


def fake_quant_affine(x: torch.Tensor, lo: float, hi: float, bits: int) -> torch.Tensor:
    """Quantize ``x`` to the affine ``bits``-bit grid of [lo, hi] and back; clamps values outside.

    float32 goes through torch's fused fake-quantize kernel (the search's hot path: one pass
    instead of five); other dtypes through the same arithmetic written out.
    """
    scale, zp = affine_params(lo, hi, bits)
    if x.dtype == torch.float32:
        return torch.fake_quantize_per_tensor_affine(x, scale, zp, 0, (1 << bits) - 1)
    q = torch.clamp(torch.round(x / scale) + zp, 0, (1 << bits) - 1)
    return (q - zp) * scale


def symmetric_scale(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-output-channel scale (shape broadcastable to ``w``) of a symmetric signed grid."""
    qmax = (1 << (bits - 1)) - 1
    amax = w.detach().abs().reshape(w.shape[0], -1).amax(dim=1).clamp_min(1e-12)
    return (amax / qmax).reshape(-1, *([1] * (w.dim() - 1)))


def fake_quant_weight(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-output-channel fake quantization of a weight tensor to ``bits`` bits."""
    if bits < 2:
        raise ModelError(f"fake quantization needs at least 2 bits, found {bits}")
    qmax = (1 << (bits - 1)) - 1
    scale = symmetric_scale(w, bits)
    return torch.clamp(torch.round(w / scale), -qmax, qmax) * scale


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def calibrate_input_ranges(model: nn.Module, layers: Iterable[str],
                           batches: Iterable[torch.Tensor]) -> dict[str, tuple[float, float]]:
    """(min, max) of each layer's input over ``batches``, from the float model in eval mode."""
    modules = dict(model.named_modules())
    ranges: dict[str, list[float]] = {}
    handles = []

    def observe(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach()
            lo, hi = float(x.min()), float(x.max())
            old = ranges.get(name)
            ranges[name] = [min(lo, old[0]), max(hi, old[1])] if old else [lo, hi]
        return hook

    for name in layers:
        handles.append(modules[name].register_forward_pre_hook(observe(name)))
    was_training = model.training
    model.eval()
    device = _device(model)
    try:
        with torch.no_grad():
            for x in batches:
                model(x.to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = [n for n in layers if n not in ranges]
    if missing:
        raise ModelError(f"calibration never reached layers {missing[:5]} (are they used in forward?)")
    return {k: (v[0], v[1]) for k, v in ranges.items()}


# a forward pre-hook's replacement inputs, or none
InputHookResult: TypeAlias = "tuple[torch.Tensor, ...] | None"

class FakeQuantModel:
    """A private copy of a model whose layers can be set to any per-layer bit width, cheaply.

    Quantized weights are computed once per (layer, bits) and swapped in, so evaluating
    a new scheme costs one forward pass, not a re-quantization of the network.
    """

    def __init__(self, model: nn.Module, layers: list[str], calibration: Iterable[torch.Tensor]) -> None:
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.layers = list(layers)
        self.modules = {n: m for n, m in self.model.named_modules() if n in set(layers)}
        unknown = [n for n in layers if n not in self.modules]
        if unknown:
            raise ModelError(f"layers {unknown[:5]} are not modules of {type(model).__name__}")
        self.float_weights = {n: m.weight.detach().clone() for n, m in self.modules.items()}
        self.ranges = calibrate_input_ranges(self.model, layers, calibration)
        self._weights: dict[tuple[str, int], torch.Tensor] = {}
        self.bits: dict[str, int | None] = {n: None for n in layers}
        for name, module in self.modules.items():
            module.register_forward_pre_hook(self._input_hook(name))

    def _input_hook(self, name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], InputHookResult]:
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
            bits = self.bits[name]
            if bits is None:
                return None
            lo, hi = self.ranges[name]
            return (fake_quant_affine(args[0], lo, hi, bits), *args[1:])
        return hook

    def set_scheme(self, scheme: Mapping[str, int | None]) -> None:
        """Per-layer bits (None: float); layers not named stay float."""
        for name in self.layers:
            bits = scheme.get(name)
            if bits == self.bits[name]:
                continue
            if bits is None:
                weight = self.float_weights[name]
            else:
                key = (name, int(bits))
                if key not in self._weights:
                    self._weights[key] = fake_quant_weight(self.float_weights[name], int(bits))
                weight = self._weights[key]
            with torch.no_grad():
                self.modules[name].weight.copy_(weight)
            self.bits[name] = bits

    def accuracy(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> float:
        """Top-1 accuracy of the model under the current scheme on (x, y)."""
        device = _device(self.model)
        x, y = x.to(device), y.to(device)  # a no-op when the caller put them there once
        correct = torch.zeros((), dtype=torch.int64, device=device)
        with torch.inference_mode():
            for i in range(0, len(x), batch_size):
                correct += (self.model(x[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum()
        return int(correct) / max(len(x), 1)
