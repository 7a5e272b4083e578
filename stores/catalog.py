"""A content-addressed catalog of cached stage outputs, one directory per fingerprint.

Layout under ``root``::

    entries/<fp>/            complete entries; visible only once renamed here
    entries/<fp>/manifest.json   written last, inside staging, before the rename
    entries/<fp>/.last_used  mtime = last lookup; lets LRU eviction avoid rewriting the manifest
    staging/<fp>/            builds in progress; the path is deterministic per fingerprint so a
                             later chunk-level resume can find its own partial work
    trash/                   entries being removed; renamed here first so removal is atomic

Why this shape: a power cut can happen at any instant (SD cards on a Pi). The only
step that makes an entry visible is one ``rename`` of a fully fsynced directory that
already contains its manifest, so a reader sees either no entry or a complete one.
A directory in ``entries/`` without a parseable manifest is therefore never an entry.

Resume is not implemented yet: a leftover ``staging/<fp>`` (from a crash or a killed
run) is deleted the next time that fingerprint is staged and the build restarts from
scratch, with a :class:`StaleStagingWarning`. Locks are not implemented either: two
*processes* staging the same fingerprint at once would delete each other's staging
directory (the loser's commit fails with a clear error); within one process it is refused.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import threading
import warnings
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

from stores.abc import is_valid_key
from stores.errors import CatalogError, InvalidKeyError, StaleStagingWarning, StoreNotFoundError
from stores.local import atomic_write_bytes, fsync_dir, fsync_tree, makedirs_durable

FORMAT = "ondevice-tl-entry"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LAST_USED = ".last_used"
# Files the catalog owns inside an entry; they are not part of its payload or size.
BOOKKEEPING = frozenset({MANIFEST, LAST_USED})

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

    @property
    def files(self) -> dict[str, int]:
        """Payload files (relative '/' paths) and their sizes at commit time."""
        return {f["path"]: f["size"] for f in self.manifest["files"]}

    def describe(self) -> str:
        return (
            f"{self.fingerprint[:12]}  {self.kind}  "
            f"{human_size(self.size_bytes)} in {len(self.files)} files  "
            f"created {self.created:%Y-%m-%d %H:%M:%S} UTC  last used {self.last_used:%Y-%m-%d %H:%M:%S} UTC"
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
    return Entry(fingerprint, path, str(manifest["kind"]), lineage, created, last_used, size, manifest)


def _touch(path: Path) -> None:
    # Not fsynced and errors ignored on purpose: last-use is an eviction hint, not data, and a
    # lookup on a read-only mount (or a worn SD card) must still succeed.
    try:
        path.touch(exist_ok=True)
        os.utime(path)
    except OSError:
        pass


class Staging:
    """Context manager for building one entry; see :meth:`Catalog.stage`."""

    # Fingerprints being staged by this process, so two threads/builders cannot delete
    # each other's staging directory (cross-process locking is a later feature).
    _active: set[Path] = set()
    _active_lock = threading.Lock()

    def __init__(self, catalog: Catalog, fingerprint: str, kind: str, lineage: dict[str, Any]) -> None:
        self.catalog = catalog
        self.fingerprint = fingerprint
        self.kind = kind
        self.lineage = lineage
        self._path = catalog.staging_dir / fingerprint
        self._entered = False
        self._committed: Entry | None = None

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
            if self._path.exists():
                warnings.warn(
                    f"removing leftover staging directory {self._path} (from an interrupted build); "
                    f"entry {self.fingerprint} will be rebuilt from scratch",
                    StaleStagingWarning,
                    stacklevel=2,
                )
                shutil.rmtree(self._path)
            makedirs_durable(self._path)
        except BaseException:
            self._release()
            raise
        self._entered = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._committed is None:
                # Abandoned (exception, Ctrl-C, or simply no commit): leave nothing behind.
                shutil.rmtree(self._path, ignore_errors=True)
        finally:
            self._release()

    def _release(self) -> None:
        with Staging._active_lock:
            Staging._active.discard(self._path.resolve())

    def commit(self, extra_manifest: dict[str, Any] | None = None) -> Entry:
        """Seal the staged files into a visible entry and return it.

        ``extra_manifest`` (JSON-able) is stored under the manifest's ``"extra"`` key. If a
        complete entry for this fingerprint appeared meanwhile, this build is discarded and
        the existing entry returned: both are by definition the same content.
        """
        path = self.path
        if self._committed is not None:
            return self._committed
        if not path.is_dir():
            raise CatalogError(
                f"staging directory {path} disappeared before commit "
                "(removed by another process staging the same fingerprint?); re-run the build"
            )
        files = _payload_files(path)
        atomic_write_bytes(path / LAST_USED, b"")
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


def _to_json(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CatalogError(
            f"{what} is not JSON-serialisable (plain dict/list/str/number/bool only): {exc}"
        ) from None


class Catalog:
    """Entries keyed by fingerprint under ``root`` (see the module docstring for the layout)."""

    def __init__(self, root: str | os.PathLike[str], create: bool = True) -> None:
        self.root = Path(root)
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
        for sub in (self.entries_dir, self.staging_dir, self.trash_dir):
            if not sub.is_dir():
                makedirs_durable(sub)
        # Finish removals a crash interrupted; ignore_errors because another process may be doing the same.
        for leftover in self.trash_dir.iterdir():
            shutil.rmtree(leftover, ignore_errors=True)

    def __repr__(self) -> str:
        return f"Catalog({str(self.root)!r})"

    def exists(self, fingerprint: str) -> bool:
        """True if a complete entry exists; does not count as a use."""
        return _read_entry(self.entries_dir / validate_fingerprint(fingerprint), fingerprint) is not None

    def lookup(self, fingerprint: str) -> Entry | None:
        """The complete entry for ``fingerprint`` (marking it used), or None."""
        path = self.entries_dir / validate_fingerprint(fingerprint)
        entry = _read_entry(path, fingerprint)
        if entry is None:
            return None
        _touch(path / LAST_USED)
        return replace(entry, last_used=datetime.now(timezone.utc))

    def stage(self, fingerprint: str, kind: str, lineage: dict[str, Any]) -> Staging:
        """A context manager whose ``path`` receives the entry's files until ``commit()``.

        Usage::

            with catalog.stage(fp, "features", {"model": "mobilenet_v3"}) as staging:
                write_files(staging.path)
                entry = staging.commit()
        """
        validate_fingerprint(fingerprint)
        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            raise CatalogError(f"entry kind must be a short name of [A-Za-z0-9._-], got {kind!r}")
        if not isinstance(lineage, dict):
            raise CatalogError(f"lineage of {fingerprint} must be a dict, got {type(lineage).__name__}")
        # Round-trip now so an unserialisable lineage fails before hours of computing, not at commit.
        lineage = json.loads(_to_json(lineage, f"lineage of {fingerprint}"))
        return Staging(self, fingerprint, kind, lineage)

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

    def remove(self, fingerprint: str) -> bool:
        """Delete an entry (complete or not); False if there was nothing to remove."""
        path = self.entries_dir / validate_fingerprint(fingerprint)
        if not path.exists():
            return False
        self._discard(path)
        return True

    def _discard(self, path: Path) -> None:
        # Rename first so the entry disappears atomically; a crash mid-rmtree only leaves trash.
        target = self.trash_dir / f"{path.name}-{secrets.token_hex(4)}"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return  # removed concurrently
        fsync_dir(path.parent)
        shutil.rmtree(target, ignore_errors=True)

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
