"""Disk-backed, content-addressed cache storage: the entry catalog and the entry backends (zarr, HDF5).

This package is the lower layer of the toolkit and never imports ``pipeline``.
Importing it does not import zarr: the zarr entry names below load on first use, so
the catalog and the errors work where only the recipe tools are installed, and an HDF5
entry is written and read without zarr (:mod:`stores.entry` chooses the backend).
"""

from __future__ import annotations

from stores.catalog import (
    Built,
    Catalog,
    Entry,
    EntryUse,
    GcReport,
    Staging,
    hash_payload,
    human_size,
    validate_fingerprint,
)
from stores.durable import atomic_write_bytes, fsync_dir
from stores.entry import (
    ChunkProblem,
    ChunkRewriter,
    EntryLayout,
    EntryReader,
    EntryWriter,
    Rewrite,
    entry_format,
    find_containers,
    open_container,
    open_reader,
    open_rewriter,
    open_writer,
    plan_chunk_samples,
)
from stores.errors import (
    BudgetError,
    CatalogError,
    CorruptChunkError,
    EntryInUseError,
    EntryReadError,
    EntryWriteError,
    InvalidKeyError,
    KeyConflictError,
    LockTimeoutError,
    ReadOnlyError,
    StaleStagingWarning,
    StoreError,
    StoreFullError,
    StoreNotFoundError,
)
from stores.keys import is_valid_key, validate_key
from stores.layout import ArraySpec
from stores.lock import DirLock, FileLock, LockHolder
from stores.verify import Problem, VerifyReport

_ZARR_ENTRY_NAMES = frozenset({"DurableLocalStore", "ZarrReader", "ZarrWriter", "suggest_chunk_samples"})


def __getattr__(name: str) -> object:
    if name in _ZARR_ENTRY_NAMES:
        from stores import zarr_entry

        return getattr(zarr_entry, name)
    raise AttributeError(f"module 'stores' has no attribute {name!r}")


__all__ = [
    "ArraySpec",
    "BudgetError",
    "Built",
    "Catalog",
    "CatalogError",
    "ChunkProblem",
    "ChunkRewriter",
    "CorruptChunkError",
    "DirLock",
    "DurableLocalStore",
    "Entry",
    "EntryLayout",
    "EntryReader",
    "EntryInUseError",
    "EntryReadError",
    "EntryUse",
    "EntryWriteError",
    "EntryWriter",
    "FileLock",
    "GcReport",
    "InvalidKeyError",
    "KeyConflictError",
    "LockHolder",
    "LockTimeoutError",
    "Problem",
    "ReadOnlyError",
    "Rewrite",
    "Staging",
    "StaleStagingWarning",
    "StoreError",
    "StoreFullError",
    "StoreNotFoundError",
    "VerifyReport",
    "ZarrReader",
    "ZarrWriter",
    "atomic_write_bytes",
    "entry_format",
    "find_containers",
    "fsync_dir",
    "hash_payload",
    "human_size",
    "is_valid_key",
    "open_container",
    "open_reader",
    "open_rewriter",
    "open_writer",
    "plan_chunk_samples",
    "suggest_chunk_samples",
    "validate_fingerprint",
    "validate_key",
]
