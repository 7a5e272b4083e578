"""Exceptions raised by the stores package.

``stores`` must stay importable without ``pipeline`` (it is the lower layer), so it
has its own hierarchy. Each class also derives from the builtin a caller would
naturally catch (``ValueError`` for bad input or bad data, ``FileNotFoundError`` /
``PermissionError`` for the environment), and every message names the key, path,
array or chunk involved plus what was expected and what was found.
"""

from __future__ import annotations

import errno


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


class BudgetError(CatalogError):
    """A build cannot fit in the catalog's byte budget (or on the disk) even after evicting.

    Raised *before* any work starts, with the numbers involved: ``needed`` (the build's
    estimate), ``available`` (what evicting everything evictable would leave room for),
    and the fingerprints that could not be evicted because they are ``pinned`` or ``in_use``.
    """

    def __init__(
        self,
        message: str,
        *,
        needed: int,
        available: int,
        pinned: tuple[str, ...] = (),
        in_use: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.pinned = pinned
        self.in_use = in_use

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_budget_error, (str(self), self.needed, self.available, self.pinned, self.in_use))


def _rebuild_budget_error(
    message: str, needed: int, available: int, pinned: tuple[str, ...], in_use: tuple[str, ...]
) -> BudgetError:
    return BudgetError(message, needed=needed, available=available, pinned=pinned, in_use=in_use)


class DamagedEntryError(CatalogError):
    """A stored entry's file no longer matches the checksum its manifest recorded (or is missing).

    Carries ``fingerprint``, ``path`` (the entry directory), ``files`` (the damaged files, relative to it)
    and ``pinned``, so a caller can rebuild the entry (same fingerprint) or tell the user what to remove.
    """

    def __init__(self, fingerprint: str, path: str, files: tuple[str, ...], pinned: bool = False) -> None:
        self.fingerprint = fingerprint
        self.path = path
        self.files = files
        self.pinned = pinned
        super().__init__(
            f"stored entry {fingerprint[:12]} at {path} is damaged: {', '.join(files)} "
            f"{'does' if len(files) == 1 else 'do'} not match the checksum recorded when it was stored; "
            f"it is never used as it is (remove it with `python -m pipeline cache rm {fingerprint[:12]}` and "
            "rerun to rebuild it, or let a run rebuild it)"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.fingerprint, self.path, self.files, self.pinned))


class EntryInUseError(CatalogError):
    """An entry cannot be removed because a reader (this or another process) holds it."""


class LockTimeoutError(CatalogError, TimeoutError):
    """Waiting for another process's lock (e.g. one building the same entry) took too long.

    ``holder`` is the lock holder's description (pid, host, since when, what for) if known.
    """

    def __init__(self, message: str, holder: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.holder))


class StoreFullError(StoreError, OSError):
    """The disk filled up (ENOSPC/EDQUOT) while writing an entry.

    It is an ``OSError`` with ``errno == ENOSPC`` so code that already handles a full disk
    keeps working, and carries ``entry`` (fingerprint, or None if unknown), ``path`` (the
    file or directory being written) and ``free_bytes`` (free space when it was noticed,
    None if it could not be measured). The staging directory has been removed by the time
    the catalog raises it; other entries are untouched.
    """

    def __init__(
        self,
        entry: str | None,
        path: str,
        free_bytes: int | None,
        detail: str = "",
        cleaned_up: bool = False,
    ) -> None:
        self.entry = entry
        self.free_bytes = free_bytes
        self.detail = detail
        self.cleaned_up = cleaned_up
        what = f"entry {entry}" if entry else "a cache entry"
        free = "unknown" if free_bytes is None else f"{free_bytes} bytes"
        after = "The partial build was removed; " if cleaned_up else ""
        extra = f"; {detail}" if detail else ""
        self.message = (
            f"the disk is full while writing {what} at {path} ({free} free{extra}). {after}Free space "
            "(e.g. `cache gc`, remove old entries or set a smaller cache budget) and re-run."
        )
        super().__init__(errno.ENOSPC, self.message, path)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.entry, self.filename, self.free_bytes, self.detail, self.cleaned_up))


class StaleStagingWarning(UserWarning):
    """A leftover staging directory (from a crash or a killed run) was removed and the build restarted."""
