"""Holding entries: a held entry cannot be evicted or removed while its reader uses it.

:class:`EntryUse` is a shared lock on the entry directory (see :mod:`stores.lock`);
:class:`Built` is what :meth:`stores.catalog.Catalog.reuse_or_build` hands back: the held
entry and how it came to be.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from stores.lock import DirLock
from stores.manifest import Entry


class EntryUse:
    """A held entry: a shared lock on its directory that keeps eviction and ``remove`` away.

    Use as a context manager (``with catalog.use(fp) as entry:``) or keep the object and
    call :meth:`release` when done (e.g. at the end of a training run). Releasing twice is
    harmless; a forgotten handle releases when garbage-collected or at process exit.
    """

    def __init__(self, entry: Entry, lock: DirLock) -> None:
        self.entry = entry
        self._lock = lock

    def __repr__(self) -> str:
        return f"EntryUse({self.entry.fingerprint[:12]}, {'held' if self.held else 'released'})"

    @property
    def path(self) -> Path:
        return self.entry.path

    @property
    def held(self) -> bool:
        return self._lock.held

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> Entry:
        return self.entry

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@dataclass
class Built:
    """What :meth:`Catalog.reuse_or_build` returns: the held entry and how it came to be."""

    use: EntryUse
    reused: bool  # stored before, or built meanwhile by another process
    resumed: bool  # this build continued an interrupted one
    # Why a stored entry of this fingerprint was rebuilt instead of reused (a damaged file or manifest).
    replaced: str | None = None

    @property
    def entry(self) -> Entry:
        return self.use.entry


