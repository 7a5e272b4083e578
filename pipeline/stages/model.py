"""Backbones as recipe values: an architecture plus weights, identified by the weights' content."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from ..errors import MissingPathError
from ..lazy import lazy_module
from ..models.arch import ArchConfig, ModelValue, seeded_net
from ..models.weights import file_sha256, hub_checkpoint, load_weights, missing_weights_message
from ..spec import MODEL, Spec
from ..stage import Stage, StageCall, StageInputs

if TYPE_CHECKING:
    import torch

    from ..context import RunContext
else:
    torch = lazy_module("torch")


# ``weights: random``: random initialisation, chosen on purpose (no warning).
RANDOM_WEIGHTS = "random"


class Backbone(Stage):
    """A torchvision backbone as a block list, with weights from a file, the hub cache, or random init.

    ``weights``: a path to a state_dict file, ``hub`` for torchvision's cached checkpoint
    (never downloaded), or ``random`` for random initialisation seeded by ``seed``. Omitted is
    random too, but a run warns about it (:meth:`random_init_warning`): transfer from a random
    backbone sits near chance, which a first-time user takes for a bug.
    """

    type_name: ClassVar[str] = "backbone"
    kind: ClassVar[str] = MODEL

    arch: str = "mobilenet_v2"
    num_classes: int = Field(1000, ge=1)
    width_mult: float = Field(1.0, gt=0)
    small_input: bool = False
    resolution: int = Field(224, ge=8, description="native input size of the weights")
    weights: str | None = Field(
        None,
        description="state_dict file, hub (torchvision's cached checkpoint) or random; omitted: random, "
        "with a warning",
    )
    seed: int = 0

    def _config(self) -> ArchConfig:
        return ArchConfig(self.arch, self.num_classes, self.width_mult, self.small_input, self.resolution)

    def random_init_warning(self, name: str) -> str | None:
        """The warning for a backbone left random without saying so (None: weights given, or
        ``weights: random`` written, so the user knows)."""
        if self.weights is not None:
            return None
        return (
            f"warning: stages.{name} ({self.arch} backbone) has no weights: it starts from random "
            "initialisation, and transfer from a random backbone learns little beyond chance. Give it "
            "weights (weights: PATH to a torchvision state_dict, or weights: hub) or train one with a "
            f"`pretrain` stage (as recipes/quickstart.yaml does); write `weights: {RANDOM_WEIGHTS}` in "
            f"stages.{name} to silence this if random is what you mean"
        )

    def _weights_path(self) -> Path | None:
        if self.weights is None or self.weights == RANDOM_WEIGHTS:
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
            raise MissingPathError(missing_weights_message(path, RANDOM_WEIGHTS))
        return path

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        self._weights_path()  # fail before any work if the file is missing
        return self._config().spec()

    def fingerprint_config(self) -> dict[str, Any]:
        """Where the weights are read from is not identity, their bytes are (``identity``): a weights
        file copied elsewhere keeps its fingerprint. The seed only matters to a random init."""
        config = super().fingerprint_config()
        if self.weights == RANDOM_WEIGHTS:  # said explicitly or left out: the same random init
            config.pop("weights", None)
        elif self.weights is not None:
            config.pop("weights", None)
            config.pop("seed", None)
        return config

    def identity(self, ctx: RunContext) -> str | None:
        path = self._weights_path()
        # Random init: config + seed identify it; a file (or hub checkpoint): its content.
        return file_sha256(path) if path else None

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> ModelValue:
        path = self._weights_path()
        if path is None:
            state = seeded_net(self._config(), self.seed).state_dict()
            return ModelValue(self._config(), state, f"random init (seed {self.seed})")
        state, _meta = load_weights(path)
        return ModelValue(self._config(), state, str(path))
