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
import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

from stores.abc import is_valid_key
from stores.errors import (
    BudgetError,
    CatalogError,
    EntryInUseError,
    InvalidKeyError,
    StaleStagingWarning,
    StoreFullError,
    StoreNotFoundError,
)
from stores.local import (
    FULL_DISK_ERRNOS,
    TEMP_MARKER,
    atomic_write_bytes,
    free_bytes,
    fsync_dir,
    fsync_tree,
    makedirs_durable,
)
from stores.lock import DirLock, FileLock, LockHolder
from stores.verify import VerifyReport, verify_entry

FORMAT = "ondevice-tl-entry"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LAST_USED = ".last_used"
PINNED = ".pinned"
# Files the catalog owns inside an entry; they are not part of its payload or size.
BOOKKEEPING = frozenset({MANIFEST, LAST_USED, PINNED})
_BUDGET_LOCK = "budget.lock"

# Lowercase only: FAT/exFAT SD cards are case-insensitive, so 'AB..' and 'ab..' would alias.
_FINGERPRINT = re.compile(r"[0-9a-f]{16,128}")
_KIND = re.compile(r"[A-Za-z0-9._-]+")
_REQUIRED = ("fingerprint", "kind", "lineage", "created", "size_bytes", "files")


def validate_fingerprint(fp: str) -> str:
    """Return ``fp`` if it is a lowercase hex digest of 16-128 characters, else raise InvalidKeyError."""
    if not isinstance(fp, str) or not _FINGERPRINT.fullmatch(fp):
        raise InvalidKeyError(
            f"fingerprint must be a lowercase hex string of 16-128 characters (e.g. a sha256 hexdigest), "
            f"got {fp!r}"
        )
    return fp


def human_size(num_bytes: int) -> str:
    """'0 B', '512 B', '1.5 KiB', '3.2 GiB' — binary units, as disk budgets are usually given."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Entry:
    """A complete, committed catalog entry. ``size_bytes`` counts payload files only."""

    fingerprint: str
    path: Path
    kind: str
    lineage: dict[str, Any]
    created: datetime
    last_used: datetime
    size_bytes: int
    manifest: dict[str, Any]
    pinned: bool = False

    @property
    def files(self) -> dict[str, int]:
        """Payload files (relative '/' paths) and their sizes at commit time."""
        return {f["path"]: f["size"] for f in self.manifest["files"]}

    def describe(self) -> str:
        return (
            f"{self.fingerprint[:12]}  {self.kind}  "
            f"{human_size(self.size_bytes)} in {len(self.files)} files  "
            f"created {self.created:%Y-%m-%d %H:%M:%S} UTC  last used {self.last_used:%Y-%m-%d %H:%M:%S} UTC"
            + ("  pinned" if self.pinned else "")
        )


def _read_entry(path: Path, fingerprint: str) -> Entry | None:
    """Parse ``path/manifest.json``; None if absent or not a valid manifest for ``fingerprint``."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            return None
        if manifest.get("format_version") != FORMAT_VERSION or manifest.get("fingerprint") != fingerprint:
            return None
        if any(key not in manifest for key in _REQUIRED):
            return None
        created = datetime.fromisoformat(manifest["created"])
        size = int(manifest["size_bytes"])
        lineage = manifest["lineage"]
        if not isinstance(lineage, dict) or not isinstance(manifest["files"], list):
            return None
    except (OSError, ValueError, TypeError):
        # Missing, half-visible or garbled manifest: by the catalog's rule this is not an entry.
        return None
    try:
        last_used = datetime.fromtimestamp((path / LAST_USED).stat().st_mtime, tz=timezone.utc)
    except OSError:
        last_used = created
    pinned = (path / PINNED).exists()
    return Entry(
        fingerprint, path, str(manifest["kind"]), lineage, created, last_used, size, manifest, pinned
    )


def _touch(path: Path) -> None:
    # Not fsynced and errors ignored on purpose: last-use is an eviction hint, not data, and a
    # lookup on a read-only mount (or a worn SD card) must still succeed.
    try:
        path.touch(exist_ok=True)
        os.utime(path)
    except OSError:
        pass


