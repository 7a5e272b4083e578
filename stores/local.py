"""A directory-backed Store whose writes survive power loss, plus the durability helpers behind it.

The cache often lives on an SD card of a device whose power can be cut at any moment.
A value must therefore be either fully the old bytes or fully the new bytes after a
crash, never a torn mix. ``atomic_write_bytes`` gets that from the classic recipe:
write a temp file in the same directory (same filesystem, so the rename is atomic),
fsync it, ``os.replace`` it over the target, then fsync the directory so the rename
itself is on disk.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from stores.abc import Store, is_valid_key, validate_key, validate_prefix
from stores.errors import KeyConflictError, StoreNotFoundError

# '~' can never appear in a valid key, so temp files can never be mistaken for (or
# collide with) stored keys, and listing skips them without bookkeeping.
TEMP_MARKER = ".~tmp-"

# Filesystems that cannot fsync a directory say so with one of these; there is nothing
# more we can do there, and failing every write would make the store unusable.
_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EBADF}

# errno values meaning "no space left": a full disk, or a full quota.
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes on the filesystem holding ``path`` (or its nearest existing parent); None if unknown."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (new, renamed or removed names) to stable storage."""
    if os.name == "nt":  # Windows cannot open directories; NTFS journals metadata itself.
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file written by someone else (e.g. zarr) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file and directory under ``root`` (children before parents), then ``root``."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def makedirs_durable(path: str | os.PathLike[str]) -> None:
    """Create ``path`` and missing parents, fsyncing each parent so the new names survive a crash."""
    path = Path(path)
    missing: list[Path] = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for new in reversed(missing):
        try:
            new.mkdir()
        except FileExistsError:
            continue  # created concurrently by another writer; it is someone else's to fsync
        fsync_dir(new.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | bytearray | memoryview) -> None:
    """Replace ``path`` with ``data`` so that after a crash it holds either the old or the new bytes."""
    path = Path(path)
    while True:
        tmp = path.parent / f"{TEMP_MARKER}{secrets.token_hex(6)}"
        try:
            # O_EXCL: never truncate a temp file another writer is using; 0o666 lets umask
            # decide permissions like a normal open() would (mkstemp would force 0600).
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            continue
        break
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


class LocalStore(Store):
    """Keys are files under ``root``; 'a/b' is the file ``root/a/b``."""

    def __init__(self, root: str | os.PathLike[str], read_only: bool = False, create: bool = True) -> None:
        self.root = Path(root)
        self._read_only = read_only
        if self.root.exists() and not self.root.is_dir():
            raise StoreNotFoundError(f"store root {self.root} exists but is a file, not a directory")
        if not self.root.exists():
            if not create or read_only:
                why = "create=False" if not create else "the store was opened read_only"
                raise StoreNotFoundError(
                    f"store directory {self.root} does not exist and was not created ({why}); "
                    "check the path or open it with create=True"
                )
            makedirs_durable(self.root)

    def __repr__(self) -> str:
        mode = "read-only" if self._read_only else "read-write"
        return f"LocalStore({str(self.root)!r}, {mode})"

    @property
    def read_only(self) -> bool:
        return self._read_only

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except PermissionError:
            if path.is_dir():  # Windows and macOS report opening a directory as EACCES
                return None
            raise

    def set(self, key: str, value: bytes) -> None:
        self._check_writable("set", key)
        path = self._path(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"value for key {key!r} must be bytes, got {type(value).__name__}")
        parts = key.split("/")
        for i in range(1, len(parts)):
            ancestor = self.root.joinpath(*parts[:i])
            if ancestor.is_file():
                raise KeyConflictError(
                    f"cannot set key {key!r}: {'/'.join(parts[:i])!r} already holds a value, "
                    "so it cannot also be a parent of other keys"
                )
        if path.is_dir():
            child = next(iter(self.list_prefix(key + "/")), None)
            if child is not None or not _remove_empty_tree(path):
                raise KeyConflictError(
                    f"cannot set key {key!r}: it is the parent of other keys (e.g. {child or key + '/...'!r})"
                )
        makedirs_durable(path.parent)
        atomic_write_bytes(path, value)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._check_writable("delete", key)
        path = self._path(key)
        if not path.is_file():
            return
        try:
            path.unlink()
        except FileNotFoundError:
            return  # deleted concurrently; the outcome is the same
        fsync_dir(path.parent)

    def list_prefix(self, prefix: str) -> Iterator[str]:
        validate_prefix(prefix)
        # Only walk the deepest directory the prefix fully names, not the whole store.
        head, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        base = head + "/" if head else ""
        if not start.is_dir():
            return
        for key in self._walk(start, base):
            if key.startswith(prefix):
                yield key

    def _walk(self, directory: Path, base: str) -> Iterator[str]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except FileNotFoundError:
            return  # removed while listing
        for entry in entries:
            if not is_valid_key(entry.name):
                continue  # temp files and foreign names are not keys
            if entry.is_dir(follow_symlinks=False):
                yield from self._walk(Path(entry.path), f"{base}{entry.name}/")
            elif entry.is_file(follow_symlinks=False):
                yield base + entry.name


def _remove_empty_tree(path: Path) -> bool:
    """Remove a directory tree holding no files (left behind by deletes); False if anything remains."""
    for dirpath, _dirnames, _filenames in os.walk(path, topdown=False):
        try:
            os.rmdir(dirpath)
        except OSError:
            return False  # a non-key file (e.g. an in-flight temp file) lives there
    fsync_dir(path.parent)
    return True
