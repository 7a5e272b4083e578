"""ondevice-tl: on-device transfer learning as a streaming dataflow, from Python or ``python -m pipeline``.

The Python API (each name is imported on first use, so ``import pipeline`` loads neither torch nor
any stage; ``help(pipeline.run)`` and friends have the details)::

    import pipeline

    recipe = pipeline.load_recipe("recipes/quickstart.yaml", {"stages.quantized.bits": 4})
    for row in pipeline.plan(recipe):                 # what would be computed, what reused
        print(row.name, row.action)
    result = pipeline.run(recipe)                     # as `python -m pipeline run` does
    print(result.summary_line, result.run_dir)

    # the stored cache as a torch IterableDataset, for a training loop of your own
    data = pipeline.cache_dataset(recipe, stage="cache", batch_size=32, shuffle=True, augment=True)

    loaded = pipeline.load_model(MODEL_FILE)          # a trained network, ready, and its preprocessing

- :func:`load_recipe` — validate a recipe file, dict or Recipe, with overrides;
- :func:`plan` — the stage graph with fingerprints and what is stored, no work done;
- :func:`run` — run a recipe, get back its summary, run directory and each stage's output;
- :func:`cache_dataset` — a stored cache entry as a sharded, seeded ``IterableDataset``;
- :func:`load_model` — a trained model file as a ready ``nn.Module`` and its preprocessing;
- :func:`run_sweep` — a grid of variants of a recipe, sharing what they share, ranked (``sweep``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import cache_dataset, load_recipe, plan, run
    from .deploy.model_file import load_model
    from .sweep.run import run_sweep

# name -> the module that defines it, imported when the name is first read.
_EXPORTS = {
    "load_recipe": "pipeline.api",
    "plan": "pipeline.api",
    "run": "pipeline.api",
    "cache_dataset": "pipeline.api",
    "load_model": "pipeline.deploy.model_file",
    "run_sweep": "pipeline.sweep.run",
}

__all__ = ["cache_dataset", "load_model", "load_recipe", "plan", "run", "run_sweep"]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only the toolkit's own module missing is "not in this version"; a missing library
        # (torch, ...) keeps its own error, which the CLI and users know how to read.
        if exc.name is not None and module_name.startswith(exc.name) and exc.name.startswith("pipeline"):
            raise ImportError(
                f"pipeline.{name} is not available in this version of ondevice-tl: it is defined in "
                f"{module_name}, which is not installed here; update ondevice-tl"
            ) from None
        raise
    value = getattr(module, name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
