"""A content-addressed catalog of cached stage outputs, one directory per fingerprint.

Layout under ``root``::

    entries/<fp>/            complete entries; visible only once renamed here
    entries/<fp>/manifest.json   written last, inside staging, before the rename
    entries/<fp>/.last_used  mtime = last lookup; lets LRU eviction avoid rewriting the manifest
    entries/<fp>/.pinned     present = never evicted automatically (``pin``/``unpin``)
    staging/<fp>/            builds in progress; the path is deterministic per fingerprint so an
                             interrupted build can be resumed chunk by chunk (``resume=True``)
    locks/<fp>.lock          held (flock) by the one process building <fp>; records who, for messages
    trash/                   entries being removed; renamed here first so removal is atomic

Why this shape: a power cut can happen at any instant (SD cards on a Pi). The only
step that makes an entry visible is one ``rename`` of a fully fsynced directory that
already contains its manifest, so a reader sees either no entry or a complete one.
A directory in ``entries/`` without a parseable manifest is therefore never an entry.
Files the catalog itself keeps in an entry (manifest, ``.last_used``, ``.pinned``) are
bookkeeping: not payload, not counted in sizes, not part of :meth:`Catalog.content_hash`.

Concurrency (see :mod:`stores.lock` for why ``flock``):

- Building: :meth:`Catalog.stage` takes ``locks/<fp>.lock``. A second *process* staging
  the same fingerprint waits (optionally with a timeout, and a callback naming the
  holder); when it gets the lock and the entry was committed meanwhile,
  ``staging.existing`` is that entry and the build can be skipped. A killed builder's
  lock dies with it. Within one process a second concurrent stage is refused.
- Reading: :meth:`Catalog.use` holds a shared flock on the entry directory for as long
  as the handle lives (the pipeline holds it for a whole training run). Eviction and
  :meth:`Catalog.remove` try an exclusive flock without blocking and leave such
  entries alone.

Resume: with ``stage(..., resume=True)`` a leftover ``staging/<fp>`` (from a crash,
SIGKILL, Ctrl-C or an exception) is kept, and ``ZarrWriter(..., resume=True)`` (or
``H5Writer(..., resume=True)``) continues after its last durable chunk. Without it the
leftover is deleted with a :class:`StaleStagingWarning`, as before. A full disk always removes the staging
directory (see :class:`StoreFullError`): keeping a partial multi-GB build on a card that
is already full would starve everything else on it, and the build cannot continue
until space is freed anyway.

Budget: ``Catalog(root, max_bytes=N)`` caps the payload bytes of committed entries.
``stage(..., estimate_bytes=n)`` (or :meth:`Catalog.ensure_space`) evicts least recently
used entries — never pinned ones, ones in use, or the one being built — before any
work starts, and raises :class:`BudgetError` if the build still cannot fit. The same
eviction also makes room when the *disk* has less free space than the estimate.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from stores import eviction, maintenance
from stores.durable import atomic_write_bytes, free_bytes, fsync_dir, makedirs_durable
from stores.errors import CatalogError, DamagedEntryError, EntryInUseError, StoreNotFoundError
from stores.leases import Built, EntryUse
from stores.lock import DirLock, FileLock, LockHolder
from stores.maintenance import GcReport
from stores.manifest import (
    BOOKKEEPING,
    FINGERPRINT,
    FORMAT,
    FORMAT_VERSION,
    KIND,
    LAST_USED,
    MANIFEST,
    PINNED,
    Entry,
    hash_payload,
    human_size,
    manifest_problem,
    read_entry,
    to_json,
    validate_fingerprint,
)
from stores.staging import Staging
from stores.verify import VerifyReport, damaged_files

__all__ = [
    "BOOKKEEPING",
    "FORMAT",
    "FORMAT_VERSION",
    "LAST_USED",
    "MANIFEST",
    "PINNED",
    "Built",
    "Catalog",
    "Entry",
    "EntryUse",
    "GcReport",
    "Staging",
    "hash_payload",
    "human_size",
    "validate_fingerprint",
]


def _touch(path: Path) -> None:
    # Not fsynced and errors ignored on purpose: last-use is an eviction hint, not data, and a
    # lookup on a read-only mount (or a worn SD card) must still succeed.
    try:
        path.touch(exist_ok=True)
        os.utime(path)
    except OSError:
        pass


def _file_in_the_way(path: Path) -> Path | None:
    """``path`` or its nearest existing ancestor, when that is not a directory (so no directory can be
    made there): said as such, rather than as a directory that "does not exist"."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


