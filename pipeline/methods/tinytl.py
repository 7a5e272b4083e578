"""TinyTL: frozen weights, trainable biases and lite residual modules (Cai et al., NeurIPS 2020).

Training memory is dominated by activations, and activations are needed to update
*weights*, not biases (Sec. 2, Eq. 1-2: ``dL/dW_i`` needs the layer's input, ``dL/db_i`` and
``dL/dx_i`` do not). TinyTL therefore freezes every weight and trains:

- TinyTL-B: the biases (BN shifts, conv and classifier biases) and the classifier;
- TinyTL-L: lite residual modules beside each inverted residual block, which learn a
  correction on a *downsampled* copy of the block input (2x2 average pool, group conv with
  2 groups and kernel 5 — shrunk to fit small maps —, group norm, ReLU, 1x1 projection,
  group norm, bilinear upsample to the block's output; Sec. 3.2, Fig. 3). Their activations
  are a quarter of the block's resolution and their width is the block's input width, so
  they cost a few percent of the memory vanilla fine-tuning needs;
- TinyTL-L+B: both.

The lite module's final norm has its scale initialised to zero, so the network computes
exactly the pretrained function at step 0. Optionally BN is replaced by group norm
(TinyTL's setting for batch size 8: batch statistics of 8 images are noisy), copying
scale and shift. Frozen layers are swapped for ``pipeline.methods.layers``' lean ones so
the memory the paper counts is the memory PyTorch actually keeps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from .layers import PackedReLU
from .mobiletl import SUPPORTED_ARCHS, is_irb, main_branch


def gn_groups(channels: int, per_group: int = 8) -> int:
    """Groups for a GroupNorm over ``channels``: ``channels // min(channels, per_group)`` as in TinyTL,
    lowered to the nearest divisor of ``channels`` so odd widths still work."""
    g = max(1, channels // min(channels, per_group))
    while channels % g:
        g -= 1
    return g


def lite_kernel(resolution: int, downsample: int, kernel: int) -> tuple[int, int | None]:
    """(kernel, downsample) for a lite module on a ``resolution``-pixel input (TinyTL's rule).

    The pooled map is ``max(1, resolution // downsample)`` pixels; the kernel shrinks by 2
    until it fits, and a 1-pixel map uses global pooling (downsample ``None``) with a 1x1 kernel.
    """
    pooled = max(1, resolution // downsample)
    if pooled == 1:
        return 1, None
    while pooled < kernel and kernel > 1:
        kernel -= 2
    return max(kernel, 1), downsample


class MeanPool2d(nn.Module):
    """Average pooling by ``factor`` (floor, like ``AvgPool2d(factor, factor)``), or global for ``None``.

    Written as reshape + mean because ``AvgPool2d``/``AdaptiveAvgPool2d`` keep their (full-resolution)
    input for backward although the gradient only needs its shape; the lite branch reads the block
    input, which TinyTL otherwise never stores.
    """

    def __init__(self, factor: int | None) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.factor is None:
            return x.mean((2, 3), keepdim=True)
        f = self.factor
        if f == 1:
            return x
        n, c, h, w = x.shape
        h2, w2 = h // f, w // f
        return x[:, :, :h2 * f, :w2 * f].reshape(n, c, h2, f, w2, f).mean((3, 5))

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


class LiteResidual(nn.Module):
    """The lite residual branch: pool, group conv, GN, ReLU, 1x1 conv, GN (scale 0), bilinear upsample."""

    def __init__(self, in_channels: int, out_channels: int, *, kernel: int = 5, stride: int = 1,
                 groups: int = 2, downsample: int | None = 2, expand: float = 1.0,
                 gn_channels_per_group: int = 8) -> None:
        super().__init__()
        mid = max(1, int(round(in_channels * expand)))
        g = math.gcd(math.gcd(groups, in_channels), mid)
        self.pool = MeanPool2d(downsample)
        self.conv1 = nn.Conv2d(in_channels, mid, kernel, stride, kernel // 2, groups=g, bias=False)
        self.norm1 = nn.GroupNorm(gn_groups(mid, gn_channels_per_group), mid)
        self.act = PackedReLU()
        self.conv2 = nn.Conv2d(mid, out_channels, 1, bias=False)
        self.final_norm = nn.GroupNorm(gn_groups(out_channels, gn_channels_per_group), out_channels)
        nn.init.kaiming_normal_(self.conv1.weight, mode="fan_out")
        nn.init.kaiming_normal_(self.conv2.weight, mode="fan_out")
        nn.init.zeros_(self.final_norm.weight)  # exact identity at step 0
        nn.init.zeros_(self.final_norm.bias)

    def forward(self, x: torch.Tensor, size: Iterable[int]) -> torch.Tensor:
        y = self.final_norm(self.conv2(self.act(self.norm1(self.conv1(self.pool(x))))))
        size = tuple(size)
        if tuple(y.shape[-2:]) != size:
            y = F.interpolate(y, size=size, mode="bilinear", align_corners=False)
        return y


class BranchWithLiteResidual(nn.Module):
    """An IRB's main branch plus a lite residual on the same input: ``main(x) + lite(x)``.

    The main branch's layers keep their names (``conv.0.0.weight`` stays
    ``conv.0.0.weight``), so pretrained weights still load; the lite module adds
    ``lite_residual.*`` keys. The block's own shortcut is added after, as before.
    """

    def __init__(self, main: nn.Module, lite: LiteResidual) -> None:
        super().__init__()
        self._main_names = [name for name, _ in main.named_children()]
        for name, child in main.named_children():
            self.add_module(name, child)
        self.lite_residual = lite

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for name in self._main_names:
            y = self._modules[name](y)  # type: ignore[misc]
        return y + self.lite_residual(x, y.shape[-2:])


def _irb_geometry(block: nn.Module) -> tuple[int, int, int]:
    """(in_channels, out_channels, stride) of an IRB from its convolutions."""
    convs = [m for m in main_branch(block).modules() if isinstance(m, nn.Conv2d)]
    stride = max(int(c.stride[0]) for c in convs)
    return convs[0].in_channels, convs[-1].out_channels, stride


def block_input_sizes(blocks: list[nn.Module], input_shape: tuple[int, int, int]) -> list[int]:
    """Spatial size (height) at the input of each block for one ``input_shape`` (C, H, W) sample."""
    sizes: list[int] = []
    modes = [m.training for b in blocks for m in b.modules()]
    x = torch.zeros(1, *input_shape)
    try:
        for b in blocks:
            b.eval()
        with torch.no_grad():
            for b in blocks:
                sizes.append(int(x.shape[-2]))
                x = b(x)
    finally:
        for m, mode in zip([m for b in blocks for m in b.modules()], modes, strict=True):
            m.training = mode
    return sizes


def add_lite_residuals(arch: str, blocks: list[nn.Module], input_shape: tuple[int, int, int], *,
                       kernel: int = 5, groups: int = 2, downsample: int = 2, expand: float = 1.0,
                       gn_channels_per_group: int = 8) -> list[dict[str, int | None]]:
    """Put a lite residual beside every IRB in ``blocks`` (in place); returns each module's geometry.

    ``input_shape`` is (C, H, W) at the input of ``blocks[0]``; it fixes every block's map size,
    from which the kernel is shrunk as in TinyTL (a 2x2 map gets a 1x1 kernel, never a crash).
    """
    irbs = [i for i, b in enumerate(blocks) if is_irb(b)]
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"TinyTL lite residual modules go beside inverted residual blocks; {arch} has none. "
                         f"Supported models: {', '.join(SUPPORTED_ARCHS)} (mode: bias works for any model)")
    if not irbs:
        raise ModelError(f"TinyTL lite residual: the trained blocks of {arch} hold no inverted residual "
                         "block; train more blocks or use mode: bias")
    device = next(blocks[0].parameters()).device
    sizes = block_input_sizes(blocks, input_shape)
    added = []
    for i in irbs:
        block = blocks[i]
        cin, cout, stride = _irb_geometry(block)
        k, ds = lite_kernel(sizes[i], downsample, kernel)
        lite = LiteResidual(cin, cout, kernel=k, stride=stride, groups=groups, downsample=ds, expand=expand,
                            gn_channels_per_group=gn_channels_per_group).to(device)
        attr = "conv" if hasattr(block, "conv") and block.conv is main_branch(block) else "block"
        setattr(block, attr, BranchWithLiteResidual(main_branch(block), lite))
        added.append({"block": i, "input_size": sizes[i], "kernel": k, "downsample": ds, "in": cin,
                      "out": cout})
    return added


def replace_bn_with_gn(root: nn.Module, channels_per_group: int = 8) -> int:
    """Swap every BatchNorm2d under ``root`` for a GroupNorm with the same scale and shift (TinyTL's code)."""
    count = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.BatchNorm2d):
                c = child.num_features
                gn = nn.GroupNorm(gn_groups(c, channels_per_group), c, eps=child.eps, affine=True)
                gn.to(device=child.running_mean.device if child.running_mean is not None else "cpu")
                if child.affine:
                    with torch.no_grad():
                        gn.weight.copy_(child.weight)
                        gn.bias.copy_(child.bias)
                parent.register_module(name, gn)
                count += 1
    return count


def train_biases(root: nn.Module) -> int:
    """Mark every bias under ``root`` trainable (TinyTL-B); returns the number of bias elements."""
    n = 0
    for name, p in root.named_parameters():
        if name.rsplit(".", 1)[-1] == "bias":
            p.requires_grad_(True)
            n += p.numel()
    return n
