"""Memory-efficient drop-in layers for training only part of a network.

What backward has to keep is decided by what is trained, not by the layer type; stock
PyTorch layers keep more than that (a frozen convolution still saves its input, an
eval-mode BatchNorm saves its input, ReLU6 saves a float32 copy where a 1-bit mask
suffices). These layers keep only what the gradient needs, following:

- MobileTL (Chiang et al., AAAI 2023), Sec. 3: an intermediate BatchNorm that trains only
  its shift beta is ``y = a*x + b`` with a constant ``a``, so its backward needs no
  activation (Eq. 5-6); ReLU6 and Hard-Swish backward are replaced by the sign function's
  mask ``1[x >= 0]`` (Eq. 8), stored at 1 bit per element.
- TinyTL (Cai et al., NeurIPS 2020), Sec. 2: with frozen weights a convolution's backward
  to its input needs the weight only (Eq. 2: dL/dx needs W, dL/dW needs x), and ReLU's
  derivative is a binary mask, so bias-only training keeps almost nothing.

Every class subclasses the stock layer it replaces and shares its parameters and buffers
(:func:`convert`), so ``state_dict`` keys, ``isinstance`` checks and checkpoints are
unchanged. Each defines ``activation_bits(input_requires_grad)``, the bits per input
element it keeps for backward, which the analytic meter (``pipeline.models.memory``) reads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_input

from ..codec.bitpack import pack, unpack

M = TypeVar("M", bound=nn.Module)


# --------------------------------------------------------------------------- bit-packed masks
def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 with 8 elements per byte (``ceil(numel / 8)`` bytes, LSB first).

    Uses the feature codec's 1-bit packer (``pipeline.codec.bitpack``), whose output owns
    exactly ``ceil(numel / 8)`` bytes: a mask kept for backward costs 1/32 of the float32
    activation it stands for.
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_mask expects a bool tensor, found {mask.dtype}")
    flat = mask.reshape(1, -1).view(torch.uint8)
    return pack(flat, 1)[0]


def unpack_mask(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: a uint8 tensor of 0/1 of ``shape``."""
    numel = 1
    for d in shape:
        numel *= int(d)
    return unpack(packed.reshape(1, -1), 1, numel).view(shape)


class _MaskedActivation(torch.autograd.Function):
    """``y = fn(x)``; backward ``g * mask(x)`` with the mask saved bit-packed (1 bit per element).

    ``mask_fn`` decides the derivative: the exact one of ReLU/ReLU6 (lossless) or MobileTL's
    sign approximation ``1[x >= 0]`` for ReLU6/Hard-Swish.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor,
                fn: Callable[[torch.Tensor], torch.Tensor],
                mask_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        y = fn(x)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(pack_mask(mask_fn(x)))
            ctx.shape = x.shape
        return y

    @staticmethod
    def backward(ctx: Any,
                 grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (packed,) = ctx.saved_tensors
        mask = unpack_mask(packed, ctx.shape)
        return grad * mask.to(grad.dtype), None, None


def _sign(x: torch.Tensor) -> torch.Tensor:
    return x >= 0


def _relu_mask(x: torch.Tensor) -> torch.Tensor:
    return x > 0


def _relu6_mask(x: torch.Tensor) -> torch.Tensor:
    return (x > 0) & (x < 6)


def sign_mask_activation(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(x)`` whose backward is MobileTL's sign mask: ``dL/dx = dL/dy * 1[x >= 0]`` (Eq. 8)."""
    if not x.requires_grad:
        return fn(x)
    return _MaskedActivation.apply(x, fn, _sign)


# --------------------------------------------------------------------------- conversion
def convert(module: nn.Module, cls: type[M]) -> M:
    """``module`` re-classed as ``cls`` (a subclass of its class), sharing parameters and buffers.

    The new module holds the very same ``Parameter`` and buffer objects, so an optimizer,
    the original network and ``state_dict`` keys all see one set of weights.
    """
    if not isinstance(module, cls.__mro__[1]):
        raise TypeError(f"cannot convert {type(module).__name__} to {cls.__name__}: "
                        f"expected a {cls.__mro__[1].__name__}")
    new = cls.__new__(cls)
    new.__dict__.update({k: copy.copy(v) if isinstance(v, dict) else v for k, v in module.__dict__.items()})
    return new