def _disk_full(exc: BaseException | None) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL_DISK_ERRNOS


def _tree_bytes(path: Path) -> int:
    """Apparent size of every file under ``path`` (0 if it vanished meanwhile)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


class Staging:
    """Context manager for building one entry; see :meth:`Catalog.stage`.

    After ``__enter__``:

    - ``existing``: the committed entry if one exists (e.g. another process built it
      while this one waited for the lock) — skip the build and use it; else None.
    - ``resumed``: True if ``resume=True`` found a non-empty leftover staging directory.
    - ``path``: the directory to write into.
    """

    # Fingerprints being staged by this process: a second flock from the same process would
    # wait for itself forever, so the in-process case is refused with a clear error instead.
    _active: set[Path] = set()
    _active_lock = threading.Lock()

    def __init__(
        self,
        catalog: Catalog,
        fingerprint: str,
        kind: str,
        lineage: dict[str, Any],
        *,
        resume: bool = False,
        estimate_bytes: int | None = None,
        wait_timeout: float | None = None,
        on_wait: Callable[[LockHolder | None], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.fingerprint = fingerprint
        self.kind = kind
        self.lineage = lineage
        self.resume = resume
        self.estimate_bytes = estimate_bytes
        self.wait_timeout = wait_timeout
        self.on_wait = on_wait
        self.existing: Entry | None = None
        self.resumed = False
        self._path = catalog.staging_dir / fingerprint
        self._entered = False
        self._committed: Entry | None = None
        self._lock = FileLock(
            catalog.locks_dir / f"{fingerprint}.lock", purpose=f"building entry {fingerprint}"
        )

    @property
    def path(self) -> Path:
        """The directory to write the entry's files into (only inside the ``with`` block)."""
        if not self._entered:
            raise CatalogError(
                f"staging of {self.fingerprint} has no directory yet: use `with catalog.stage(...) as s:`"
            )
        return self._path

    def __enter__(self) -> Staging:
        key = self._path.resolve()
        with Staging._active_lock:
            if key in Staging._active:
                raise CatalogError(
                    f"fingerprint {self.fingerprint} is already being staged in this process "
                    f"at {self._path}; finish or abandon that build first"
                )
            Staging._active.add(key)
        try:
            self._lock.acquire(timeout=self.wait_timeout, on_wait=self.on_wait)
            self.existing = self.catalog.lookup(self.fingerprint)
            if self.existing is not None:
                # Built meanwhile (or already there): any leftover staging can only be garbage.
                shutil.rmtree(self._path, ignore_errors=True)
            else:
                if self.estimate_bytes is not None:
                    self.catalog.ensure_space(self.estimate_bytes, building=self.fingerprint)
                if self._path.exists():
                    if self.resume:
                        self._sweep_temp_files()
                        self.resumed = any(self._path.iterdir())
                    else:
                        warnings.warn(
                            f"removing leftover staging directory {self._path} (from an interrupted build); "
                            f"entry {self.fingerprint} will be rebuilt from scratch",
                            StaleStagingWarning,
                            stacklevel=2,
                        )
                        shutil.rmtree(self._path)
            makedirs_durable(self._path)
        except BaseException as exc:
            self._release()
            if _disk_full(exc) and not isinstance(exc, StoreFullError):
                raise StoreFullError(
                    self.fingerprint,
                    str(getattr(exc, "filename", None) or self._path),
                    free_bytes(self._path),
                ) from exc
            raise
        self._entered = True
        return self

    def _sweep_temp_files(self) -> None:
        """Remove temp files of writes a crash interrupted: they are never data."""
        for dirpath, _dirnames, filenames in os.walk(self._path):
            for name in filenames:
                if name.startswith(TEMP_MARKER):
                    os.unlink(os.path.join(dirpath, name))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._committed is None:
                full = _disk_full(exc)
                free = exc.free_bytes if isinstance(exc, StoreFullError) else None
                if full and free is None:
                    free = free_bytes(self._path)
                if full or exc is None or not self.resume:
                    # Abandoned without resume, not committed, or out of space: leave nothing behind.
                    shutil.rmtree(self._path, ignore_errors=True)
                if full and not (isinstance(exc, StoreFullError) and exc.entry and exc.cleaned_up):
                    assert isinstance(exc, OSError)
                    detail = exc.detail if isinstance(exc, StoreFullError) else ""
                    where = str(exc.filename or self._path)
                    raise StoreFullError(self.fingerprint, where, free, detail, cleaned_up=True) from exc
        finally:
            self._release()

    def _release(self) -> None:
        try:
            self._lock.release()
        finally:
            with Staging._active_lock:
                Staging._active.discard(self._path.resolve())

    def commit(self, extra_manifest: dict[str, Any] | None = None, *, pin: bool = False) -> Entry:
        """Seal the staged files into a visible entry and return it.

        ``extra_manifest`` (JSON-able) is stored under the manifest's ``"extra"`` key;
        ``pin=True`` publishes the entry already pinned. If a complete entry for this
        fingerprint appeared meanwhile, this build is discarded and the existing entry
        returned: both are by definition the same content.
        """
        path = self.path
        if self._committed is not None:
            return self._committed
        if not path.is_dir():
            raise CatalogError(
                f"staging directory {path} disappeared before commit "
                "(removed by another process or by `cache gc`?); re-run the build"
            )
        files = _payload_files(path)
        atomic_write_bytes(path / LAST_USED, b"")
        if pin:
            atomic_write_bytes(path / PINNED, b"")
        fsync_tree(path)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "kind": self.kind,
            "lineage": self.lineage,
            "created": datetime.now(timezone.utc).isoformat(),
            "size_bytes": sum(size for _, size in files),
            "files": [{"path": rel, "size": size} for rel, size in files],
            "extra": extra_manifest or {},
        }
        atomic_write_bytes(path / MANIFEST, _to_json(manifest, f"manifest of {self.fingerprint}"))
        self._committed = self.catalog._publish(self.fingerprint, path)
        return self._committed


