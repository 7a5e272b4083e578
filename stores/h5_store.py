"""A Store backed by one HDF5 file: keys are uint8 datasets, '/' components are HDF5 groups.

Why a single file: SD cards are often formatted FAT32/exFAT, where tens of thousands of small
files are slow to create, list and copy, and a cache that is one file can be moved, copied or
deleted in one step. ``H5Store`` follows the :mod:`stores.abc` contract exactly (it passes
``stores.testing.StoreTests``), so it can replace :class:`stores.local.LocalStore` anywhere.

Layout: key ``a/b/c`` is the 1-D ``uint8`` dataset ``/a/b/c`` (contiguous, no filters), so
``h5py.File(path)["a/b/c"][()].tobytes()`` returns the value with no help from this module.
Groups emptied by ``delete`` are removed, so a former parent can later hold a value.

Crash safety -- weaker than LocalStore, read this before choosing it:

- Every ``set``/``delete`` is followed by ``H5Fflush`` and (``fsync=True``, the default) an
  ``fsync`` of the file, so a completed call is on disk and visible to a store opened later.
- If the *process* is killed (Ctrl-C, OOM killer, SIGKILL), the operating system still writes
  what HDF5 handed it: a reopened store holds every completed ``set``/``delete``; one in flight
  may be missing. (The file is created with the default superblock, not ``libver="latest"``,
  whose "file is open for writing" flag would make a killed writer's file unopenable until
  ``h5clear``.)
- If *power is lost* during a write, HDF5 has no journal: its metadata (B-trees, heaps,
  superblock) can be left half-written, and then the **whole file** may be unreadable, not just
  the key being written. Opening then fails with :class:`H5StoreError`; the remedy is to delete
  the file and rebuild the cache (``h5repack``/``h5clear`` may salvage some data). Use
  ``LocalStore`` (atomic rename per key) where surviving power cuts matters more than file count.
- A replacement value is written under a temporary name first and swapped in afterwards, so an
  error while writing it (disk full, I/O error) leaves the old value intact.

Concurrency: one writer per file (HDF5 locks the file; a second process opening it for writing,
or for reading while a writer holds it, gets :class:`H5StoreError`). Threads of one process may
share a store (calls are serialised by a lock). h5py handles do not survive ``fork``: the file
is opened lazily per process; a child process reopens it itself. An object can be pickled (path
and mode only) and used in a spawned process. A *writable* store inherited through ``fork`` refuses
to work in the child (two writers would corrupt the file): open a read-only store there, after
the parent has closed its writable one.

Space: HDF5 reuses space freed by deletes/overwrites (the free-space manager is persisted in the
file), but never shrinks the file; ``h5repack`` compacts it.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from stores.abc import Store, is_valid_key, validate_key, validate_prefix
from stores.errors import KeyConflictError, StoreError, StoreNotFoundError

__all__ = ["H5Store", "H5StoreError"]

# '~' can never appear in a valid key, so a temporary dataset is never mistaken for a stored key.
_TMP_PREFIX = "~tmp-"
# Handles inherited through fork are parked here: closing them in the child could write the
# parent's file (superblock, free-space info), and merely dropping them would close them on GC.
_INHERITED: list[Any] = []
# Resolved path -> (pid, handle) of writable handles this process (or, after fork, its parent)
# opened. HDF5's own file lock cannot catch a forked child: the child inherits the library's
# open-file table and a reopen silently shares the parent's handle, i.e. two writers.
_WRITERS: dict[str, tuple[int, weakref.ref[Any]]] = {}


class H5StoreError(StoreError, OSError):
    """The HDF5 file cannot be used as a store: not HDF5, damaged, locked by another writer, or a
    writable handle was inherited by a forked child."""


class H5Store(Store):
    """Keys are uint8 datasets in the HDF5 file ``path`` (see the module docstring for guarantees)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        read_only: bool = False,
        create: bool = True,
        *,
        fsync: bool = True,
    ) -> None:
        self.path = Path(path)
        self._read_only = read_only
        self._create = create
        self._fsync = fsync
        self._handle: h5py.File | None = None
        self._pid: int | None = None
        self._locks: dict[int, threading.RLock] = {}
        if self.path.is_dir():
            raise StoreNotFoundError(f"store file {self.path} exists but is a directory, not an HDF5 file")
        if not self.path.exists() and (not create or read_only):
            why = "create=False" if not create else "the store was opened read_only"
            raise StoreNotFoundError(
                f"HDF5 store file {self.path} does not exist and was not created ({why}); "
                "check the path or open it with create=True"
            )
        with self._lock():
            self._file()  # fail now (not on the first get) if the file is not HDF5 or is locked

    def __repr__(self) -> str:
        mode = "read-only" if self._read_only else "read-write"
        return f"H5Store({str(self.path)!r}, {mode})"

    # ----------------------------------------------------------------- process/handle management

    def __getstate__(self) -> dict[str, Any]:
        # Only what is needed to reopen: an HDF5 handle or a lock cannot cross a process boundary.
        return {"path": self.path, "read_only": self._read_only, "create": self._create, "fsync": self._fsync}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._read_only = state["read_only"]
        self._create = state["create"]
        self._fsync = state["fsync"]
        self._handle = None
        self._pid = None
        self._locks = {}

    def _lock(self) -> threading.RLock:
        """This process's lock (a lock inherited through fork may be held by a thread that is gone)."""
        pid = os.getpid()
        lock = self._locks.get(pid)
        if lock is None:
            lock = self._locks.setdefault(pid, threading.RLock())  # setdefault is atomic under the GIL
        return lock

    def _file(self) -> h5py.File:
        """The HDF5 handle of the current process, opened on first use; call with the lock held."""
        pid = os.getpid()
        if self._pid == pid and self._handle is not None:
            return self._handle
        if self._handle is not None:  # opened by the parent before a fork
            inherited, self._handle = self._handle, None
            _INHERITED.append(inherited)
            if not self._read_only:
                raise H5StoreError(
                    f"{self!r} was opened for writing in process {self._pid} and inherited by child "
                    f"process {pid} through fork; HDF5 allows one writer per file. Close it before "
                    "forking and open a read-only H5Store in the child."
                )
        self._handle = self._open()
        self._pid = pid
        return self._handle

    def _open(self) -> h5py.File:
        writer = _WRITERS.get(str(self.path.resolve()))
        if writer is not None and writer[0] != os.getpid():
            handle = writer[1]()
            if handle is not None and handle.id.valid:
                raise H5StoreError(
                    f"cannot open HDF5 store file {self.path} in process {os.getpid()}: process "
                    f"{writer[0]} had it open for writing when it forked this one, and HDF5 allows one "
                    "writer and no readers beside it. Close the writable H5Store before forking."
                )
        handle = self._open_file()
        if not self._read_only:
            _WRITERS[str(self.path.resolve())] = (os.getpid(), weakref.ref(handle))
        return handle

    def _open_file(self) -> h5py.File:
        try:
            if self._read_only:
                return h5py.File(self.path, "r")
            if self.path.exists():
                return h5py.File(self.path, "r+")
            if not self._create:
                raise StoreNotFoundError(f"HDF5 store file {self.path} no longer exists (create=False)")
            # fs_persist keeps the free-space map in the file, so space freed by a delete in one
            # session is reused in the next instead of the file growing forever.
            handle = h5py.File(self.path, "w-", fs_strategy="fsm", fs_persist=True, fs_threshold=1)
            self._durable(handle)
            return handle
        except StoreError:
            raise
        except (OSError, ValueError) as exc:
            mode = "read-only" if self._read_only else "read-write"
            raise H5StoreError(
                f"cannot open HDF5 store file {self.path} ({mode}): {exc}. Expected an HDF5 file not "
                "held open for writing by another process (HDF5 allows one writer, and no readers "
                "beside a writer); if a power cut damaged it, delete it and rebuild the cache."
            ) from exc

    def _durable(self, handle: h5py.File) -> None:
        handle.flush()
        if self._fsync:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)  # fsync flushes the inode's dirty pages whichever descriptor wrote them
            finally:
                os.close(fd)

    def close(self) -> None:
        """Close this process's handle (e.g. before another process opens the file for writing).

        The store stays usable: the next call reopens the file.
        """
        with self._lock():
            if self._handle is not None and self._pid == os.getpid():
                self._handle.close()
            self._handle = None
            self._pid = None

    def __enter__(self) -> H5Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- Store API

    @property
    def read_only(self) -> bool:
        return self._read_only

    def _node(self, f: h5py.File, key: str) -> Any:
        """The object at ``key`` or None; never follows a path through a dataset."""
        node: Any = f
        for part in key.split("/"):
            if not isinstance(node, h5py.Group) or part not in node:
                return None
            node = node[part]
        return node

    def get(self, key: str) -> bytes | None:
        validate_key(key)
        with self._lock():
            node = self._node(self._file(), key)
            if not isinstance(node, h5py.Dataset):
                return None
            return node[()].tobytes()

    def exists(self, key: str) -> bool:
        validate_key(key)
        with self._lock():
            return isinstance(self._node(self._file(), key), h5py.Dataset)

    def set(self, key: str, value: bytes) -> None:
        validate_key(key)
        self._check_writable("set", key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"value for key {key!r} must be bytes, got {type(value).__name__}")
        data = np.frombuffer(memoryview(value).cast("B"), dtype=np.uint8)
        parts = key.split("/")
        with self._lock():
            f = self._file()
            group: h5py.Group = f
            for i, part in enumerate(parts[:-1]):
                child = group.get(part)
                if isinstance(child, h5py.Dataset):
                    raise KeyConflictError(
                        f"cannot set key {key!r}: {'/'.join(parts[: i + 1])!r} already holds a value, "
                        "so it cannot also be a parent of other keys"
                    )
                if child is None:
                    break
                group = child
            existing = self._node(f, key)
            if isinstance(existing, h5py.Group) and not _only_leftovers(existing):
                example = next(self._walk(existing, key + "/"), None) or key + "/..."
                raise KeyConflictError(
                    f"cannot set key {key!r}: it is the parent of other keys (e.g. {example!r})"
                )
            parent = f.require_group("/".join(parts[:-1])) if len(parts) > 1 else f
            tmp = f"{_TMP_PREFIX}{secrets.token_hex(6)}"
            try:
                parent.create_dataset(tmp, data=data, dtype=np.uint8)
            except BaseException:
                if tmp in parent:
                    del parent[tmp]
                raise
            if parts[-1] in parent:  # the old value, or a group holding only leftovers
                del parent[parts[-1]]
            parent.move(tmp, parts[-1])
            self._durable(f)

    def delete(self, key: str) -> None:
        validate_key(key)
        self._check_writable("delete", key)
        with self._lock():
            f = self._file()
            if not isinstance(self._node(f, key), h5py.Dataset):
                return
            del f[key]
            # Remove groups the delete left empty, so 'a' can hold a value once 'a/b' is gone.
            parts = key.split("/")[:-1]
            while parts:
                name = "/".join(parts)
                if len(f[name]) > 0:
                    break
                del f[name]
                parts.pop()
            self._durable(f)

    def list_prefix(self, prefix: str) -> Iterator[str]:
        validate_prefix(prefix)
        head, _, _ = prefix.rpartition("/")
        with self._lock():
            start = self._node(self._file(), head) if head else self._file()
            if not isinstance(start, h5py.Group):
                return iter(())
            # Materialise under the lock: a generator suspended while another thread deletes
            # members would walk a changing tree.
            keys = [k for k in self._walk(start, head + "/" if head else "") if k.startswith(prefix)]
        return iter(keys)

    def _walk(self, group: h5py.Group, base: str) -> Iterator[str]:
        for name in sorted(group):
            if not is_valid_key(name):
                continue  # temporary datasets and foreign names are not keys
            node = group.get(name)
            if isinstance(node, h5py.Group):
                yield from self._walk(node, f"{base}{name}/")
            elif isinstance(node, h5py.Dataset):
                yield base + name


def _only_leftovers(group: h5py.Group) -> bool:
    """True if ``group`` holds nothing but empty groups and temporary datasets of interrupted sets.

    Such a group can be replaced by a value; anything else (keys, or objects another program put
    in the file) makes the name a parent and is never deleted behind the caller's back.
    """
    for name in group:
        node = group.get(name)
        if isinstance(node, h5py.Group):
            if not _only_leftovers(node):
                return False
        elif not name.startswith(_TMP_PREFIX):
            return False
    return True
