"""Real int8 execution of a frozen bottom on CPU, or an explicit fp32 fallback.

Which API gives real int8 kernels with torch 2.14.1: ``torch.ao.quantization``'s
pt2e entry points moved to torchao (``torch.ao.quantization.quantize_pt2e`` is gone),
and pt2e's X86InductorQuantizer only reaches int8 kernels through ``torch.compile``.
FX graph-mode static quantization (``prepare_fx`` / ``convert_fx`` with the ``x86``
backend, fbgemm + oneDNN) still ships and lowers conv/linear (+BN folded, +ReLU fused)
to ``quantized::conv2d`` int8 kernels directly, with no compiler, several times faster than
fp32 for ResNet-18 / SqueezeNet / MobileNetV2 bottoms (benchmarks/bench_int8_bottom). It is deprecated
upstream, so its warnings are silenced here and every use goes through this module:
a move to torchao pt2e later is a change in one place.

Static quantization needs activation ranges: observers run over a few calibration
batches (``calibrate_batches``) of the data the bottom will see. The output of the
quantized bottom is dequantized to float32, so downstream stages (quantize, cache,
the bf16 top) see the same kind of tensor as from the fp32 bottom.

A CPU or a build without int8 kernels (no x86/fbgemm engine, no AVX2, or a probe
that disagrees with fp32) gets the fp32 bottom and a warning that says so: never a
silently wrong result.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Iterable

import torch
from torch import nn

ENGINES = ("x86", "fbgemm")


class Int8UnavailableWarning(RuntimeWarning):
    """int8 was asked for but the bottom runs in fp32 (the reason is in the message)."""


@functools.lru_cache(maxsize=1)
def int8_support() -> tuple[str | None, str]:
    """(engine, reason): the quantized engine to use, or None with the reason int8 is unavailable."""
    engines = torch.backends.quantized.supported_engines
    engine = next((e for e in ENGINES if e in engines), None)
    if engine is None:
        return None, f"this torch build has no x86/fbgemm quantized engine (has {engines})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return None, f"the CPU capability is {capability}, the x86 int8 kernels need AVX2 or AVX512"
    try:
        _probe(engine)
    except Exception as exc:  # noqa: BLE001 - any failure means: no trustworthy int8 here
        return None, f"an int8 probe convolution failed: {type(exc).__name__}: {exc}"
    return engine, f"x86 int8 kernels ({engine} engine, {capability})"


def _probe(engine: str) -> None:
    """Quantize a tiny conv net and check it agrees with fp32: int8 kernels that run but are wrong
    would otherwise pass unnoticed."""
    gen = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1)).eval()
    x = torch.randn(4, 3, 8, 8, generator=gen)
    q = quantize_fx(net, [x], engine)
    with torch.inference_mode():
        ref, out = net(x), q(x)
    err = float((ref - out).norm() / ref.norm().clamp_min(1e-12))
    if not err < 0.1:
        raise RuntimeError(f"int8 output differs from fp32 by {err:.3f} (relative L2), expected < 0.1")


def quantize_fx(model: nn.Module, calibration: Iterable[torch.Tensor], engine: str) -> nn.Module:
    """Static int8 (FX graph mode): fold BN, fuse ReLU, observe ``calibration``, convert to int8 kernels."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    batches = list(calibration)
    if not batches:
        raise ValueError("int8 quantization needs at least one calibration batch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notices of torch.ao.quantization (see module doc)
        if torch.backends.quantized.engine != engine:
            torch.backends.quantized.engine = engine
        prepared = prepare_fx(copy.deepcopy(model).eval(), get_default_qconfig_mapping(engine),
                              (batches[0][:1],))
        with torch.no_grad():
            for x in batches:
                prepared(x)
        return convert_fx(prepared)


class Int8Bottom(nn.Module):
    """A quantized bottom: float32 in, float32 out, int8 inside."""

    def __init__(self, quantized: nn.Module, engine: str) -> None:
        super().__init__()
        self.quantized = quantized
        self.engine = engine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized(x.float().contiguous())


def int8_bottom(bottom: nn.Module, calibration: Iterable[torch.Tensor], *,
                where: str = "frozen bottom") -> tuple[nn.Module, str]:
    """(module, precision actually used): the int8 bottom, or ``bottom`` itself with a warning.

    A bottom without conv/linear layers (a cut at the input) has nothing to quantize and
    stays as it is.
    """
    if not any(isinstance(m, (nn.Conv2d, nn.Linear)) for m in bottom.modules()):
        return bottom, "fp32"
    engine, reason = int8_support()
    if engine is None:
        warnings.warn(f"{where}: precision int8 requested but {reason}; running the bottom in fp32 instead "
                      "(results are fp32 results, the output is marked precision fp32)",
                      Int8UnavailableWarning, stacklevel=2)
        return bottom, "fp32"
    return Int8Bottom(quantize_fx(bottom, calibration, engine), engine), "int8"
