"""The MobileTL paper's inverted residual block, for the memory meter (``footprint(..., block="paper")``).

MobileTL (Chiang et al., AAAI 2023) describes an inverted residual block (IRB) as "one depthwise
convolution, and two pointwise convolutions", each convolution followed by a normalization layer and
the first two by an activation, and meters such blocks at expansion ratio 1 (its Table 1: input and
output (8, 96, 7, 7), 5x5 depthwise). torchvision leaves the expanding pointwise convolution out when
the expansion ratio is 1 (MobileNetV2's and MobileNetV3's ``InvertedResidual`` both skip it when the
hidden width equals the input width), so at ratio 1 its block keeps two activation maps (the expanding
conv's and its BN's inputs) and one activation fewer than the paper's. Two block conventions, so the
meter can count either:

- ``"torchvision"`` (default): the blocks as built;
- ``"paper"``: every MobileNetV2/V3 IRB without an expanding convolution gets one, a 1x1 conv from the
  input width to the (equal) hidden width, followed by copies of the depthwise layer's own normalization
  and activation. Copies, so the new layer is whatever the block's method made of its neighbour: a
  trained BN and ReLU6/Hard-Swish in a vanilla block, a shift-only BN and a sign mask in a MobileTL
  block, frozen where the block is frozen. Blocks that expand (ratio > 1) already are the paper's.

Only IRBs have that form: a network without one (a ResNet, a transformer, a plain conv stack) is
refused, naming the block conventions and the architectures the paper's block applies to.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torchvision.models import mobilenetv2, mobilenetv3
from torchvision.ops.misc import Conv2dNormActivation

BLOCKS = ("torchvision", "paper")  # how an IRB is built before it is metered; see the module doc
# torchvision's architectures built of the IRBs below (the models layer cannot import the MobileTL
# method's own list, pipeline.methods.mobiletl.SUPPORTED_ARCHS, which names the same three)
IRB_ARCHS = ("mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large")
_IRB_TYPES = (mobilenetv2.InvertedResidual, mobilenetv3.InvertedResidual)


def check_block(block: str, arch: str | None = None) -> None:
    """Raise a ValueError naming the valid choices unless ``block`` is a block convention (and, with
    ``arch``, one that applies to that architecture)."""
    if block not in BLOCKS:
        raise ValueError(f"unknown block convention {block!r}; expected one of {', '.join(BLOCKS)}")
    if block == "paper" and arch is not None and arch not in IRB_ARCHS:
        raise ValueError(_not_applicable(arch))


def _not_applicable(what: str) -> str:
    return (f"the paper's block (block 'paper') is an inverted residual block; {what} has none. "
            f"It applies to {', '.join(IRB_ARCHS)}; block conventions: {', '.join(BLOCKS)}")


def _branch(block: nn.Module) -> nn.Sequential:
    """The conv path of an IRB: ``conv`` (V2) or ``block`` (V3)."""
    return block.conv if isinstance(block, mobilenetv2.InvertedResidual) else block.block  # type: ignore[return-value]


def to_paper_block(block: nn.Module) -> bool:
    """Give one IRB the paper's expanding 1x1 conv if it has none, in place; True if it was added."""
    if not isinstance(block, _IRB_TYPES):
        raise ValueError(f"{type(block).__name__} is not a MobileNetV2/V3 inverted residual block")
    branch = _branch(block)
    first = branch[0]
    conv = first[0] if isinstance(first, nn.Sequential) else None
    if not isinstance(first, nn.Sequential) or not isinstance(conv, nn.Conv2d) or conv.groups == 1:
        return False  # it opens with a dense (expanding) conv already: the paper's form
    # The block opens with its depthwise layer (conv, norm, activation), whose width is the hidden
    # width, equal to the input width at ratio 1: the expanding conv maps input to hidden width, and
    # copies of the depthwise layer's norm and activation fit it as they are.
    norm, act = first[1], first[2]
    width = conv.in_channels
    with torch.random.fork_rng(devices=[]):  # new weights leave the caller's random stream as it was
        # the conv's own class (a method's lean frozen conv stays one), its weight training as the
        # depthwise conv's does
        expand_conv = type(conv)(width, width, 1, bias=False)
        expand = Conv2dNormActivation(width, width, kernel_size=1, norm_layer=lambda _c: copy.deepcopy(norm),
                                      activation_layer=lambda: copy.deepcopy(act), inplace=None)
    expand_conv.to(conv.weight.device, conv.weight.dtype).weight.requires_grad_(conv.weight.requires_grad)
    expand[0] = expand_conv
    expand.train(first.training)
    new = nn.Sequential(expand, *branch)
    if isinstance(block, mobilenetv2.InvertedResidual):
        block.conv = new
    else:
        block.block = new
    return True


def to_paper_blocks(model: nn.Module) -> int:
    """Convert every IRB of ``model`` to the paper's block, in place; the number given an expanding conv.

    A ValueError if ``model`` holds no IRB: the paper's block does not apply to it.
    """
    irbs = [m for m in model.modules() if isinstance(m, _IRB_TYPES)]
    if not irbs:
        name = getattr(model, "arch", None) or type(model).__name__
        raise ValueError(_not_applicable(str(name)))
    return sum(to_paper_block(b) for b in irbs)
