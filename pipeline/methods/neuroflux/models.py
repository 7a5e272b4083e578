"""CNNs for 32x32 inputs as flat lists of *layers*, the unit NeuroFlux trains locally.

Local learning needs a network cut into layers that each get their own auxiliary
classifier; these are the layers of the NeuroFlux paper's models, trained from scratch:

- VGG-11/16/19 (torchvision's configurations "A", "D", "E", batch norm): one layer per
  conv-BN-ReLU, with a following max-pool folded into the layer that precedes it, so a
  layer's output (what gets spilled) is already downsampled;
- ResNet-18 for CIFAR-sized inputs: a 3x3 stem, then torchvision's own ``BasicBlock`` s,
  one layer each (a residual block is the smallest unit a local loss can cut at).

``width_mult`` scales every width (channels rounded, at least 4), which is how the
benchmarks scale the paper's GPU-sized models down to a 2-core CPU. ``classifier`` is the
end-to-end model's head (global pool + linear) that backpropagation trains; local learning
trains an auxiliary head per layer instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torchvision.models.resnet as tv_resnet
import torchvision.models.vgg as tv_vgg
from torch import nn

from ...errors import ModelError, did_you_mean
from .archs import ARCHS, RESNET_STAGES, VGG_CONFIGS


@dataclass(frozen=True)
class LayerInfo:
    """What the auxiliary-net rule and the partitioner need to know about one layer."""

    index: int
    name: str
    in_shape: tuple[int, int, int]  # (C, H, W) of one sample
    out_shape: tuple[int, int, int]
    width: int  # output channels of the layer's convolutions
    before_downsampling: bool  # its convolutions run at full input resolution


class LayerNet(nn.Module):
    """``classifier(layers[-1](...layers[0](x)))``: the end-to-end model."""

    def __init__(
        self,
        arch: str,
        layers: list[nn.Module],
        classifier: nn.Module,
        widths: list[int],
        in_shape: tuple[int, int, int],
    ) -> None:
        super().__init__()
        self.arch = arch
        self.layers = nn.ModuleList(layers)
        self.classifier = classifier
        self.widths = widths
        self.in_shape = in_shape
        self.info = self._describe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.classifier(x)

    def _describe(self) -> list[LayerInfo]:
        rows: list[tuple[tuple[int, int, int], tuple[int, int, int], int]] = []
        was_training = self.training
        self.eval()
        with torch.no_grad():
            x = torch.zeros(1, *self.in_shape)
            for layer in self.layers:
                # The resolution a layer works at is its first convolution's output: a VGG layer
                # pools at its end (works at full resolution), a strided ResNet block at its start.
                first_conv = next(m for m in layer.modules() if isinstance(m, nn.Conv2d))
                seen: list[int] = []
                handle = first_conv.register_forward_hook(
                    lambda _m, _i, out, seen=seen: seen.append(out.shape[-1])
                )
                y = layer(x)
                handle.remove()
                (ci, hi, wi), (co, ho, wo) = x.shape[1:], y.shape[1:]
                rows.append(((int(ci), int(hi), int(wi)), (int(co), int(ho), int(wo)), seen[0]))
                x = y
        self.train(was_training)
        full = self.in_shape[-1]
        return [
            LayerInfo(i, f"layers.{i}", in_s, out_s, self.widths[i], working == full)
            for i, (in_s, out_s, working) in enumerate(rows)
        ]


def _scaled(width: int, mult: float) -> int:
    return max(4, int(round(width * mult)))


def _vgg(
    arch: str, num_classes: int, width_mult: float, in_channels: int
) -> tuple[list[nn.Module], list[int], int]:
    cfg = tv_vgg.cfgs[VGG_CONFIGS[arch]]
    layers: list[nn.Module] = []
    widths: list[int] = []
    channels = in_channels
    for item in cfg:
        if item == "M":
            # Fold the pool into the layer before it: it downsamples that layer's output.
            last = layers[-1]
            assert isinstance(last, nn.Sequential)
            last.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        width = _scaled(int(item), width_mult)
        layers.append(
            nn.Sequential(
                nn.Conv2d(channels, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
            )
        )
        widths.append(width)
        channels = width
    return layers, widths, channels


def _resnet(
    arch: str, num_classes: int, width_mult: float, in_channels: int
) -> tuple[list[nn.Module], list[int], int]:
    base = _scaled(64, width_mult)
    layers: list[nn.Module] = [
        nn.Sequential(
            nn.Conv2d(in_channels, base, 3, padding=1, bias=False),
            nn.BatchNorm2d(base),
            nn.ReLU(inplace=True),
        )
    ]
    widths = [base]
    channels = base
    for stage, blocks in enumerate(RESNET_STAGES[arch]):
        width = _scaled(64 * 2**stage, width_mult)
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            downsample = None
            if stride != 1 or channels != width:
                downsample = nn.Sequential(
                    nn.Conv2d(channels, width, 1, stride=stride, bias=False), nn.BatchNorm2d(width)
                )
            layers.append(tv_resnet.BasicBlock(channels, width, stride, downsample))
            widths.append(width)
            channels = width
    return layers, widths, channels


def build_layer_net(
    arch: str,
    num_classes: int,
    *,
    width_mult: float = 1.0,
    in_channels: int = 3,
    resolution: int = 32,
    seed: int | None = None,
) -> LayerNet:
    """A freshly initialised ``arch`` (from scratch, as in the paper); ``seed`` makes it reproducible."""
    if arch not in ARCHS:
        raise ModelError(
            f"unknown NeuroFlux architecture {arch!r}; expected one of {list(ARCHS)}"
            + did_you_mean(arch, ARCHS)
        )
    if width_mult <= 0:
        raise ModelError(f"width_mult must be > 0, got {width_mult}")
    if resolution < 32 and arch in VGG_CONFIGS:
        raise ModelError(f"{arch} downsamples 5 times and needs inputs of at least 32x32, got {resolution}")
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        build = _vgg if arch in VGG_CONFIGS else _resnet
        layers, widths, channels = build(arch, num_classes, width_mult, in_channels)
        classifier = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))
        return LayerNet(arch, layers, classifier, widths, (in_channels, resolution, resolution))
