"""Fold the batch norms of a frozen network into the convolutions before them.

In eval mode a BatchNorm2d is a fixed per-channel affine map, so a convolution followed by
one is a single convolution with scaled weights and a bias: one pass over the activations
instead of two. A frozen bottom (the cache build's frozen forward, the single-stage
baseline's bottom) never trains its batch norms, so it can always run folded: faster, with
outputs equal to the unfolded ones up to rounding (the folded weights round differently);
benchmarks/ has the measurements.

Pairs are folded only inside ``nn.Sequential`` containers, where the order of the children is
the order of computation; elsewhere (a ResNet BasicBlock's ``conv1``/``bn1`` attributes) the
forward method could use them in any order, so they are left as they are.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from ..lazy import lazy_module

if TYPE_CHECKING:
    from torch import nn
else:
    nn = lazy_module("torch.nn")


def _pairs(module: nn.Module) -> list[tuple[nn.Sequential, int]]:
    """(container, index of the conv) of every Conv2d directly followed by a BatchNorm2d in a Sequential."""
    found = []
    for container in module.modules():
        if isinstance(container, nn.Sequential):
            children = list(container)
            for i in range(len(children) - 1):
                conv, norm = children[i], children[i + 1]
                if (type(conv) is nn.Conv2d and type(norm) is nn.BatchNorm2d and norm.track_running_stats
                        and norm.num_features == conv.out_channels):
                    found.append((container, i))
    return found


def fold_batch_norms(module: nn.Module) -> nn.Module:
    """``module`` in eval mode with each Conv2d -> BatchNorm2d pair of a Sequential folded into one Conv2d.

    ``module`` must be frozen (no parameter requiring a gradient): training would change the
    statistics the folded weights were made from. It is not modified: the result is a folded
    copy, or ``module`` itself (in eval mode) when it has nothing to fold.
    """
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    if trainable:
        raise ValueError(f"cannot fold the batch norms of a module that trains ({trainable[0]} requires "
                         "grad); folding is for frozen parts only")
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    module.eval()
    if not _pairs(module):
        return module
    folded = copy.deepcopy(module)
    for container, i in _pairs(folded):
        conv, norm = container[i], container[i + 1]
        assert isinstance(conv, nn.Conv2d) and isinstance(norm, nn.BatchNorm2d)  # as _pairs found them
        container[i] = fuse_conv_bn_eval(conv, norm)
        container[i + 1] = nn.Identity()
    for p in folded.parameters():
        p.requires_grad_(False)
    return folded.eval()
