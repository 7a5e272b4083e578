"""Keeping a catalog healthy: garbage collection, verification, content hashes and resealing.

``gc`` removes what crashes leave behind (abandoned staging directories, trash, stale
lock files); ``verify`` reads an entry whole and names every problem; ``content_hash`` is
what two builds of one fingerprint are compared by; ``reseal`` re-records the payload
after an in-place repair.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from stores.durable import atomic_write_bytes, fsync_dir
from stores.errors import CatalogError, DamagedEntryError, EntryInUseError, StoreNotFoundError
from stores.lock import FileLock
from stores.manifest import (
    BOOKKEEPING,
    FINGERPRINT,
    MANIFEST,
    Entry,
    file_records,
    hash_payload,
    human_size,
    manifest_problem,
    payload_checksums,
    payload_files,
    read_entry,
    to_json,
    tree_bytes,
)
from stores.verify import VerifyReport, verify_entry

if TYPE_CHECKING:
    from stores.catalog import Catalog


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


def gc(catalog: Catalog) -> GcReport:
    """Remove abandoned staging directories (not locked by a live builder), trash and stale lock files.

    Note this discards the partial work a later ``resume=True`` build could have reused.
    """
    report = GcReport()
    for child in sorted(catalog.staging_dir.iterdir()):
        if not FINGERPRINT.fullmatch(child.name):
            continue
        lock = FileLock(catalog.locks_dir / f"{child.name}.lock", purpose="cache gc")
        if not lock.acquire(blocking=False):
            continue  # a live build (this process or another) owns it
        try:
            size = tree_bytes(child)
            shutil.rmtree(child, ignore_errors=True)
            if not child.exists():
                report.staging.append(child.name)
                report.bytes_freed += size
        finally:
            lock.release()
    fsync_dir(catalog.staging_dir)
    for child in sorted(catalog.trash_dir.iterdir()):
        size = tree_bytes(child) if child.is_dir() else child.stat().st_size
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
        if not child.exists():
            report.trash += 1
            report.bytes_freed += size
    for child in sorted(catalog.locks_dir.iterdir()):
        if not child.name.endswith(".lock") or not child.is_file():
            continue
        lock = FileLock(child, purpose="cache gc")
        if lock.acquire(blocking=False):  # nobody holds it: a leftover of a crashed process
            lock.release(unlink=True)
            report.locks.append(child.name)
    return report

def discard_damaged(catalog: Catalog, damaged: DamagedEntryError) -> str:
    """Remove the entry ``damaged`` names (its files did not match their checksums) so it can be rebuilt
    under the same fingerprint; returns what was wrong. Re-raises ``damaged`` while a reader holds it."""
    try:
        catalog.remove(damaged.fingerprint)
    except EntryInUseError:
        raise damaged from None
    return f"{', '.join(damaged.files)} did not match the checksum recorded when it was stored"


def damaged_manifests(catalog: Catalog) -> list[tuple[str, Path, str]]:
    """(fingerprint, path, what is wrong) of every entry directory with a damaged manifest.json."""
    out = []
    for child in sorted(catalog.entries_dir.iterdir()):
        if child.is_dir() and FINGERPRINT.fullmatch(child.name):
            problem = manifest_problem(child, child.name)
            if problem is not None:
                out.append((child.name, child, problem))
    return out


def verify(catalog: Catalog, fingerprint: str) -> VerifyReport:
    """Check an entry: manifest files present with their recorded sizes, every zarr chunk decodes.

    Reads the whole entry once. Problems name the entry, the file and, for chunks,
    the hierarchy, array and chunk index (see :class:`stores.verify.Problem`).
    """
    path = catalog._entry_path(fingerprint)
    entry = read_entry(path, fingerprint)
    if entry is None:
        raise StoreNotFoundError(f"no complete entry {fingerprint} in the catalog at {catalog.root}")
    return verify_entry(fingerprint, path, entry.files, _payload_on_disk(path), entry.checksums)

def _payload_on_disk(path: Path) -> list[tuple[str, int]]:
    try:
        return payload_files(path)
    except CatalogError:  # a foreign symlink or odd name: list what is there anyway
        out = []
        for dirpath, _dirnames, filenames in os.walk(path):
            for name in filenames:
                rel = Path(dirpath, name).relative_to(path).as_posix()
                if rel not in BOOKKEEPING:
                    out.append((rel, os.lstat(os.path.join(dirpath, name)).st_size))
        return sorted(out)

def content_hash(catalog: Catalog, fingerprint: str) -> str:
    """sha256 over the entry's sorted payload paths and bytes (see :func:`hash_payload`)."""
    path = catalog._entry_path(fingerprint)
    if read_entry(path, fingerprint) is None:
        raise StoreNotFoundError(f"no complete entry {fingerprint} in the catalog at {catalog.root}")
    return hash_payload(path)

def reseal(catalog: Catalog, fingerprint: str) -> Entry:
    """Re-record the payload files, sizes and checksums in the manifest after an in-place repair.

    Only needed when repaired chunks are not byte-identical to the originals (their
    compressed size changed). The manifest is replaced atomically; the rest is kept.
    """
    path = catalog._entry_path(fingerprint)
    entry = read_entry(path, fingerprint)
    if entry is None:
        raise StoreNotFoundError(f"no complete entry {fingerprint} in the catalog at {catalog.root}")
    files = payload_files(path)
    manifest = dict(entry.manifest)
    manifest["files"] = file_records(files, payload_checksums(path, files))
    manifest["size_bytes"] = sum(size for _, size in files)
    manifest["resealed"] = datetime.now(timezone.utc).isoformat()
    atomic_write_bytes(path / MANIFEST, to_json(manifest, f"manifest of {fingerprint}"))
    resealed = read_entry(path, fingerprint)
    assert resealed is not None
    return resealed
