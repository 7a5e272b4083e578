"""Backbones as ordered block lists with a well-defined cut.

Transfer learning here trains only the last N blocks and caches the frozen bottom's
output, so every backbone must be a flat sequence ``blocks`` followed by a ``head``
(pool, flatten, classifier). The blocks are torchvision's own modules (never
re-implemented) so torchvision checkpoints load after a key rename, and weights are
never downloaded: constructors always get ``weights=None``.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torchvision.models as tvm
from torch import nn

from ..errors import ModelError, did_you_mean
from . import transformers
from .fold import fold_batch_norms
from .weights import apply_weights


@dataclass(frozen=True)
class ArchInfo:
    constructor: Callable[..., nn.Module]
    family: str  # "features" (MobileNet/EfficientNet), "resnet", "squeezenet", "swin" or "vit"
    supports_width_mult: bool = False

    @property
    def transformer(self) -> bool:
        return self.family in ("swin", "vit")

    @property
    def fixed_input(self) -> bool:
        """Built for one input size (``resolution``): ViT, its position embedding one entry per patch."""
        return self.family == "vit"


ARCHITECTURES: dict[str, ArchInfo] = {
    "mobilenet_v2": ArchInfo(tvm.mobilenet_v2, "features", supports_width_mult=True),
    "mobilenet_v3_small": ArchInfo(tvm.mobilenet_v3_small, "features", supports_width_mult=True),
    "mobilenet_v3_large": ArchInfo(tvm.mobilenet_v3_large, "features", supports_width_mult=True),
    "efficientnet_b0": ArchInfo(tvm.efficientnet_b0, "features"),
    "resnet18": ArchInfo(tvm.resnet18, "resnet"),
    "squeezenet1_1": ArchInfo(tvm.squeezenet1_1, "squeezenet"),
    "swin_t": ArchInfo(tvm.swin_t, "swin"),
    "vit_b_16": ArchInfo(tvm.vit_b_16, "vit"),
}


class BlockNet(nn.Module):
    """``head(blocks[-1](...blocks[0](x)))``; ``tv_prefixes`` maps torchvision key prefixes to ours."""

    def __init__(self, arch: str, blocks: list[nn.Module], head: nn.Module, num_classes: int,
                 tv_prefixes: Mapping[str, str], in_channels: int = 3,
                 token_layout: tuple[int, int, int] | None = None, input_size: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        # (prefix tokens, grid H, grid W) of maps that are (D, 1, prefix + H*W) tokens (ViT); None when
        # every block's output is a plain (C, H, W) map.
        self.token_layout = token_layout
        self.input_size = input_size  # the one input size the net takes (ViT), or None: any size
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.num_classes = num_classes
        self.in_channels = in_channels
        # Longest prefix first so "layer1.0." wins over a shorter overlapping prefix.
        self.tv_prefixes = dict(sorted(tv_prefixes.items(), key=lambda kv: -len(kv[0])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @property
    def final_layer_name(self) -> str:
        """Module path of the classifier's last layer: the one whose size follows num_classes."""
        return final_layer(self)[0]

    def from_torchvision_keys(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename a torchvision state_dict's keys to this net's; unknown keys pass through unchanged
        so the loader can report them as unexpected instead of dropping them silently."""
        out: dict[str, torch.Tensor] = {}
        for key, value in state_dict.items():
            new = key
            for tv, ours in self.tv_prefixes.items():
                if key.startswith(tv):
                    new = ours + key[len(tv):]
                    break
            out[new] = value
        return out


class TopNet(nn.Module):
    """Trainable top of a split: blocks keep their index in the full net, so ``top.state_dict()``
    keys are a subset of ``net.state_dict()`` keys and can be loaded back into the full net."""

    def __init__(self, blocks: Mapping[int, nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): m for i, m in blocks.items()})
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)


_FOLDING = threading.Lock()


class FrozenBottomNet(nn.Module):
    """bottom (frozen, eval mode, no autograd graph) followed by a trainable top.

    The forward runs a copy of the bottom with its batch norms folded into the convolutions
    (:func:`~pipeline.models.fold.fold_batch_norms`, which makes it faster), made at the
    first forward and again after ``to``/``load_state_dict``; ``bottom`` itself, what the state dict
    and checkpoints hold, stays as the backbone has it.
    """

    def __init__(self, bottom: nn.Module, top: nn.Module) -> None:
        super().__init__()
        self.bottom, self.top = bottom, top
        self._folded: list[nn.Module] = []  # a list, so the copy is not a submodule (nor in the state dict)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._folded:
            with _FOLDING:  # micro-batches call forward from several threads at once
                if not self._folded:
                    frozen = not any(p.requires_grad for p in self.bottom.parameters())
                    self._folded.append(fold_batch_norms(self.bottom) if frozen else self.bottom)
        with torch.no_grad():
            h = self._folded[0](x)
        return self.top(h)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> FrozenBottomNet:
        self._folded.clear()  # moved or converted: fold again from the moved bottom
        return super()._apply(fn, *args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._folded.clear()
        return super().load_state_dict(*args, **kwargs)

    def train(self, mode: bool = True) -> FrozenBottomNet:
        super().train(mode)
        self.bottom.eval()  # frozen BN statistics stay frozen
        return self


def _first_conv(module: nn.Module) -> nn.Conv2d:
    return next(m for m in module.modules() if isinstance(m, nn.Conv2d))


def _pool_head(classifier: nn.Module, dropout: nn.Module | None = None) -> nn.Sequential:
    parts: list[tuple[str, nn.Module]] = [("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten(1))]
    if dropout is not None:
        parts.append(("dropout", dropout))
    return nn.Sequential(OrderedDict([*parts, ("classifier", classifier)]))


def _from_features(arch: str, tv: Any, num_classes: int, small_input: bool) -> BlockNet:
    if small_input:
        _first_conv(tv.features[0]).stride = (1, 1)
    if arch == "squeezenet1_1":
        # SqueezeNet pools after its final conv, inside torchvision's classifier.
        head = nn.Sequential(OrderedDict([("classifier", tv.classifier), ("flatten", nn.Flatten(1))]))
    else:
        head = _pool_head(tv.classifier)
    prefixes = {"features.": "blocks.", "classifier.": "head.classifier."}
    return BlockNet(arch, list(tv.features), head, num_classes, prefixes)


def _from_resnet(arch: str, tv: tvm.ResNet, num_classes: int, small_input: bool,
                 dropout: float | None) -> BlockNet:
    if small_input:
        # Only the stride changes, not the kernel, so ImageNet-shaped weights still load.
        tv.conv1.stride = (1, 1)
        tv.maxpool = nn.Identity()
    stem = nn.Sequential(OrderedDict([("conv1", tv.conv1), ("bn1", tv.bn1), ("relu", tv.relu),
                                      ("maxpool", tv.maxpool)]))
    blocks: list[nn.Module] = [stem]
    prefixes = {"conv1.": "blocks.0.conv1.", "bn1.": "blocks.0.bn1.", "fc.": "head.classifier."}
    for layer_idx in range(1, 5):
        for j, block in enumerate(getattr(tv, f"layer{layer_idx}")):
            prefixes[f"layer{layer_idx}.{j}."] = f"blocks.{len(blocks)}."
            blocks.append(block)
    head = _pool_head(tv.fc, nn.Dropout(dropout) if dropout is not None else None)
    return BlockNet(arch, blocks, head, num_classes, prefixes)


def _from_transformer(arch: str, family: str, tv: Any, num_classes: int) -> BlockNet:
    if family == "swin":
        blocks, head, prefixes = transformers.swin_blocks(tv)
        return BlockNet(arch, blocks, head, num_classes, prefixes)
    blocks, head, prefixes = transformers.vit_blocks(tv)
    grid = tv.image_size // tv.patch_size
    return BlockNet(arch, blocks, head, num_classes, prefixes, token_layout=(1, grid, grid),
                    input_size=tv.image_size)


def build_backbone(arch: str, num_classes: int, *, width_mult: float = 1.0, small_input: bool = False,
                   dropout: float | None = None, resolution: int = 224) -> BlockNet:
    """A randomly initialised backbone (seed with ``torch.manual_seed``); load weights separately.

    ``small_input`` makes the stem stride 1 (and drops ResNet's max-pool) so 32x32 inputs
    keep spatial maps larger than 1x1 deep into the net; weight shapes are unchanged.
    ``resolution`` is ViT's fixed input size (its position embedding has one entry per patch);
    the CNNs and Swin (which pads to whole windows) take any size and ignore it.
    """
    info = ARCHITECTURES.get(arch)
    if info is None:
        raise ModelError(f"unknown architecture {arch!r}{did_you_mean(arch, ARCHITECTURES)}; "
                         f"expected one of {sorted(ARCHITECTURES)}")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"num_classes for {arch} must be an integer >= 1, found {num_classes!r}")
    if not width_mult > 0:
        raise ModelError(f"width_mult for {arch} must be > 0, found {width_mult}")
    if width_mult != 1.0 and not info.supports_width_mult:
        supported = sorted(k for k, v in ARCHITECTURES.items() if v.supports_width_mult)
        raise ModelError(f"{arch} has no width multiplier (found width_mult={width_mult}); "
                         f"use width_mult: 1.0 or one of {supported}")
    if dropout is not None and not 0.0 <= dropout <= 1.0:
        raise ModelError(f"dropout for {arch} must be in [0, 1], found {dropout}")
    if small_input and info.transformer:
        raise ModelError(f"small_input changes a CNN stem's stride; {arch} is a transformer: set "
                         "small_input: false and give the input size as resolution")
    kwargs: dict[str, object] = {"weights": None, "num_classes": num_classes}
    if info.family == "vit":
        kwargs["image_size"] = transformers.vit_image_size(arch, resolution)
    if info.supports_width_mult:
        kwargs["width_mult"] = width_mult
    if dropout is not None and info.family != "resnet":
        kwargs["dropout"] = dropout
    tv = info.constructor(**kwargs)
    if info.family == "resnet":
        return _from_resnet(arch, tv, num_classes, small_input, dropout)
    if info.transformer:
        return _from_transformer(arch, info.family, tv, num_classes)
    return _from_features(arch, tv, num_classes, small_input)


def load_torchvision_state_dict(net: BlockNet, state_dict: Mapping[str, torch.Tensor], *,
                                strict_head: bool = True) -> list[str]:
    """Load a torchvision-named state_dict (e.g. a hub checkpoint) into ``net``; returns notes."""
    return apply_weights(net, net.from_torchvision_keys(state_dict), source="torchvision state_dict",
                         strict_head=strict_head)


def _check_cut(net: BlockNet, train_last_blocks: int) -> int:
    n = len(net.blocks)
    if isinstance(train_last_blocks, bool) or not isinstance(train_last_blocks, int) \
            or not 0 <= train_last_blocks <= n:
        raise ModelError(f"train_last_blocks={train_last_blocks!r} is outside the valid range 0..{n} "
                         f"for {net.arch} ({n} blocks; 0 trains only the head)")
    return n - train_last_blocks


def split_at(net: BlockNet, train_last_blocks: int) -> tuple[nn.Sequential, TopNet]:
    """(frozen bottom, trainable top), sharing modules with ``net``: training the top trains ``net``."""
    cut = _check_cut(net, train_last_blocks)
    bottom = nn.Sequential(*net.blocks[:cut])
    top = TopNet({i: net.blocks[i] for i in range(cut, len(net.blocks))}, net.head)
    return bottom, top


def blocks_between(net: BlockNet, stored: int, train_last_blocks: int) -> nn.Sequential:
    """Blocks ``[n-stored, n-train_last_blocks)``: what turns features at the cut ``stored`` into features
    at the higher cut ``train_last_blocks`` (empty when the two are equal); shares ``net``'s modules."""
    low, high = _check_cut(net, stored), _check_cut(net, train_last_blocks)
    if high < low:
        raise ModelError(f"train_last_blocks={train_last_blocks} is below the stored cut train_last_blocks="
                         f"{stored}: blocks already applied cannot be undone")
    return nn.Sequential(*net.blocks[low:high])


def feature_shape(net: BlockNet, train_last_blocks: int, input_size: int) -> tuple[int, int, int]:
    """(C, H, W) of the cut for square ``input_size`` images, from a meta-device dry run (no compute)."""
    bottom, _ = split_at(net, train_last_blocks)
    if input_size < 1:
        raise ModelError(f"input_size must be >= 1 pixel, found {input_size} (for {net.arch})")
    if net.input_size is not None and input_size != net.input_size:
        raise ModelError(f"{net.arch} was built for {net.input_size}x{net.input_size} inputs (its "
                         f"resolution), found {input_size}x{input_size} images; set the model's "
                         f"resolution: {input_size} or decode at {net.input_size}")
    x = torch.empty(1, net.in_channels, input_size, input_size, device="meta")
    tensors = {k: torch.empty_like(v, device="meta")
               for k, v in itertools.chain(bottom.named_parameters(), bottom.named_buffers())}
    was_training = [m.training for m in bottom.modules()]
    bottom.eval()  # batch-1 train-mode BatchNorm rejects 1x1 maps
    try:
        with torch.no_grad():
            try:
                out = torch.func.functional_call(bottom, tensors, (x,))
            except NotImplementedError:  # an op without a meta kernel: pay for one tiny real forward
                out = bottom(torch.zeros(1, net.in_channels, input_size, input_size,
                                         device=next(net.parameters()).device))
    except RuntimeError as exc:
        raise ModelError(f"input_size {input_size} is too small for {net.arch} cut at "
                         f"train_last_blocks={train_last_blocks}: {exc}; use a larger resolution "
                         "or small_input: true") from None
    finally:
        for m, mode in zip(bottom.modules(), was_training, strict=True):
            m.training = mode
    if out.dim() != 4:
        raise ModelError(f"{net.arch} produced a {tuple(out.shape)} output at the cut, expected (N,C,H,W)")
    c, h, w = (int(d) for d in out.shape[1:])
    return c, h, w


def token_layout(net: BlockNet, train_last_blocks: int) -> tuple[int, int, int] | None:
    """(prefix tokens, grid H, grid W) of the maps at the cut when they are transformer tokens laid out
    as (D, 1, prefix + H*W); None for plain (C, H, W) maps (and for the images, when no block is frozen)."""
    cut = _check_cut(net, train_last_blocks)
    return net.token_layout if cut > 0 else None


def final_layer(net: nn.Module) -> tuple[str, nn.Linear | nn.Conv2d]:
    """The last Linear/Conv2d of ``net.head``: the layer that maps features to class scores."""
    head = getattr(net, "head", None)
    if head is None:
        raise ModelError(f"{type(net).__name__} has no `head` module, expected a BlockNet or TopNet")
    layers = [(name, m) for name, m in head.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    if not layers:
        raise ModelError(f"the head of {getattr(net, 'arch', type(net).__name__)} has no Linear/Conv2d layer")
    name, layer = layers[-1]
    return f"head.{name}", layer


def replace_classifier(net: BlockNet, num_classes: int) -> BlockNet:
    """Swap the final layer for a fresh one with ``num_classes`` outputs (transfer to target classes)."""
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"num_classes must be an integer >= 1, found {num_classes!r}")
    name, old = final_layer(net)
    if isinstance(old, nn.Linear):
        new: nn.Module = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
    else:
        kh, kw = old.kernel_size[0], old.kernel_size[-1]
        new = nn.Conv2d(old.in_channels, num_classes, kernel_size=(kh, kw), bias=old.bias is not None)
    new.to(device=old.weight.device, dtype=old.weight.dtype)
    parent_name, _, child = name.rpartition(".")
    net.get_submodule(parent_name).register_module(child, new)
    net.num_classes = num_classes
    return net


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
