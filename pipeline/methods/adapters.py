"""How the top of a split backbone is made trainable: the ``method:`` of a ``finetune`` stage.

Transfer learning methods differ in *which* parameters of the top train and in *how*
backward is computed, not in the data path or the epoch loop, so every method is a
transformation of the top applied before the shared trainer runs:

- ``vanilla`` (default): every parameter of the top trains with stock layers — "fine-tune
  the last N blocks"; with ``train_last_blocks`` covering every block this is FT-Full;
- ``ft_full``: the same, but insists the top is the whole network (TinyTL's FT-Full baseline);
- ``ft_last``: only the classifier trains (TinyTL's FT-Last);
- ``ft_norm_last``: normalization layers (scale, shift, statistics) and the classifier (FT-Norm+Last);
- ``mobiletl``: MobileTL on the IRBs of the top (``variant``: proj-bn | all-bn-shift | all-bn);
- ``tinytl``: TinyTL (``mode``: bias | lite | lite_bias; optional BN -> GN).

Recipes write ``method: mobiletl`` or ``method: {type: tinytl, mode: lite_bias}``.
Frozen parts of every non-vanilla method use the lean layers of ``pipeline.methods.layers``
so they keep no activation they do not need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from ..errors import ModelError
from ..lazy import lazy_module
from ..recipe_model import FiniteModel, plain_value
from .variants import Variant

if TYPE_CHECKING:
    from torch import nn

    from ..models import zoo
    from . import layers, mobiletl, tinytl
else:
    nn = lazy_module("torch.nn")
    layers = lazy_module("pipeline.methods.layers")
    mobiletl = lazy_module("pipeline.methods.mobiletl")
    tinytl = lazy_module("pipeline.methods.tinytl")
    zoo = lazy_module("pipeline.models.zoo")



class _Method(FiniteModel):  # ``type`` is the union's discriminator
    type: str  # each method narrows it to its own literal, the recipe's ``type:``

    def label(self) -> str:
        return str(self.type)


class VanillaMethod(_Method):
    """Every parameter of the top trains, stock layers (fine-tune the last N blocks)."""

    type: Literal["vanilla"]


class FTFullMethod(_Method):
    """Every parameter of the whole network trains (TinyTL's FT-Full); the top must be every block."""

    type: Literal["ft_full"]


class FTLastMethod(_Method):
    """Only the classifier trains (TinyTL's FT-Last); the blocks of the top stay exactly as pretrained."""

    type: Literal["ft_last"]


class FTNormLastMethod(_Method):
    """Normalization layers (scale, shift, running statistics) and the classifier train (FT-Norm+Last)."""

    type: Literal["ft_norm_last"]


class MobileTLMethod(_Method):
    """MobileTL (Chiang et al., AAAI 2023) on the inverted residual blocks of the top."""

    type: Literal["mobiletl"]
    variant: Variant = "proj-bn"

    def label(self) -> str:
        return f"mobiletl:{self.variant}"


class TinyTLMethod(_Method):
    """TinyTL (Cai et al., NeurIPS 2020): frozen weights; biases (B), lite residuals (L) or both (L+B)."""

    type: Literal["tinytl"]
    mode: Literal["bias", "lite", "lite_bias"] = "lite_bias"
    replace_bn_with_gn: bool = False
    gn_channels_per_group: int = Field(8, ge=1)
    lite_kernel: int = Field(5, ge=1, description="odd; shrunk by 2 until it fits the pooled map")
    lite_groups: int = Field(2, ge=1)
    lite_downsample: int = Field(2, ge=1, description="average-pool factor before the lite conv")
    lite_expand: float = Field(1.0, gt=0, description="lite conv width / block input width")

    @field_validator("gn_channels_per_group", "lite_kernel", "lite_groups", "lite_downsample", "lite_expand",
                     mode="before")
    @classmethod
    def _plain(cls, value: Any, info: ValidationInfo) -> Any:
        return plain_value(cls, value, info)

    @field_validator("lite_kernel")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError(f"lite_kernel must be odd (same padding), found {v}")
        return v

    def label(self) -> str:
        return f"tinytl:{self.mode}" + ("+gn" if self.replace_bn_with_gn else "")


MethodConfig = Annotated[VanillaMethod | FTFullMethod | FTLastMethod | FTNormLastMethod | MobileTLMethod
                         | TinyTLMethod, Field(discriminator="type")]
METHOD_TYPES = ("vanilla", "ft_full", "ft_last", "ft_norm_last", "mobiletl", "tinytl")
DEFAULT_METHOD = VanillaMethod(type="vanilla")


def method_shorthand(value: Any) -> Any:
    """``method: mobiletl`` means ``method: {type: mobiletl}`` (pydantic ``before`` validator)."""
    if isinstance(value, str):
        return {"type": value}
    return value


@dataclass
class Adapted:
    """What a method did to the top: its label and counts for logs and metrics."""

    method: str
    details: dict[str, Any] = field(default_factory=dict)


def _freeze(module: nn.Module) -> None:
    for p in module.parameters():
        p.requires_grad_(False)


def _train_classifier(top: nn.Module) -> None:
    _name, layer = zoo.final_layer(top)
    for p in layer.parameters():
        p.requires_grad_(True)


def check_method(method: _Method, arch: str, blocks: list[nn.Module], train_last_blocks: int) -> None:
    """Fail before any work when ``method`` cannot apply to ``arch`` cut at ``train_last_blocks``."""
    n = len(blocks)
    if isinstance(method, FTFullMethod) and train_last_blocks != n:
        raise ModelError(f"method ft_full fine-tunes the whole network: set train_last_blocks: {n} "
                         f"(all {n} blocks of {arch}), found {train_last_blocks}; "
                         "use method: vanilla to fine-tune the last N blocks")
    if isinstance(method, MobileTLMethod):
        mobiletl.check_mobiletl_top(arch, blocks, train_last_blocks)
    if isinstance(method, TinyTLMethod) and method.mode != "bias":
        from .mobiletl import SUPPORTED_ARCHS, is_irb

        if arch not in SUPPORTED_ARCHS:
            raise ModelError(f"TinyTL mode {method.mode!r} puts lite residual modules beside inverted "
                             f"residual blocks; {arch} has none. Supported models: "
                             f"{', '.join(SUPPORTED_ARCHS)} (mode: bias works for any model)")
        if not any(is_irb(b) for b in blocks[n - train_last_blocks:]):
            last = max(i for i, b in enumerate(blocks) if is_irb(b))
            raise ModelError(f"TinyTL mode {method.mode!r}: the last {train_last_blocks} blocks of {arch} "
                             f"hold no inverted residual block; use train_last_blocks in {n - last}..{n} "
                             "or mode: bias")


def apply_method(method: _Method, arch: str, blocks: list[nn.Module], top: nn.Module, train_last_blocks: int,
                 top_input_shape: tuple[int, int, int]) -> Adapted:
    """Make ``top`` (the last ``train_last_blocks`` of ``blocks`` plus the head) trainable per ``method``.

    Works in place and sets ``requires_grad`` on every parameter of ``top``;
    ``top_input_shape`` is (C, H, W) at the cut (TinyTL sizes its lite modules from it).
    """
    check_method(method, arch, blocks, train_last_blocks)
    top_blocks = blocks[len(blocks) - train_last_blocks:]
    details: dict[str, Any] = {}
    if isinstance(method, (VanillaMethod, FTFullMethod)):
        for p in top.parameters():
            p.requires_grad_(True)
    elif isinstance(method, FTLastMethod):
        _freeze(top)
        _train_classifier(top)
        details["lean_layers"] = layers.memory_efficient_frozen_layers(top)
    elif isinstance(method, FTNormLastMethod):
        _freeze(top)
        for m in top.modules():
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)):
                for p in m.parameters():
                    p.requires_grad_(True)
        _train_classifier(top)
        details["lean_layers"] = layers.memory_efficient_frozen_layers(top)
    elif isinstance(method, MobileTLMethod):
        for p in top.parameters():
            p.requires_grad_(True)
        details.update(mobiletl.apply_mobiletl(arch, blocks, train_last_blocks, method.variant))
    elif isinstance(method, TinyTLMethod):
        _freeze(top)
        if method.replace_bn_with_gn:
            per_group = method.gn_channels_per_group
            details["gn_replaced"] = sum(tinytl.replace_bn_with_gn(b, per_group) for b in top_blocks)
            _freeze(top)
        if method.mode in ("lite", "lite_bias"):
            lite = tinytl.add_lite_residuals(arch, top_blocks, top_input_shape, kernel=method.lite_kernel,
                                      groups=method.lite_groups, downsample=method.lite_downsample,
                                      expand=method.lite_expand,
                                      gn_channels_per_group=method.gn_channels_per_group)
            details["lite_modules"] = len(lite)
            details["lite_kernels"] = [m["kernel"] for m in lite]
        if method.mode in ("bias", "lite_bias"):
            details["bias_elements"] = sum(tinytl.train_biases(b) for b in top_blocks)
        _train_classifier(top)
        details["lean_layers"] = layers.memory_efficient_frozen_layers(top)
    else:  # pragma: no cover - the discriminated union admits nothing else
        raise ModelError(f"unknown method {method!r}; expected one of {METHOD_TYPES}")
    return Adapted(method.label(), details)
