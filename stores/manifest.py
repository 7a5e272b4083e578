"""A catalog entry's manifest: what makes a directory an entry, and what its payload is.

An entry directory is an entry only if its ``manifest.json`` parses and names its
fingerprint; the manifest lists the payload files and sizes recorded at commit. Files the
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

    def describe(self) -> str:
        return (
            f"{self.fingerprint[:12]}  {self.kind}  "
            f"{human_size(self.size_bytes)} in {len(self.files)} files  "
            f"created {self.created:%Y-%m-%d %H:%M:%S} UTC  last used {self.last_used:%Y-%m-%d %H:%M:%S} UTC"
            + ("  pinned" if self.pinned else "")
        )


def read_entry(path: Path, fingerprint: str) -> Entry | None:
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


def to_json(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CatalogError(
            f"{what} is not JSON-serialisable (plain dict/list/str/number/bool only): {exc}"
        ) from None




def new_manifest(
    fingerprint: str, kind: str, lineage: dict[str, Any], files: list[tuple[str, int]], extra: dict[str, Any]
) -> dict[str, Any]:
    """The manifest a commit writes for ``files`` (sorted (relative path, size) pairs)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "kind": kind,
        "lineage": lineage,
        "created": datetime.now(timezone.utc).isoformat(),
        "size_bytes": sum(size for _, size in files),
        "files": [{"path": rel, "size": size} for rel, size in files],
        "extra": extra,
    }