def replace_modules(root: nn.Module, pick: Callable[[str, nn.Module], nn.Module | None]) -> int:
    """Replace every descendant ``m`` of ``root`` for which ``pick(name, m)`` returns a module; count them."""
    replaced = 0
    for parent_name, parent in list(root.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            new = pick(full, child)
            if new is not None and new is not child:
                parent.register_module(child_name, new)
                replaced += 1
    return replaced


# --------------------------------------------------------------------------- activations
class SignReLU6(nn.ReLU6):
    """ReLU6 forward; backward by the sign mask ``1[x >= 0]`` kept at 1 bit (MobileTL Eq. 8)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sign_mask_activation(x, F.relu6)

    def activation_bits(self, input_requires_grad: bool) -> int:
        return 1 if input_requires_grad else 0


class SignHardswish(nn.Hardswish):
    """Hard-Swish forward; backward by the sign mask ``1[x >= 0]`` kept at 1 bit (MobileTL Eq. 8).

    Hard-Swish's exact derivative ``(2x + 3) / 6`` on ``[-3, 3]`` needs the float input;
    MobileTL approximates it by the step function so only a bit per element survives.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sign_mask_activation(x, F.hardswish)

    def activation_bits(self, input_requires_grad: bool) -> int:
        return 1 if input_requires_grad else 0


class PackedReLU(nn.ReLU):
    """ReLU with its exact derivative ``1[x > 0]`` kept bit-packed instead of a float32 output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:
            return F.relu(x)
        return _MaskedActivation.apply(x, F.relu, _relu_mask)

    def activation_bits(self, input_requires_grad: bool) -> int:
        return 1 if input_requires_grad else 0


class PackedReLU6(nn.ReLU6):
    """ReLU6 with its exact derivative ``1[0 < x < 6]`` kept bit-packed instead of a float32 output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:
            return F.relu6(x)
        return _MaskedActivation.apply(x, F.relu6, _relu6_mask)

    def activation_bits(self, input_requires_grad: bool) -> int:
        return 1 if input_requires_grad else 0


# --------------------------------------------------------------------------- normalization
class ShiftBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm with frozen scale and statistics: ``y = a * x + (beta - a * mean)``, ``a`` constant.

    MobileTL trains only the shift beta of the intermediate BNs (Sec. 3.1): with gamma and
    the running statistics frozen, ``dL/dx = a * dL/dy`` and ``dL/dbeta = sum(dL/dy)``, so
    no activation is kept (only the per-channel ``a``). TinyTL-B's frozen BNs are the same
    layer. Never updates running statistics, in train mode or not.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.running_mean is None or self.running_var is None:
            raise RuntimeError("ShiftBatchNorm2d needs running statistics (track_running_stats=True)")
        with torch.no_grad():
            a = torch.rsqrt(self.running_var + self.eps)
            if self.weight is not None:
                a = a * self.weight
            b = -self.running_mean * a
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = x * a.view(shape)
        shift = b if self.bias is None else b + self.bias
        return y + shift.view(shape)

    def activation_bits(self, input_requires_grad: bool) -> int:
        return 0


def shift_batchnorm(bn: nn.BatchNorm2d, *, train_shift: bool = True) -> ShiftBatchNorm2d:
    """``bn`` as a :class:`ShiftBatchNorm2d` with gamma frozen and beta trainable iff ``train_shift``."""
    new = convert(bn, ShiftBatchNorm2d)
    if new.weight is not None:
        new.weight.requires_grad_(False)
    if new.bias is not None:
        new.bias.requires_grad_(train_shift)
    return new


# --------------------------------------------------------------------------- convolution
def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs a convolution in on ``x``'s device, or None when autocast is off."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


class _FrozenWeightConv2d(torch.autograd.Function):
    """conv2d whose weight is frozen: backward to the input needs only the weight (TinyTL Eq. 2).

    Under autocast (bf16 on CPU or CUDA, fp16 on CUDA) the forward runs in autocast's dtype, as
    ``F.conv2d`` would, and the weight is kept in that dtype for backward (half the bytes); the
    backward, which autograd runs outside autocast, computes in the same dtype and hands back
    gradients in the inputs' own dtypes.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, ...],
                padding: tuple[int, ...], dilation: tuple[int, ...], groups: int) -> torch.Tensor:
        dtype = _autocast_dtype(x)
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype)
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(weight)
        ctx.conv = (tuple(x.shape), stride, padding, dilation, groups)
        with torch.autocast(x.device.type, enabled=False):  # inputs already in the compute dtype
            return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx: Any,
                 grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shape, stride, padding, dilation, groups = ctx.conv
        x_dtype, bias_dtype = ctx.dtypes
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            (weight,) = ctx.saved_tensors
            grad_x = conv2d_input(shape, weight, grad.to(weight.dtype), stride, padding, dilation,
                                  groups).to(x_dtype)
        if ctx.needs_input_grad[2]:
            grad_b = grad.float().sum((0, 2, 3)).to(bias_dtype)
        return grad_x, None, grad_b, None, None, None, None


class FrozenConv2d(nn.Conv2d):
    """Conv2d that keeps no input for backward while its weight is frozen (its bias may train)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad or self.padding_mode != "zeros" or isinstance(self.padding, str) \
                or not (x.requires_grad or (self.bias is not None and self.bias.requires_grad)):
            return super().forward(x)
        return _FrozenWeightConv2d.apply(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                                         self.groups)

    def activation_bits(self, input_requires_grad: bool) -> int:
        return 32 if self.weight.requires_grad else 0


def frozen_conv(conv: nn.Conv2d) -> FrozenConv2d:
    """``conv`` as a :class:`FrozenConv2d` (its weight frozen; the bias keeps its requires_grad)."""
    new = convert(conv, FrozenConv2d)
    new.weight.requires_grad_(False)
    return new


def memory_efficient_frozen_layers(root: nn.Module) -> int:
    """Swap stock layers of ``root`` for the lean ones where what trains allows it; count swaps.

    Convs with a frozen weight become :class:`FrozenConv2d`, BNs with a frozen scale that
    are not trained through their statistics (eval-mode semantics) become
    :class:`ShiftBatchNorm2d`, and ReLU/ReLU6 keep their exact mask bit-packed. Hard-Swish
    and sigmoid keep their float input: their exact derivatives need it.
    """

    def pick(_name: str, m: nn.Module) -> nn.Module | None:
        if type(m) is nn.Conv2d and not m.weight.requires_grad:
            return frozen_conv(m)
        if type(m) is nn.BatchNorm2d and m.track_running_stats and (m.weight is None
                                                                    or not m.weight.requires_grad):
            return shift_batchnorm(m, train_shift=m.bias is not None and m.bias.requires_grad)
        if type(m) is nn.ReLU:
            return convert(m, PackedReLU)
        if type(m) is nn.ReLU6:
            return convert(m, PackedReLU6)
        return None

    return replace_modules(root, pick)