def _payload_files(root: Path) -> list[tuple[str, int]]:
    """Sorted (relative path, size) of every payload file; refuses anything not self-contained."""
    out: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
            full = os.path.join(dirpath, name)
            rel = Path(full).relative_to(root).as_posix()
            if rel in BOOKKEEPING:
                continue
            if os.path.islink(full):
                raise CatalogError(f"staged file {full} is a symlink; entries must hold real files only")
            if not is_valid_key(rel):
                raise CatalogError(
                    f"staged file {full} has a name that is not portable ({rel!r}); "
                    "use only letters, digits, '.', '_' and '-'"
                )
            out.append((rel, os.stat(full).st_size))
    return sorted(out)


def hash_payload(root: str | os.PathLike[str]) -> str:
    """sha256 hex digest over the sorted payload files of ``root``: each relative path, size and bytes.

    Bookkeeping files (manifest, last-use stamp, pin marker) are excluded, so two builds
    of the same fingerprint — uninterrupted or resumed — hash equal iff their data does.
    """
    root = Path(root)
    digest = hashlib.sha256()
    for rel, size in _payload_files(root):
        digest.update(f"{rel}\0{size}\0".encode())
        with open(root / rel, "rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def _to_json(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CatalogError(
            f"{what} is not JSON-serialisable (plain dict/list/str/number/bool only): {exc}"
        ) from None


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

    @property
    def entry(self) -> Entry:
        return self.use.entry


