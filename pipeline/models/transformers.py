"""Vision transformers (torchvision's Swin-T and ViT-B/16) as block lists of channels-first token maps.

A cut caches one tensor per sample, and the codec, the store, feature augmentation and the
trainers all take it as a (C, H, W) map with channels first. So every block of these nets takes
and returns that layout, and converts to the layout torchvision's own modules expect (tokens
last-dimension channels) inside, around the unchanged torchvision module:

- Swin: a token map (N, C, H, W); its blocks run channels-last (N, H, W, C) as torchvision's do.
  Each SwinTransformerBlock is a block; a stage's PatchMerging sits at the start of the next
  stage's first block (as a ResNet stage's first block downsamples), so a cut between stages
  caches the map before merging: a grid twice as wide for feature augmentation to move, at twice
  the bytes of the merged map.
- ViT: tokens (N, D, 1, 1 + H*W), the class token first, then the patch grid row by row. The grid
  and the class token travel in the cut's ``token_layout`` (prefix 1, H, W), which is what feature
  augmentation moves (the grid) and leaves alone (the class token). Channels stay axis 0, so the
  per-channel quantile codec quantizes each token channel D over all tokens, class token included.

Weights never download (``weights=None``); torchvision checkpoints load after the key renames each
builder returns.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torchvision.ops.misc import Permute

from ..errors import ModelError

TO_CHANNELS_LAST = [0, 2, 3, 1]
TO_CHANNELS_FIRST = [0, 3, 1, 2]


class ChannelsLast(nn.Sequential):
    """Torchvision modules that work on (N, H, W, C) maps, taking and giving (N, C, H, W) maps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(*TO_CHANNELS_LAST)).permute(*TO_CHANNELS_FIRST)


class TokenSequence(nn.Sequential):
    """Torchvision modules that work on token sequences (N, T, D), taking and giving (N, D, 1, T) maps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(2).transpose(1, 2)).transpose(1, 2).unsqueeze(2)


class ViTEmbedding(nn.Module):
    """ViT's input side, as torchvision's VisionTransformer computes it before its encoder layers:
    patch projection, class token prepended, position embedding added, dropout; out (N, D, 1, 1 + H*W)."""

    def __init__(self, conv_proj: nn.Conv2d, class_token: nn.Parameter, pos_embedding: nn.Parameter,
                 dropout: nn.Module, image_size: int) -> None:
        super().__init__()
        self.conv_proj = conv_proj
        self.class_token = class_token
        self.pos_embedding = pos_embedding
        self.dropout = dropout
        self.image_size = image_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if (h, w) != (self.image_size, self.image_size):
            raise ModelError(f"this ViT was built for {self.image_size}x{self.image_size} inputs, found "
                             f"{h}x{w}; set the model's resolution to the images' size")
        x = self.conv_proj(x).flatten(2).transpose(1, 2)  # (N, H*W, D), patches row by row
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding).transpose(1, 2).unsqueeze(2)


class ClassToken(nn.Module):
    """The class token (the first one) of (N, D, 1, T) token maps: (N, D)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, 0, 0]


Built = tuple[list[nn.Module], nn.Module, dict[str, str]]  # blocks, head, torchvision key prefixes


def swin_blocks(tv: Any) -> Built:
    """Swin-T's features as blocks: the patch embedding, then one block per SwinTransformerBlock."""
    embed = nn.Sequential(OrderedDict([("embed", tv.features[0]), ("to_maps", Permute(TO_CHANNELS_FIRST))]))
    blocks: list[nn.Module] = [embed]
    prefixes = {"features.0.": "blocks.0.embed.", "norm.": "head.norm.", "head.": "head.classifier."}
    merge: tuple[str, nn.Module] | None = None
    for i, stage in enumerate(tv.features):
        if i == 0:
            continue
        if not isinstance(stage, nn.Sequential):  # a PatchMerging: the next block starts with it
            merge = (f"features.{i}.", stage)
            continue
        for j, block in enumerate(stage):
            parts: list[tuple[str, nn.Module]] = []
            if merge is not None:
                prefixes[merge[0]] = f"blocks.{len(blocks)}.merge."
                parts.append(("merge", merge[1]))
                merge = None
            prefixes[f"features.{i}.{j}."] = f"blocks.{len(blocks)}.block."
            parts.append(("block", block))
            blocks.append(ChannelsLast(OrderedDict(parts)))
    head = nn.Sequential(OrderedDict([
        ("to_tokens", Permute(TO_CHANNELS_LAST)), ("norm", tv.norm), ("permute", tv.permute),
        ("pool", tv.avgpool), ("flatten", tv.flatten), ("classifier", tv.head),
    ]))
    return blocks, head, prefixes


def vit_blocks(tv: Any) -> Built:
    """ViT's embedding as block 0, each encoder layer a block; head: class token, final norm, classifier."""
    encoder = tv.encoder
    embed = ViTEmbedding(tv.conv_proj, tv.class_token, encoder.pos_embedding, encoder.dropout, tv.image_size)
    blocks: list[nn.Module] = [embed]
    prefixes = {"conv_proj.": "blocks.0.conv_proj.", "class_token": "blocks.0.class_token",
                "encoder.pos_embedding": "blocks.0.pos_embedding", "encoder.ln.": "head.norm.",
                "heads.head.": "head.classifier."}
    for name, layer in encoder.layers.named_children():
        prefixes[f"encoder.layers.{name}."] = f"blocks.{len(blocks)}.block."
        blocks.append(TokenSequence(OrderedDict([("block", layer)])))
    # The norm is per token, so picking the class token first gives what torchvision's
    # norm-then-pick gives, for 1/T of the work.
    head = nn.Sequential(OrderedDict([("token", ClassToken()), ("norm", encoder.ln),
                                      ("classifier", tv.heads.head)]))
    return blocks, head, prefixes


def vit_image_size(arch: str, resolution: int, patch: int = 16) -> int:
    """ViT's fixed input size: the recipe's resolution, which must be whole patches."""
    if resolution < patch or resolution % patch:
        nearest = max(patch, resolution // patch * patch)
        raise ModelError(f"{arch} takes inputs of whole {patch}x{patch} patches: resolution must be a "
                         f"multiple of {patch}, found {resolution} (e.g. {nearest})")
    return resolution