class Catalog:
    """Entries keyed by fingerprint under ``root`` (see the module docstring for the layout).

    ``max_bytes``: optional cap on the payload bytes of committed entries, enforced by
    LRU eviction before builds that declare an ``estimate_bytes``.
    """

    def __init__(
        self, root: str | os.PathLike[str], create: bool = True, *, max_bytes: int | None = None
    ) -> None:
        self.root = Path(root)
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise CatalogError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        if not self.root.is_dir():
            blocker = _file_in_the_way(self.root)
            if blocker is not None:
                raise StoreNotFoundError(
                    f"catalog directory {self.root} cannot be a directory: {blocker} is a file, not a "
                    "directory; check the cache path"
                )
            if not create:
                raise StoreNotFoundError(
                    f"catalog directory {self.root} does not exist and create=False; check the cache path"
                )
            makedirs_durable(self.root)
        self.entries_dir = self.root / "entries"
        self.staging_dir = self.root / "staging"
        self.trash_dir = self.root / "trash"
        self.locks_dir = self.root / "locks"
        for sub in (self.entries_dir, self.staging_dir, self.trash_dir):
            if not sub.is_dir():
                makedirs_durable(sub)
        try:
            makedirs_durable(self.locks_dir)
        except OSError:
            # A catalog created before locks existed, opened on a read-only mount (e.g. `cache ls`):
            # reading needs no lock files; builds create the directory when they take a lock.
            pass
        # Finish removals a crash interrupted; ignore_errors because another process may be doing the same.
        for leftover in self.trash_dir.iterdir():
            shutil.rmtree(leftover, ignore_errors=True)

    def __repr__(self) -> str:
        budget = f", max_bytes={self.max_bytes}" if self.max_bytes is not None else ""
        return f"Catalog({str(self.root)!r}{budget})"

    def _entry_path(self, fingerprint: str) -> Path:
        return self.entries_dir / validate_fingerprint(fingerprint)

    # ------------------------------------------------------------------ lookup and use
    def exists(self, fingerprint: str) -> bool:
        """True if a complete entry exists; does not count as a use."""
        return read_entry(self._entry_path(fingerprint), fingerprint) is not None

    def lookup(self, fingerprint: str) -> Entry | None:
        """The complete entry for ``fingerprint`` (marking it used), or None.

        This does not protect the entry from eviction by another process; to read it
        over time, hold it with :meth:`use` instead.
        """
        path = self._entry_path(fingerprint)
        entry = read_entry(path, fingerprint)
        if entry is None:
            return None
        _touch(path / LAST_USED)
        return replace(entry, last_used=datetime.now(timezone.utc))

    def try_use(self, fingerprint: str) -> EntryUse | None:
        """Hold the entry for reading (shared lock, marks it used); None if there is no entry.

        Raises :class:`DamagedEntryError` when a checksummed file of it (weights, results, metadata) no
        longer matches its manifest: a damaged entry is never handed out.
        """
        return self._hold(fingerprint, touch=True)

    def _hold(self, fingerprint: str, *, touch: bool, check: bool = True) -> EntryUse | None:
        """``check``: the checksummed files against the manifest (not needed by what reads no data, such as
        pinning, nor right after this process committed the files)."""
        path = self._entry_path(fingerprint)
        for _ in range(8):  # retried only if the entry is replaced between open and lock
            lock = DirLock(path)
            # Blocking: only an evictor/remover holds it exclusively, and only for one rename.
            if not lock.acquire(shared=True, blocking=True):
                return None
            if not lock.same_as(path):
                lock.release()  # evicted or removed while we waited; look again
                continue
            entry = read_entry(path, fingerprint)
            if entry is None:
                lock.release()
                return None
            damaged = damaged_files(path, entry.files, entry.checksums) if check else []
            if damaged:
                lock.release()
                raise DamagedEntryError(fingerprint, str(path), tuple(damaged), entry.pinned)
            if touch:
                _touch(path / LAST_USED)
                entry = replace(entry, last_used=datetime.now(timezone.utc))
            return EntryUse(entry, lock)
        return None

    def use(self, fingerprint: str) -> EntryUse:
        """Like :meth:`try_use` but raises :class:`StoreNotFoundError` if the entry does not exist.

        Usage::

            with catalog.use(fp) as entry:      # or: handle = catalog.use(fp); ...; handle.release()
                train_on(entry.path)
        """
        handle = self.try_use(fingerprint)
        if handle is None:
            raise StoreNotFoundError(f"no complete entry {fingerprint} in the catalog at {self.root}")
        return handle

    def in_use(self, fingerprint: str) -> bool:
        """True if a reader (any process, including this one) holds the entry via :meth:`use`."""
        lock = DirLock(self._entry_path(fingerprint))
        if lock.acquire(shared=False, blocking=False):
            lock.release()
            return False
        return self._entry_path(fingerprint).exists()

    def _being_built(self, fingerprint: str) -> bool:
        """True if some process holds the build lock of ``fingerprint`` (e.g. a waiter about to reuse it)."""
        if not (self.locks_dir / f"{fingerprint}.lock").exists():
            return False
        probe = FileLock(self.locks_dir / f"{fingerprint}.lock", purpose="probe")
        if probe.acquire(blocking=False):
            probe.release()
            return False
        return True

    # ------------------------------------------------------------------ building
    def stage(
        self,
        fingerprint: str,
        kind: str,
        lineage: dict[str, Any],
        *,
        resume: bool = False,
        estimate_bytes: int | None = None,
        wait_timeout: float | None = None,
        on_wait: Callable[[LockHolder | None], None] | None = None,
    ) -> Staging:
        """A context manager whose ``path`` receives the entry's files until ``commit()``.

        Usage::

            with catalog.stage(fp, "features", {"model": "mobilenet_v3"}, resume=True) as staging:
                if staging.existing is None:          # nobody built it meanwhile
                    write_files(staging.path)         # resuming after staging.resumed leftovers
                    staging.commit()
                handle = catalog.use(fp)              # inside the block: cannot be evicted in between

        ``resume``: keep a leftover staging directory (and the directory after an exception
        or Ctrl-C) so the build continues where it stopped. ``estimate_bytes``: make room
        (LRU eviction) before starting, or raise :class:`BudgetError`. ``wait_timeout`` /
        ``on_wait``: while another process builds the same fingerprint this one waits;
        ``on_wait(holder)`` is told who it waits for, and :class:`LockTimeoutError` ends
        the wait after ``wait_timeout`` seconds (None: wait indefinitely).
        """
        validate_fingerprint(fingerprint)
        if not isinstance(kind, str) or not KIND.fullmatch(kind):
            raise CatalogError(f"entry kind must be a short name of [A-Za-z0-9._-], got {kind!r}")
        if not isinstance(lineage, dict):
            raise CatalogError(f"lineage of {fingerprint} must be a dict, got {type(lineage).__name__}")
        if estimate_bytes is not None and (not isinstance(estimate_bytes, int) or estimate_bytes < 0):
            raise CatalogError(f"estimate_bytes must be a non-negative int or None, got {estimate_bytes!r}")
        # Round-trip now so an unserialisable lineage fails before hours of computing, not at commit.
        lineage = json.loads(to_json(lineage, f"lineage of {fingerprint}"))
        return Staging(
            self,
            fingerprint,
            kind,
            lineage,
            resume=resume,
            estimate_bytes=estimate_bytes,
            wait_timeout=wait_timeout,
            on_wait=on_wait,
        )

    def reuse_or_build(
        self,
        fingerprint: str,
        kind: str,
        lineage: dict[str, Any],
        build: Callable[[Staging], dict[str, Any] | None],
        *,
        resume: bool = False,
        estimate_bytes: int | None = None,
        on_wait: Callable[[LockHolder | None], None] | None = None,
    ) -> Built:
        """The one look-up-or-build-and-commit sequence every producer of an entry goes through.

        A stored entry is held and returned as it is. Otherwise ``build(staging)`` writes the
        files into ``staging.path`` (continuing a leftover one when ``staging.resumed``) and
        returns the manifest's extra fields; the entry is committed and held. When another
        process built it while this one waited for the lock, that entry is taken instead. The
        returned :class:`Built` holds the entry (not evictable) until ``use.release()``.
        """
        held, replaced = self.use_undamaged(fingerprint)
        if held is not None:
            return Built(held, reused=True, resumed=False)
        with self.stage(
            fingerprint, kind, lineage, resume=resume, estimate_bytes=estimate_bytes, on_wait=on_wait
        ) as staging:
            reused, resumed = staging.existing is not None, staging.resumed
            if not reused:
                staging.commit(build(staging))
            # Inside the block, so nothing evicts it in between; files this process just committed and
            # hashed are not hashed again.
            held = self._hold(fingerprint, touch=True, check=reused)
            if held is None:
                raise StoreNotFoundError(f"entry {fingerprint} vanished right after it was committed in "
                                         f"{self.root}; re-run the build")
        return Built(held, reused=reused, resumed=resumed, replaced=replaced)

    def use_undamaged(self, fingerprint: str) -> tuple[EntryUse | None, str | None]:
        """(the entry held, or None to build it; what was wrong with a damaged one, or None). A damaged
        entry (a file that no longer matches its checksum, a manifest that does not parse) is removed so
        it can be rebuilt under the same fingerprint; while another reader holds it, the
        :class:`DamagedEntryError` goes to the caller."""
        problem = self.manifest_problem(fingerprint)
        try:
            return self.try_use(fingerprint), problem
        except DamagedEntryError as exc:
            return None, maintenance.discard_damaged(self, exc)

    def manifest_problem(self, fingerprint: str) -> str | None:
        """Why the entry directory of ``fingerprint`` is no entry although it has a manifest (a damaged
        manifest.json), or None (an entry, or nothing stored)."""
        path = self._entry_path(fingerprint)
        return manifest_problem(path, fingerprint) if path.is_dir() else None

    def damaged(self) -> list[tuple[str, Path, str]]:
        """(fingerprint, path, what is wrong) of every entry directory whose manifest.json is damaged:
        what ``cache ls``, ``du`` and ``verify`` report beside the entries (its bytes are on disk)."""
        return maintenance.damaged_manifests(self)

    # ------------------------------------------------------------------ listing
    def entries(self) -> list[Entry]:
        """Every complete entry, least recently used first (the order an evictor wants)."""
        found = []
        for child in self.entries_dir.iterdir():
            if FINGERPRINT.fullmatch(child.name) and child.is_dir():
                entry = read_entry(child, child.name)
                if entry is not None:
                    found.append(entry)
        return sorted(found, key=lambda e: (e.last_used, e.fingerprint))

    def total_bytes(self) -> int:
        """Payload bytes of all complete entries (manifests and bookkeeping excluded)."""
        return sum(entry.size_bytes for entry in self.entries())

    # ------------------------------------------------------------------ pinning and removal
    def pin(self, fingerprint: str) -> Entry:
        """Protect an entry from automatic eviction (an explicit :meth:`remove` still works)."""
        # Under a shared lock, so an evictor that already decided to take it finishes first
        # (and this raises) rather than evicting right after the marker is written. Pinning
        # is not a use: it does not change the LRU order.
        handle = self._hold(fingerprint, touch=False, check=False)
        if handle is None:
            raise StoreNotFoundError(f"no complete entry {fingerprint} in the catalog at {self.root}")
        with handle as entry:
            atomic_write_bytes(entry.path / PINNED, b"")
            return replace(entry, pinned=True)

    def unpin(self, fingerprint: str) -> bool:
        """Make an entry evictable again; False if it was not pinned (or does not exist)."""
        path = self._entry_path(fingerprint)
        try:
            (path / PINNED).unlink()
        except FileNotFoundError:
            return False
        fsync_dir(path)
        return True

    def remove(self, fingerprint: str, *, force: bool = False) -> bool:
        """Delete an entry (complete or not); False if there was nothing to remove.

        Refuses with :class:`EntryInUseError` while a reader holds it (see :meth:`use`)
        unless ``force=True`` — then that reader's next reads fail.
        """
        path = self._entry_path(fingerprint)
        if not path.exists():
            return False
        if force:
            self._discard(path)
            return True
        lock = DirLock(path)
        if not lock.acquire(shared=False, blocking=False):
            if not path.exists():
                return False
            raise EntryInUseError(
                f"entry {fingerprint} at {path} is in use by a reader (this or another process, e.g. a "
                "running training); stop it first, or remove with force=True"
            )
        try:
            target = self._to_trash(path) if lock.same_as(path) else None
        finally:
            lock.release()
        if target is None:
            return False
        shutil.rmtree(target, ignore_errors=True)
        return True

    def _to_trash(self, path: Path) -> Path | None:
        # Rename first so the entry disappears atomically; a crash mid-rmtree only leaves trash.
        target = self.trash_dir / f"{path.name}-{secrets.token_hex(4)}"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return None  # removed concurrently
        fsync_dir(path.parent)
        return target

    def _discard(self, path: Path) -> None:
        target = self._to_trash(path)
        if target is not None:
            shutil.rmtree(target, ignore_errors=True)

    # ------------------------------------------------------------------ budget
    def ensure_space(self, needed_bytes: int, *, building: str | None = None) -> list[str]:
        """Evict least recently used entries until a new entry of ``needed_bytes`` fits.

        See :func:`stores.eviction.ensure_space`; returns the evicted fingerprints, oldest first.
        """
        return eviction.ensure_space(self, needed_bytes, building=building)

    def _disk_free(self) -> int | None:
        """Free bytes on the catalog's filesystem (a method so tests can simulate a nearly full card)."""
        return free_bytes(self.root)

    # ------------------------------------------------------------------ maintenance
    def gc(self) -> GcReport:
        """Remove abandoned staging directories (not locked by a live builder), trash and stale lock files.

        Note this discards the partial work a later ``resume=True`` build could have reused.
        """
        return maintenance.gc(self)

    def verify(self, fingerprint: str) -> VerifyReport:
        """Check an entry: manifest files present with their recorded sizes, every chunk decodes."""
        return maintenance.verify(self, fingerprint)

    def content_hash(self, fingerprint: str) -> str:
        """sha256 over the entry's sorted payload paths and bytes (see :func:`hash_payload`)."""
        return maintenance.content_hash(self, fingerprint)

    def reseal(self, fingerprint: str) -> Entry:
        """Re-record the payload files and sizes in the manifest after an in-place repair."""
        return maintenance.reseal(self, fingerprint)

    def _publish(self, fingerprint: str, staged: Path) -> Entry:
        """Atomically move a sealed staging directory into entries/ (see Staging.commit)."""
        final = self.entries_dir / fingerprint
        existing = read_entry(final, fingerprint)
        if existing is not None:
            self._discard(staged)
            return existing
        if final.exists():
            self._discard(final)  # a husk without a valid manifest: never an entry, safe to replace
        try:
            os.rename(staged, final)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            existing = read_entry(final, fingerprint)  # another process published first
            if existing is None:
                raise CatalogError(
                    f"cannot publish {staged} as {final}: the target appeared concurrently without a "
                    "valid manifest; retry the build"
                ) from exc
            self._discard(staged)
            return existing
        fsync_dir(self.entries_dir)
        fsync_dir(self.staging_dir)
        entry = read_entry(final, fingerprint)
        if entry is None:
            raise CatalogError(f"entry {final} was published but its manifest cannot be read back")
        return entry
