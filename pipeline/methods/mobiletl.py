"""MobileTL: memory-efficient training of inverted residual blocks (Chiang et al., AAAI 2023).

An inverted residual block (IRB: expand 1x1 conv, BN, act; depthwise conv, BN, act; [SE];
project 1x1 conv, BN) stores, for vanilla backward, the input of every BN and a float
copy around every Hard-Swish. MobileTL removes most of that (Sec. 3):

- the intermediate BNs (after the expansion and the depthwise conv) train only their
  shift beta; scale and running statistics stay frozen, so their backward keeps no
  activation (``ShiftBatchNorm2d``, Eq. 5-6);
- the block's last BN trains scale and shift and updates its statistics, so the block
  can still re-normalize its output for the new task (Sec. 3.1);
- ReLU6 and Hard-Swish backward use the sign function's mask ``1[x >= 0]`` kept at
  1 bit per element (``SignReLU6``, ``SignHardswish``, Eq. 8);
- convolutions (and SE layers) train as usual; the bottom of the network stays frozen
  and only the last N blocks are fine-tuned.

Variants of the paper's ablation (Table 5): ``proj-bn`` (the method above, default),
``all-bn-shift`` (the last BN trains only its shift too) and ``all-bn`` (every BN trains
fully; only the activation approximation is applied). Blocks of the top that are not
IRBs (MobileNet's final 1x1 conv block) train as usual.
"""

from __future__ import annotations

from torch import nn
from torchvision.models import mobilenetv2, mobilenetv3
from torchvision.ops import SqueezeExcitation

from ..errors import ModelError
from .layers import PackedReLU, SignHardswish, SignReLU6, convert, shift_batchnorm
from .variants import VARIANTS, Variant

#: Architectures whose blocks are inverted residual blocks MobileTL applies to.
SUPPORTED_ARCHS: tuple[str, ...] = ("mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large")
IRB_TYPES = (mobilenetv2.InvertedResidual, mobilenetv3.InvertedResidual)


def is_irb(module: nn.Module) -> bool:
    """True for torchvision's MobileNetV2 and MobileNetV3 inverted residual blocks."""
    return isinstance(module, IRB_TYPES)


def main_branch(block: nn.Module) -> nn.Module:
    """The conv path of an IRB (without the residual add): ``conv`` (V2) or ``block`` (V3)."""
    if isinstance(block, mobilenetv2.InvertedResidual):
        return block.conv
    if isinstance(block, mobilenetv3.InvertedResidual):
        return block.block
    raise ModelError(f"{type(block).__name__} is not an inverted residual block of MobileNetV2/V3")


def _outside_se(branch: nn.Module) -> list[tuple[str, nn.Module]]:
    """Named descendants of ``branch`` that are not inside a squeeze-and-excitation layer."""
    se = [name for name, m in branch.named_modules() if isinstance(m, SqueezeExcitation)]
    return [(name, m) for name, m in branch.named_modules()
            if name and not any(name == s or name.startswith(s + ".") for s in se)]


def mobiletl_block(block: nn.Module, variant: Variant = "proj-bn") -> dict[str, int]:
    """Make one IRB train the MobileTL way, in place; returns counts of what changed.

    Every parameter of the block trains except the frozen scales of shift-only BNs.
    """
    if variant not in VARIANTS:
        raise ModelError(f"unknown MobileTL variant {variant!r}; expected one of {list(VARIANTS)}")
    branch = main_branch(block)
    for p in block.parameters():
        p.requires_grad_(True)
    members = _outside_se(branch)
    bns = [name for name, m in members if isinstance(m, nn.BatchNorm2d)]
    if variant == "proj-bn":
        shift_only = bns[:-1]
    elif variant == "all-bn-shift":
        shift_only = bns
    else:
        shift_only = []
    counts = {"shift_bn": 0, "full_bn": len(bns) - len(shift_only), "sign_act": 0, "packed_relu": 0}
    swaps: dict[str, nn.Module] = {}
    for name, m in members:
        if name in shift_only:
            swaps[name] = shift_batchnorm(m, train_shift=True)  # type: ignore[arg-type]
            counts["shift_bn"] += 1
        elif type(m) is nn.ReLU6:
            swaps[name] = convert(m, SignReLU6)
            counts["sign_act"] += 1
        elif type(m) is nn.Hardswish:
            swaps[name] = convert(m, SignHardswish)
            counts["sign_act"] += 1
        elif type(m) is nn.ReLU:
            swaps[name] = convert(m, PackedReLU)  # ReLU's own derivative is already a 1-bit mask
            counts["packed_relu"] += 1
    for name, new in swaps.items():
        parent_name, _, child = name.rpartition(".")
        parent = branch.get_submodule(parent_name) if parent_name else branch
        parent.register_module(child, new)
    return counts


def check_mobiletl_top(arch: str, blocks: list[nn.Module], train_last_blocks: int) -> list[int]:
    """Indices (in the full net) of the IRBs among the last ``train_last_blocks`` blocks, or a ModelError."""
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"MobileTL applies to inverted residual blocks; {arch} has none. "
                         f"Supported models: {', '.join(SUPPORTED_ARCHS)}")
    n = len(blocks)
    if isinstance(train_last_blocks, bool) or not 0 <= train_last_blocks <= n:
        raise ModelError(f"train_last_blocks={train_last_blocks!r} is outside the valid range 0..{n} "
                         f"for {arch} ({n} blocks)")
    irbs = [i for i in range(n - train_last_blocks, n) if is_irb(blocks[i])]
    if not irbs:
        last = max(i for i, b in enumerate(blocks) if is_irb(b))
        raise ModelError(f"MobileTL: the last {train_last_blocks} blocks of {arch} hold no inverted residual "
                         f"block (the last IRB is block {last}); use train_last_blocks in {n - last}..{n}")
    return irbs


def apply_mobiletl(arch: str, blocks: list[nn.Module], train_last_blocks: int,
                   variant: Variant = "proj-bn") -> dict[str, int]:
    """Apply MobileTL to every IRB among the last ``train_last_blocks`` of ``blocks`` (in place)."""
    totals = {"irbs": 0, "shift_bn": 0, "full_bn": 0, "sign_act": 0, "packed_relu": 0}
    for i in check_mobiletl_top(arch, blocks, train_last_blocks):
        counts = mobiletl_block(blocks[i], variant)
        totals["irbs"] += 1
        for k, v in counts.items():
            totals[k] += v
    return totals
