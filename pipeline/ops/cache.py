"""The cache operator: write a stream through to a store entry (:mod:`.cache_write`), and read it back
(:mod:`.cache_read`).

This module gathers the names callers use (the cache stage, NeuroFlux's spill, benchmarks).
"""

from __future__ import annotations

from stores.entry import H5_FILE, ZARR_DIR

from ..spec import spec_from_json, spec_to_json
from .cache_read import StoredStream, open_entry_reader
from .cache_write import (
    SPEC_ATTR,
    cache_layout,
    chunk_samples_for,
    chunk_samples_per_split,
    stream_batch_period,
    write_stream,
)

__all__ = [
    "H5_FILE",
    "SPEC_ATTR",
    "ZARR_DIR",
    "StoredStream",
    "cache_layout",
    "chunk_samples_for",
    "chunk_samples_per_split",
    "open_entry_reader",
    "spec_from_json",
    "spec_to_json",
    "stream_batch_period",
    "write_stream",
]
