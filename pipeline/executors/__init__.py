"""Where stage A's work runs when it does not run in this process.

``dask_build`` builds a cache entry on a Dask cluster from the same recipe and into the
same store as a local build, and ends with the same bytes: the client lays down the
zarr metadata (:func:`stores.zarr_part.prepare_hierarchy`), cuts each split into
chunk-aligned ``partitions``, and every worker re-creates the upstream stream from the
recipe and writes its own chunks in place (``worker``). Only the client commits the entry.

Stages never import this package: whoever makes the run context (the CLI) hands them a
:class:`~pipeline.context.CacheExecutor` made for the recipe (:func:`executor_for`) in ``ctx.executor``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ExecutorError, WorkerStoreError

if TYPE_CHECKING:
    from pathlib import Path

    from stores.entry import EntryLayout

    from ..context import CacheExecutor, RunContext
    from ..recipe import Recipe
    from ..spec import Spec

__all__ = ["DaskCacheExecutor", "ExecutorError", "WorkerStoreError", "executor_for"]


class DaskCacheExecutor:
    """Builds cache entries of ``recipe`` on its Dask cluster (``dask_build.build_on_dask``).

    Workers re-create the run from ``recipe``, which is why an executor is made for one recipe.
    Dask is imported when a build starts, so a recipe that names it is checked and resolved
    without it.
    """

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def build_cache(
        self, ctx: RunContext, *, name: str, fingerprint: str, input_name: str, spec: Spec, staging: Path,
        layout: EntryLayout,
    ) -> dict[str, Any]:
        from .dask_build import build_on_dask

        return build_on_dask(ctx, self.recipe, name=name, fingerprint=fingerprint, input_name=input_name,
                             spec=spec, staging=staging, layout=layout)


def executor_for(recipe: Recipe) -> CacheExecutor | None:
    """The executor the recipe's ``executor`` section names, for that recipe; None: everything runs
    in this process."""
    if recipe.executor.type == "dask":
        return DaskCacheExecutor(recipe)
    return None
