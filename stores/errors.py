"""Exceptions raised by the stores package.

``stores`` must stay importable without ``pipeline`` (it is the lower layer), so it
has its own hierarchy. Each class also derives from the builtin a caller would
naturally catch (``ValueError`` for bad input or bad data, ``FileNotFoundError`` /
``PermissionError`` for the environment), and every message names the key, path,
array or chunk involved plus what was expected and what was found.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidKeyError(StoreError, ValueError):
    """A key, fingerprint or array name is malformed or could escape the store directory."""


class KeyConflictError(StoreError, ValueError):
    """A key cannot hold a value because it is also the parent of other keys (or the reverse)."""


class ReadOnlyError(StoreError, PermissionError):
    """A write or delete was attempted on a store opened read-only."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The store or catalog directory does not exist and creating it was not allowed."""


class CatalogError(StoreError, ValueError):
    """A catalog operation cannot proceed (bad lineage, staging misuse, commit conflict)."""


class EntryWriteError(StoreError, ValueError):
    """A zarr entry writer was fed data that does not match its declared arrays or sample counts."""


class EntryReadError(StoreError, ValueError):
    """A zarr entry is not laid out as the reader expects (missing array, mixed chunk sizes, bad index)."""


class CorruptChunkError(StoreError, ValueError):
    """A stored chunk failed its checksum, could not be decoded, or is missing.

    Carries ``path`` (entry directory), ``array`` (full array name) and ``chunk``
    (chunk index along the sample axis) so a later verify/repair step can act on it
    without parsing the message.
    """

    def __init__(self, path: str, array: str, chunk: int, reason: str) -> None:
        self.path = path
        self.array = array
        self.chunk = chunk
        self.reason = reason
        super().__init__(
            f"corrupt chunk {chunk} of array {array!r} in entry {path}: {reason.rstrip('.')}. "
            "The entry must be rebuilt (remove it from the catalog and re-run the stage)."
        )

    def __reduce__(self) -> tuple[type[CorruptChunkError], tuple[str, str, int, str]]:
        # The default exception pickling replays ``args`` (the message) into __init__, which
        # takes four fields; dask/multiprocessing workers must be able to ship this error back.
        return (type(self), (self.path, self.array, self.chunk, self.reason))


class StaleStagingWarning(UserWarning):
    """A leftover staging directory (from a crash or a killed run) was removed and the build restarted."""