@dataclass
class GcReport:
    """What :meth:`Catalog.gc` removed: staging dirs and lock files (by name), trash items, bytes."""

    staging: list[str] = field(default_factory=list)
    trash: int = 0
    locks: list[str] = field(default_factory=list)
    bytes_freed: int = 0

    def describe(self) -> str:
        return (
            f"freed {human_size(self.bytes_freed)}: {len(self.staging)} abandoned staging dir(s), "
            f"{self.trash} trash item(s), {len(self.locks)} stale lock file(s)"
        )


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
            if not create or self.root.exists():
                raise StoreNotFoundError(
                    f"catalog directory {self.root} does not exist (or is not a directory) and create=False; "
                    "check the cache path"
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
        return _read_entry(self._entry_path(fingerprint), fingerprint) is not None

    def lookup(self, fingerprint: str) -> Entry | None:
        """The complete entry for ``fingerprint`` (marking it used), or None.

        This does not protect the entry from eviction by another process; to read it
        over time, hold it with :meth:`use` instead.
        """
        path = self._entry_path(fingerprint)
        entry = _read_entry(path, fingerprint)
        if entry is None:
            return None
        _touch(path / LAST_USED)
        return replace(entry, last_used=datetime.now(timezone.utc))

    def try_use(self, fingerprint: str) -> EntryUse | None:
        """Hold the entry for reading (shared lock, marks it used); None if there is no entry."""
        return self._hold(fingerprint, touch=True)

    def _hold(self, fingerprint: str, *, touch: bool) -> EntryUse | None:
        path = self._entry_path(fingerprint)
        for _ in range(8):  # retried only if the entry is replaced between open and lock
            lock = DirLock(path)
            # Blocking: only an evictor/remover holds it exclusively, and only for one rename.
            if not lock.acquire(shared=True, blocking=True):
                return None
            if not lock.same_as(path):
                lock.release()  # evicted or removed while we waited; look again
                continue
            entry = _read_entry(path, fingerprint)
            if entry is None:
                lock.release()
                return None
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
        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            raise CatalogError(f"entry kind must be a short name of [A-Za-z0-9._-], got {kind!r}")
        if not isinstance(lineage, dict):
            raise CatalogError(f"lineage of {fingerprint} must be a dict, got {type(lineage).__name__}")
        if estimate_bytes is not None and (not isinstance(estimate_bytes, int) or estimate_bytes < 0):
            raise CatalogError(f"estimate_bytes must be a non-negative int or None, got {estimate_bytes!r}")
        # Round-trip now so an unserialisable lineage fails before hours of computing, not at commit.
        lineage = json.loads(_to_json(lineage, f"lineage of {fingerprint}"))
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
        held = self.try_use(fingerprint)
        if held is not None:
            return Built(held, reused=True, resumed=False)
        with self.stage(
            fingerprint, kind, lineage, resume=resume, estimate_bytes=estimate_bytes, on_wait=on_wait
        ) as staging:
            reused, resumed = staging.existing is not None, staging.resumed
            if not reused:
                staging.commit(build(staging))
            held = self.use(fingerprint)  # inside the block, so nothing evicts it in between
        return Built(held, reused=reused, resumed=resumed)

    # ------------------------------------------------------------------ listing
    def entries(self) -> list[Entry]:
        """Every complete entry, least recently used first (the order an evictor wants)."""
        found = []
        for child in self.entries_dir.iterdir():
            if _FINGERPRINT.fullmatch(child.name) and child.is_dir():
                entry = _read_entry(child, child.name)
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
        handle = self._hold(fingerprint, touch=False)
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

        It must fit under ``max_bytes`` (committed payload + needed) and, independently,
        in the disk's free space (minus what ``building``'s staging directory already
        holds). Pinned entries, entries in use, entries whose build lock is held and
        ``building`` itself are never evicted. If evicting everything else would not be
        enough, :class:`BudgetError` is raised *before* anything is evicted. Returns the
        evicted fingerprints, oldest first.
        """
        if not isinstance(needed_bytes, int) or needed_bytes < 0:
            raise CatalogError(f"needed_bytes must be a non-negative int, got {needed_bytes!r}")
        # One evictor at a time, so two builders do not both evict for the same shortfall.
        with FileLock(self.locks_dir / _BUDGET_LOCK, purpose="making room in the cache"):
            entries = self.entries()
            used = sum(e.size_bytes for e in entries)
            budget_short = 0 if self.max_bytes is None else used + needed_bytes - self.max_bytes
            free = self._disk_free()
            own = _tree_bytes(self.staging_dir / building) if building else 0
            disk_short = 0 if free is None else needed_bytes - own - free
            # Evicting an entry both lowers the used bytes and frees about as much disk, so one
            # pass over the larger shortfall satisfies both limits (and is planned up front).
            shortfall = max(budget_short, disk_short)
            if shortfall <= 0:
                return []
            if budget_short >= disk_short:
                assert self.max_bytes is not None
                limit = (
                    f"the cache budget of {human_size(self.max_bytes)} ({self.max_bytes} bytes; "
                    f"{human_size(used)} used)"
                )
            else:
                limit = f"the disk's free space ({human_size(free or 0)} free at {self.root})"
            return self._evict(entries, shortfall, needed_bytes, building, limit=limit)

    def _disk_free(self) -> int | None:
        """Free bytes on the catalog's filesystem (a method so tests can simulate a nearly full card)."""
        return free_bytes(self.root)

    def _evict(
        self, entries: list[Entry], shortfall: int, needed: int, building: str | None, *, limit: str
    ) -> list[str]:
        candidates: list[Entry] = []
        pinned: list[Entry] = []
        busy: list[Entry] = []
        for entry in entries:
            if entry.fingerprint == building:
                continue
            if entry.pinned:
                pinned.append(entry)
            elif self.in_use(entry.fingerprint) or self._being_built(entry.fingerprint):
                busy.append(entry)
            else:
                candidates.append(entry)
        evictable = sum(e.size_bytes for e in candidates)
        if evictable < shortfall:
            raise self._budget_error(needed, shortfall, evictable, pinned, busy, building, limit)
        freed, evicted = 0, []
        for entry in candidates:
            if freed >= shortfall:
                break
            outcome = self._try_evict(entry)
            if outcome == "busy":
                busy.append(entry)
                continue
            freed += entry.size_bytes  # evicted by us, or removed by someone else: gone either way
            if outcome == "evicted":
                evicted.append(entry.fingerprint)
        if freed < shortfall:  # something became busy between planning and evicting
            raise self._budget_error(needed, shortfall - freed, 0, pinned, busy, building, limit)
        return evicted

    def _try_evict(self, entry: Entry) -> str:
        """'evicted', 'gone' (someone else removed it) or 'busy' (in use, being built, or pinned now)."""
        build = FileLock(
            self.locks_dir / f"{entry.fingerprint}.lock", purpose=f"evicting {entry.fingerprint}"
        )
        if not build.acquire(blocking=False):
            return "busy"
        try:
            lock = DirLock(entry.path)
            if not lock.acquire(shared=False, blocking=False):
                return "busy" if entry.path.exists() else "gone"
            try:
                if not lock.same_as(entry.path):
                    return "gone"
                if (entry.path / PINNED).exists():  # pinned since we listed it
                    return "busy"
                target = self._to_trash(entry.path)
            finally:
                lock.release()
        finally:
            build.release()
        if target is None:
            return "gone"
        shutil.rmtree(target, ignore_errors=True)
        return "evicted"

    def _budget_error(
        self,
        needed: int,
        shortfall: int,
        evictable: int,
        pinned: list[Entry],
        busy: list[Entry],
        building: str | None,
        limit: str,
    ) -> BudgetError:
        def names(es: list[Entry]) -> str:
            return ", ".join(f"{e.fingerprint[:12]} ({human_size(e.size_bytes)})" for e in es) or "none"

        what = f"entry {building}" if building else "a new entry"
        available = max(0, needed - shortfall + evictable)
        return BudgetError(
            f"cannot make room for {what} of about {human_size(needed)} ({needed} bytes) within {limit}: "
            f"even after evicting every evictable entry only {human_size(available)} ({available} bytes) "
            f"would be available. Not evictable — pinned: {names(pinned)}; in use or being built: "
            f"{names(busy)}. Unpin or remove entries, stop readers, raise the budget, or free disk space.",
            needed=needed,
            available=available,
            pinned=tuple(e.fingerprint for e in pinned),
            in_use=tuple(e.fingerprint for e in busy),
        )

    # ------------------------------------------------------------------ maintenance
    def gc(self) -> GcReport:
        """Remove abandoned staging directories (not locked by a live builder), trash and stale lock files.

        Note this discards the partial work a later ``resume=True`` build could have reused.
        """
        report = GcReport()
        for child in sorted(self.staging_dir.iterdir()):
            if not _FINGERPRINT.fullmatch(child.name):
                continue
            lock = FileLock(self.locks_dir / f"{child.name}.lock", purpose="cache gc")
            if not lock.acquire(blocking=False):
                continue  # a live build (this process or another) owns it
            try:
                size = _tree_bytes(child)
                shutil.rmtree(child, ignore_errors=True)
                if not child.exists():
                    report.staging.append(child.name)
                    report.bytes_freed += size
            finally:
                lock.release()
        fsync_dir(self.staging_dir)
        for child in sorted(self.trash_dir.iterdir()):
            size = _tree_bytes(child) if child.is_dir() else child.stat().st_size
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            if not child.exists():
                report.trash += 1
                report.bytes_freed += size
        for child in sorted(self.locks_dir.iterdir()):
            if not child.name.endswith(".lock") or not child.is_file():
                continue
            lock = FileLock(child, purpose="cache gc")
            if lock.acquire(blocking=False):  # nobody holds it: a leftover of a crashed process
                lock.release(unlink=True)
                report.locks.append(child.name)
        return report

    def verify(self, fingerprint: str) -> VerifyReport:
        """Check an entry: manifest files present with their recorded sizes, every zarr chunk decodes.

        Reads the whole entry once. Problems name the entry, the file and, for chunks,
        the hierarchy, array and chunk index (see :class:`stores.verify.Problem`).
        """
        path = self._entry_path(fingerprint)
        entry = _read_entry(path, fingerprint)
        if entry is None:
            raise StoreNotFoundError(f"no complete entry {fingerprint} in the catalog at {self.root}")
        return verify_entry(fingerprint, path, entry.files, self._payload_on_disk(path))

    @staticmethod
    def _payload_on_disk(path: Path) -> list[tuple[str, int]]:
        try:
            return _payload_files(path)
        except CatalogError:  # a foreign symlink or odd name: list what is there anyway
            out = []
            for dirpath, _dirnames, filenames in os.walk(path):
                for name in filenames:
                    rel = Path(dirpath, name).relative_to(path).as_posix()
                    if rel not in BOOKKEEPING:
                        out.append((rel, os.lstat(os.path.join(dirpath, name)).st_size))
            return sorted(out)

    def content_hash(self, fingerprint: str) -> str:
        """sha256 over the entry's sorted payload paths and bytes (see :func:`hash_payload`)."""
        path = self._entry_path(fingerprint)
        if _read_entry(path, fingerprint) is None:
            raise StoreNotFoundError(f"no complete entry {fingerprint} in the catalog at {self.root}")
        return hash_payload(path)

    def reseal(self, fingerprint: str) -> Entry:
        """Re-record the payload files and sizes in the manifest after an in-place repair.

        Only needed when repaired chunks are not byte-identical to the originals (their
        compressed size changed). The manifest is replaced atomically; the rest is kept.
        """
        path = self._entry_path(fingerprint)
        entry = _read_entry(path, fingerprint)
        if entry is None:
            raise StoreNotFoundError(f"no complete entry {fingerprint} in the catalog at {self.root}")
        files = _payload_files(path)
        manifest = dict(entry.manifest)
        manifest["files"] = [{"path": rel, "size": size} for rel, size in files]
        manifest["size_bytes"] = sum(size for _, size in files)
        manifest["resealed"] = datetime.now(timezone.utc).isoformat()
        atomic_write_bytes(path / MANIFEST, _to_json(manifest, f"manifest of {fingerprint}"))
        resealed = _read_entry(path, fingerprint)
        assert resealed is not None
        return resealed

    def _publish(self, fingerprint: str, staged: Path) -> Entry:
        """Atomically move a sealed staging directory into entries/ (see Staging.commit)."""
        final = self.entries_dir / fingerprint
        existing = _read_entry(final, fingerprint)
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
            existing = _read_entry(final, fingerprint)  # another process published first
            if existing is None:
                raise CatalogError(
                    f"cannot publish {staged} as {final}: the target appeared concurrently without a "
                    "valid manifest; retry the build"
                ) from exc
            self._discard(staged)
            return existing
        fsync_dir(self.entries_dir)
        fsync_dir(self.staging_dir)
        entry = _read_entry(final, fingerprint)
        if entry is None:
            raise CatalogError(f"entry {final} was published but its manifest cannot be read back")
        return entry
