"""Durable files: writes that survive power loss, and the fsync helpers behind them.

The cache often lives on an SD card of a device whose power can be cut at any moment.
A file must therefore hold either fully the old bytes or fully the new bytes after a
crash, never a torn mix. :func:`atomic_write_bytes` gets that from the classic recipe:
write a temp file in the same directory (same filesystem, so the rename is atomic),
fsync it, ``os.replace`` it over the target, then fsync the directory so the rename
itself is on disk. Every durable write of this package (manifests, chunk files, zarr
metadata) goes through it.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path

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


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (a module-level hook, so tests can simulate a full disk)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def atomic_write_bytes(
    path: str | os.PathLike[str],
    data: bytes | bytearray | memoryview,
    *,
    sync_dir: bool = True,
    exclusive: bool = False,
    make_parents: bool = False,
) -> None:
    """Replace ``path`` with ``data`` so that after a crash it holds either the old or the new bytes.

    The one durable write of this package: a temp file in the same directory (same
    filesystem, so the rename is atomic), fsync, then rename over the final name.

    ``sync_dir``: also fsync the directory, so the new name itself survives a power cut.
    Chunk files skip it (one journal commit per chunk on an SD card): a chunk whose name did
    not survive is simply missing and rewritten on resume, and the catalog fsyncs the whole
    tree once at commit. ``exclusive``: raise :class:`FileExistsError` instead of replacing
    an existing file. ``make_parents``: create missing parent directories (not fsynced).
    The temp name starts with ``TEMP_MARKER`` (never a valid key), so leftovers are recognisable.
    """
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
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
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, path)  # raises FileExistsError instead of replacing
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync_dir:
        fsync_dir(path.parent)
