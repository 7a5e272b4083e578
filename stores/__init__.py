"""Disk-backed, content-addressed cache storage: key/value stores, the entry catalog, zarr entries.

This package is the lower layer of the toolkit and never imports ``pipeline``.
"""

from __future__ import annotations

from stores.abc import Store, is_valid_key, validate_key
from stores.catalog import Catalog, Entry, Staging, human_size, validate_fingerprint
from stores.errors import (
    CatalogError,
    CorruptChunkError,
    EntryReadError,
    EntryWriteError,
    InvalidKeyError,
    KeyConflictError,
    ReadOnlyError,
    StaleStagingWarning,
    StoreError,
    StoreNotFoundError,
)
from stores.local import LocalStore, atomic_write_bytes, fsync_dir
from stores.zarr_entry import ArraySpec, ZarrReader, ZarrWriter, suggest_chunk_samples

__all__ = [
    "ArraySpec",
    "Catalog",
    "CatalogError",
    "CorruptChunkError",
    "Entry",
    "EntryReadError",
    "EntryWriteError",
    "InvalidKeyError",
    "KeyConflictError",
    "LocalStore",
    "ReadOnlyError",
    "Staging",
    "StaleStagingWarning",
    "Store",
    "StoreError",
    "StoreNotFoundError",
    "ZarrReader",
    "ZarrWriter",
    "atomic_write_bytes",
    "fsync_dir",
    "human_size",
    "is_valid_key",
    "suggest_chunk_samples",
    "validate_fingerprint",
    "validate_key",
]
