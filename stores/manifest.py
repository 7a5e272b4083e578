"""A catalog entry's manifest: what makes a directory an entry, and what its payload is.

An entry directory is an entry only if its ``manifest.json`` parses and names its
fingerprint; the manifest lists the payload files and sizes recorded at commit, and the
sha256 of every file that no codec checks on its own: model weights, results, zarr metadata,
an HDF5 file. (zarr chunks carry their own crc32c, checked whenever a chunk is read, so
hashing them again at commit would only double the writes' cost on a slow card.) Files the
catalog itself keeps in an entry (manifest, ``.last_used``, ``.pinned``) are bookkeeping:
not payload, not counted in sizes, not part of the content hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from stores.errors import CatalogError, InvalidKeyError
from stores.keys import is_valid_key

FORMAT = "ondevice-tl-entry"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LAST_USED = ".last_used"
PINNED = ".pinned"
# Files the catalog owns inside an entry; they are not part of its payload or size.
BOOKKEEPING = frozenset({MANIFEST, LAST_USED, PINNED})

# Lowercase only: FAT/exFAT SD cards are case-insensitive, so 'AB..' and 'ab..' would alias.
FINGERPRINT = re.compile(r"[0-9a-f]{16,128}")
KIND = re.compile(r"[A-Za-z0-9._-]+")
_REQUIRED = ("fingerprint", "kind", "lineage", "created", "size_bytes", "files")
# A zarr v3 chunk key ("c/0/3" under an array's directory): checked by its own crc32c codec.
_ZARR_CHUNK = re.compile(r"(^|/)c(/\d+)+$")
# Payload files too large to hash every time an entry is used: checked by `cache verify` only (their
# chunks are what a read touches).
BULK_FILES = frozenset({"entry.h5"})


def validate_fingerprint(fp: str) -> str:
    """Return ``fp`` if it is a lowercase hex digest of 16-128 characters, else raise InvalidKeyError."""
    if not isinstance(fp, str) or not FINGERPRINT.fullmatch(fp):
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

    @property
    def checksums(self) -> dict[str, str]:
        """Payload files -> sha256 hex digest recorded at commit (files no codec checks; entries
        committed before checksums were recorded have none)."""
        return {f["path"]: f["sha256"] for f in self.manifest["files"] if isinstance(f.get("sha256"), str)}

    def describe(self) -> str:
        return (
            f"{self.fingerprint[:12]}  {self.kind}  "
            f"{human_size(self.size_bytes)} in {len(self.files)} files  "
            f"created {self.created:%Y-%m-%d %H:%M:%S} UTC  last used {self.last_used:%Y-%m-%d %H:%M:%S} UTC"
            + ("  pinned" if self.pinned else "")
        )


def manifest_problem(path: Path, fingerprint: str) -> str | None:
    """Why ``path/manifest.json`` does not make ``path`` an entry of ``fingerprint`` (None when it does, or
    when there is no manifest at all: a build that never committed, which is no damage)."""
    try:
        raw = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"manifest.json cannot be read ({exc.strerror or exc})"
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"manifest.json is not valid JSON ({exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"manifest.json is not an {FORMAT} manifest"
    if manifest.get("format_version") != FORMAT_VERSION:
        found = manifest.get("format_version")
        return f"manifest.json has format_version {found!r}, expected {FORMAT_VERSION}"
    if manifest.get("fingerprint") != fingerprint:
        return f"manifest.json names fingerprint {str(manifest.get('fingerprint'))[:16]!r}, not this entry's"
    missing = [key for key in _REQUIRED if key not in manifest]
    if missing:
        return f"manifest.json lacks {', '.join(missing)}"
    try:
        datetime.fromisoformat(manifest["created"])
        int(manifest["size_bytes"])
    except (ValueError, TypeError) as exc:
        return f"manifest.json has a malformed field ({exc})"
    if not isinstance(manifest["lineage"], dict) or not isinstance(manifest["files"], list):
        return "manifest.json's lineage or files has the wrong type"
    if not all(isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
               for f in manifest["files"]):
        return "manifest.json's files list has malformed items"
    return None


def read_entry(path: Path, fingerprint: str) -> Entry | None:
    """Parse ``path/manifest.json``; None if absent or not a valid manifest for ``fingerprint``
    (:func:`manifest_problem` says why)."""
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
        if not all(isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
                   for f in manifest["files"]):
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


def tree_bytes(path: Path) -> int:
    """Apparent size of every file under ``path`` (0 if it vanished meanwhile)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def payload_files(root: Path) -> list[tuple[str, int]]:
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
    for rel, size in payload_files(root):
        digest.update(f"{rel}\0{size}\0".encode())
        with open(root / rel, "rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def needs_checksum(rel: str) -> bool:
    """True for a payload file no codec checks when it is read (everything but zarr chunks)."""
    return not _ZARR_CHUNK.search(rel)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def payload_checksums(root: Path, files: list[tuple[str, int]]) -> dict[str, str]:
    """sha256 of each of ``files`` (relative to ``root``) that :func:`needs_checksum`."""
    return {rel: file_sha256(root / rel) for rel, _ in files if needs_checksum(rel)}


def file_records(files: list[tuple[str, int]], checksums: dict[str, str]) -> list[dict[str, Any]]:
    """The manifest's ``files`` list: path, size and, where recorded, sha256."""
    out: list[dict[str, Any]] = []
    for rel, size in files:
        record: dict[str, Any] = {"path": rel, "size": size}
        if rel in checksums:
            record["sha256"] = checksums[rel]
        out.append(record)
    return out


def to_json(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CatalogError(
            f"{what} is not JSON-serialisable (plain dict/list/str/number/bool only): {exc}"
        ) from None




def new_manifest(
    fingerprint: str, kind: str, lineage: dict[str, Any], files: list[tuple[str, int]], extra: dict[str, Any],
    checksums: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The manifest a commit writes for ``files`` (sorted (relative path, size) pairs) and their
    ``checksums`` (:func:`payload_checksums`)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "kind": kind,
        "lineage": lineage,
        "created": datetime.now(timezone.utc).isoformat(),
        "size_bytes": sum(size for _, size in files),
        "files": file_records(files, checksums or {}),
        "extra": extra,
    }
