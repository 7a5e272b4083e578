"""Sweeps: many variants of one recipe for the cost of what they do not share (``python -m pipeline sweep``).

- :mod:`.grid` — ``--grid KEY=V1,V2,...`` parsed, checked against the recipe, crossed or sampled;
- :mod:`.plan` — one validated recipe per variant (:func:`~.plan.variant_recipes`, where a rewrite
  pass can change them), planned before any work, the sweep's work counted once per fingerprint;
- :mod:`.execute` — the variants run here one after another, or as Dask tasks;
- :mod:`.records` — one record per finished variant, written atomically: a killed sweep resumes;
- :mod:`.table` — ``sweep.csv``, ``sweep.md``, ``sweep.png`` and ``best/``;
- :mod:`.run` — :func:`run_sweep`, all of it; ``pipeline.run_sweep`` is the same function.

Names are imported on first use: the CLI's parser imports this package without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .run import SweepResult, prepare, run_sweep

__all__ = ["SweepResult", "prepare", "run_sweep"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'pipeline.sweep' has no attribute {name!r}")
    return getattr(importlib.import_module("pipeline.sweep.run"), name)
