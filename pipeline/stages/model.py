"""Backbones as recipe values: an architecture plus weights, identified by the weights' content."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from ..errors import MissingPathError
from ..lazy import lazy_module
from ..models.weights import apply_weights, hub_checkpoint, load_weights
from ..registry import register
from ..spec import MODEL, Spec
from ..stage import Stage

if TYPE_CHECKING:
    import torch

    from ..models import zoo
else:
    torch = lazy_module("torch")
    zoo = lazy_module("pipeline.models.zoo")


@dataclass(frozen=True)
class ArchConfig:
    arch: str
    num_classes: int
    width_mult: float = 1.0
    small_input: bool = False
    resolution: int = 224

    def build(self) -> zoo.BlockNet:
        return zoo.build_backbone(self.arch, self.num_classes, width_mult=self.width_mult,
                              small_input=self.small_input)


@dataclass
class ModelValue:
    """A backbone to instantiate: fresh modules on every ``build`` so consumers never share state."""

    config: ArchConfig
    state_dict: dict[str, torch.Tensor] | None
    source: str  # where the weights came from, for messages and lineage
    num_blocks: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_blocks = len(self.config.build().blocks)

    def build(self) -> zoo.BlockNet:
        net = self.config.build()
        if self.state_dict is not None:
            apply_weights(net, self.state_dict, source=self.source)
        return net

    @property
    def spec(self) -> Spec:
        return model_spec(self.config, self.num_blocks)


def model_spec(config: ArchConfig, num_blocks: int) -> Spec:
    return Spec(MODEL, num_classes=config.num_classes, meta={
        "arch": config.arch, "num_blocks": num_blocks, "width_mult": config.width_mult,
        "small_input": config.small_input, "resolution": config.resolution,
    })


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@register
class Backbone(Stage):
    """A torchvision backbone as a block list, with weights from a file, the hub cache, or random init.

    ``weights``: a path to a state_dict file, ``hub`` for torchvision's cached checkpoint
    (never downloaded), or omitted for random initialisation seeded by ``seed``.
    """

    type_name: ClassVar[str] = "backbone"
    kind: ClassVar[str] = MODEL

    arch: str = "mobilenet_v2"
    num_classes: int = Field(1000, ge=1)
    width_mult: float = Field(1.0, gt=0)
    small_input: bool = False
    resolution: int = Field(224, ge=8, description="native input size of the weights")
    weights: str | None = None
    seed: int = 0

    def _config(self) -> ArchConfig:
        return ArchConfig(self.arch, self.num_classes, self.width_mult, self.small_input, self.resolution)

    def _weights_path(self) -> Path | None:
        if self.weights is None:
            return None
        if self.weights == "hub":
            path = hub_checkpoint(self.arch)
            if path is None:
                raise MissingPathError(
                    f"no torchvision checkpoint for {self.arch!r} in torch's hub cache "
                    f"({torch.hub.get_dir()}/checkpoints); copy one there or set weights: PATH"
                )
            return path
        path = Path(self.weights).expanduser()
        if not path.is_file():
            raise MissingPathError(f"weights file not found: {path} (set weights: to a state_dict file)")
        return path

    def resolve(self, inputs: dict[str, Spec], ctx: Any) -> Spec:
        self._weights_path()  # fail before any work if the file is missing
        net = self._config().build()
        return model_spec(self._config(), len(net.blocks))

    def identity(self, ctx: Any) -> str | None:
        path = self._weights_path()
        return file_sha256(path) if path else None  # random init: config + seed identify it

    def run(self, ctx: Any, inputs: dict[str, Any], name: str) -> ModelValue:
        path = self._weights_path()
        if path is None:
            torch.manual_seed(self.seed)
            state = self._config().build().state_dict()
            return ModelValue(self._config(), state, f"random init (seed {self.seed})")
        state, _meta = load_weights(path)
        return ModelValue(self._config(), state, str(path))
