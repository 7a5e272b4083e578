"""What a run needs besides the recipe: where to store, where to write, how loudly.

No global state: seeds, device, store and thread counts come from here, and here
they come from the recipe or the CLI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from stores.catalog import Catalog

from .device import resolve_device
from .progress import Progress

if TYPE_CHECKING:
    from .spec import Spec


class CacheExecutor(Protocol):
    """Builds a cache entry outside this process (the recipe's ``executor``), chosen by the caller.

    Stages see only this protocol, so no stage imports an executor. An executor is made for one
    recipe (``pipeline.executors.executor_for``) and re-creates its run elsewhere from it: the stage
    names itself, its input, the input's spec and its own fingerprint, which the re-created run must
    reproduce.
    """

    def build_cache(
        self, ctx: RunContext, *, name: str, fingerprint: str, input_name: str, spec: Spec, staging: Path,
        layout: Any,
    ) -> dict[str, Any]: ...


@dataclass
class RunContext:
    catalog: Catalog
    output_dir: Path | None = None
    seed: int = 0
    # run.device as the recipe says it (cpu, cuda, cuda:N, auto); resolved once, in __post_init__,
    # into ``torch_device``: after that ``device`` names the resolved device (auto -> cpu or cuda:0).
    device: str = "cpu"
    recipe_name: str = "recipe"
    recipe_path: str | None = None
    progress: Progress = field(default_factory=lambda: Progress(quiet=True))
    # Where cache entries are built when not in this process (None: here). The caller makes it
    # from recipe.executor (pipeline.executors.executor_for); stages call it instead of importing
    # an executor.
    executor: CacheExecutor | None = None

    torch_device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        # The one place a device name becomes a device: a CUDA device that is not there fails here,
        # when the run is set up, before any stage works (pipeline.device).
        self.torch_device = resolve_device(self.device)
        self.device = str(self.torch_device)

    def metrics_log(self, record: dict[str, Any]) -> None:
        """Append one JSON line to the run's metrics.jsonl (per epoch, per stage)."""
        if self.output_dir is None:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with open(self.output_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(record, default=float) + "\n")

    def stage_dir(self, name: str) -> Path | None:
        if self.output_dir is None:
            return None
        path = self.output_dir / "stages" / name
        path.mkdir(parents=True, exist_ok=True)
        return path
