"""A backbone as a value: its architecture, its weights, and the one net built from them per run.

Building a backbone (constructing its modules and initialising their weights) is the slow
part of making one, so it happens once per value: ``ModelValue`` builds its net on first
use and hands every consumer a private copy (a frozen forward folds and freezes its bottom,
a trainer changes its top; neither may see the other's changes). Structural questions asked
before any weights exist (how many blocks, the shape at a cut) are answered by one probe net
per architecture per process (``structure``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ModelError
from ..lazy import lazy_module
from ..spec import ModelDesc, Spec
from .weights import apply_weights

if TYPE_CHECKING:
    import torch

    from . import zoo
else:
    torch = lazy_module("torch")
    zoo = lazy_module("pipeline.models.zoo")

# How many backbones this process has constructed (``ArchConfig.build``): tests check that a run
# builds each model once, not once per consumer.
BUILDS = 0


@dataclass(frozen=True)
class ArchConfig:
    """Everything that fixes a backbone's structure (not its weights)."""

    arch: str
    num_classes: int
    width_mult: float = 1.0
    small_input: bool = False
    resolution: int = 224

    @classmethod
    def of(cls, model: Spec) -> ArchConfig:
        """The architecture a MODEL spec describes."""
        desc = model.model
        return cls(desc.arch, model.num_classes, desc.width_mult, desc.small_input, desc.resolution)

    def build(self) -> zoo.BlockNet:
        """A newly constructed net with freshly initialised weights (drawn from torch's global RNG)."""
        global BUILDS
        BUILDS += 1
        return zoo.build_backbone(self.arch, self.num_classes, width_mult=self.width_mult,
                                  small_input=self.small_input, resolution=self.resolution)

    def desc(self) -> ModelDesc:
        return ModelDesc(self.arch, len(structure(self).blocks), self.width_mult, self.small_input,
                         self.resolution)

    def spec(self) -> Spec:
        return Spec.model_spec(self.desc(), self.num_classes)


@functools.lru_cache(maxsize=16)
def _seeded(config: ArchConfig, seed: int) -> tuple[zoo.BlockNet, torch.Tensor]:
    """(net constructed right after ``torch.manual_seed(seed)``, torch's CPU RNG state after that).

    Built aside (the caller's RNG is left alone); never trained or handed out, only copied.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = config.build()
        return net, torch.get_rng_state()


def structure(config: ArchConfig) -> zoo.BlockNet:
    """A net of this architecture for structural questions only (blocks, shapes): never modify it."""
    return _seeded(config, 0)[0]


def seeded_net(config: ArchConfig, seed: int) -> zoo.BlockNet:
    """What ``torch.manual_seed(seed)`` then ``config.build()`` gives, RNG state after included.

    A seeded consumer (a trainer replacing the classifier next) therefore draws exactly what it
    drew when it constructed its own net, while the construction itself happens once.
    """
    net, state = _seeded(config, seed)
    torch.set_rng_state(state)
    return copy.deepcopy(net)


@dataclass(eq=False)
class ModelValue:
    """A backbone to use: built once (lazily), copied for each consumer so none shares another's state."""

    config: ArchConfig
    state_dict: dict[str, torch.Tensor] | None
    source: str  # where the weights came from, for messages and lineage
    num_blocks: int = field(init=False)
    _net: zoo.BlockNet | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.num_blocks = len(structure(self.config).blocks)

    def _built(self) -> zoo.BlockNet:
        if self._net is None:
            net = self.config.build()
            if self.state_dict is not None:
                apply_weights(net, self.state_dict, source=self.source)
            self._net = net
        return self._net

    def build(self, *, seed: int | None = None) -> zoo.BlockNet:
        """A private copy of the built net.

        With ``seed``, torch's RNG is left as seeding it and constructing the net would leave it,
        so a seeded trainer draws the same numbers whether or not it constructed the net itself.
        """
        net = copy.deepcopy(self._built())
        if seed is not None:
            torch.set_rng_state(_seeded(self.config, seed)[1])
        return net

    @property
    def spec(self) -> Spec:
        return Spec.model_spec(
            ModelDesc(self.config.arch, self.num_blocks, self.config.width_mult, self.config.small_input,
                      self.config.resolution),
            self.config.num_classes,
        )


def check_cut(train_last_blocks: int, model: Spec) -> None:
    """A cut stated from the top must fall inside the backbone."""
    desc = model.model
    n = desc.num_blocks
    if not 0 <= train_last_blocks <= n:
        raise ModelError(
            f"train_last_blocks={train_last_blocks} is outside the valid range 0..{n} "
            f"for {desc.arch} ({n} blocks)"
        )
