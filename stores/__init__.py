"""Disk-backed, content-addressed cache storage: key/value stores, the entry catalog, zarr entries.

This package is the lower layer of the toolkit and never imports ``pipeline``.
Importing it does not import zarr: the zarr entry names below load on first use, so
the catalog and the errors work where only the recipe tools are installed.
"""

from __future__ import annotations

from stores.abc import Store, is_valid_key, validate_key
from stores.catalog import (
    Catalog,
    Entry,
    EntryUse,
    GcReport,
    Staging,
    hash_payload,
    human_size,
    validate_fingerprint,
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
from stores.local import LocalStore, atomic_write_bytes, fsync_dir
from stores.lock import DirLock, FileLock, LockHolder
from stores.verify import Problem, VerifyReport

_ZARR_ENTRY_NAMES = frozenset(
    {"ArraySpec", "ChunkProblem", "DurableLocalStore", "ZarrReader", "ZarrWriter", "suggest_chunk_samples"}
)


def __getattr__(name: str) -> object:
    if name in _ZARR_ENTRY_NAMES:
        from stores import zarr_entry

        return getattr(zarr_entry, name)
    raise AttributeError(f"module 'stores' has no attribute {name!r}")


__all__ = [
    "ArraySpec",
    "BudgetError",
    "Catalog",
    "CatalogError",
    "ChunkProblem",
    "CorruptChunkError",
    "DirLock",
    "DurableLocalStore",
    "Entry",
    "EntryInUseError",
    "EntryReadError",
    "EntryUse",
    "EntryWriteError",
    "FileLock",
    "GcReport",
    "InvalidKeyError",
    "KeyConflictError",
    "LocalStore",
    "LockHolder",
    "LockTimeoutError",
    "Problem",
    "ReadOnlyError",
    "Staging",
    "StaleStagingWarning",
    "Store",
    "StoreError",
    "StoreFullError",
    "StoreNotFoundError",
    "VerifyReport",
    "ZarrReader",
    "ZarrWriter",
    "atomic_write_bytes",
    "fsync_dir",
    "hash_payload",
    "human_size",
    "is_valid_key",
    "suggest_chunk_samples",
    "validate_fingerprint",
    "validate_key",
]
