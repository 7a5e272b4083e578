"""Where stage A's work runs when it does not run in this process.

``dask_build`` builds a cache entry on a Dask cluster from the same recipe and into the
same store as a local build, and ends with the same bytes: the client lays down the
zarr metadata (``layout``), cuts each split into chunk-aligned ``partitions``, and every
worker re-creates the upstream stream from the recipe and writes its own chunks in
place (``worker``). Only the client commits the entry.
"""

from __future__ import annotations

from .errors import ExecutorError, WorkerStoreError

__all__ = ["ExecutorError", "WorkerStoreError"]
