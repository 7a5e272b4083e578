"""Cross-process locks for the catalog: one writer per fingerprint, many readers per entry.

Why ``flock`` and not a "lock file exists" scheme: a process killed with SIGKILL, or a
device losing power, cannot clean up after itself. The kernel drops an ``flock`` the
moment the last descriptor of its holder closes, so a crashed builder's lock vanishes
with it and nobody has to guess whether a leftover file is stale. The lock *file* may
stay behind (it is removed by a clean release, or by ``Catalog.gc``); its contents only
say who holds it, for messages like "waiting for pid 4711 on pi-03 (building entry ...)".

Two kinds of lock live here:

- :class:`FileLock` — exclusive, on a small file under ``<catalog>/locks/``. It records
  the holder (pid, host, pid namespace, start time, purpose). Because a released lock
  file is unlinked, an acquirer re-checks after locking that the path still names the
  file it locked (otherwise it locked an orphaned inode and retries).
- :class:`DirLock` — shared or exclusive, on an entry *directory* itself. Readers hold
  it shared for as long as they read (a whole training run); eviction and removal try
  it exclusive without blocking and skip entries they cannot get. Locking the directory
  needs no extra file, works on read-only mounts, and survives the rename to ``trash/``
  (so a reader can tell the entry it locked was removed meanwhile).

The one case ``flock`` alone gets wrong is a lock inherited across ``fork()`` (a data
loader worker outliving its killed parent keeps the parent's lock). A lock whose
recorded holder is a dead pid on this host, in this pid namespace, is therefore treated
as stale: its file is unlinked and a fresh one locked. This is confirmed over two reads
some time apart, because a new holder writes its record just after locking.

On platforms without ``fcntl`` (Windows) the locks are no-ops; the catalog still refuses
a second build of one fingerprint within a process.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType

from stores.errors import LockTimeoutError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

# How long a lock record naming a dead pid must stay unchanged before it is broken.
STALE_CONFIRM_SECONDS = 0.2
_POLL_MIN, _POLL_MAX = 0.01, 0.2


def _pid_namespace() -> str:
    """An id of this process's pid namespace ('' if unknown), so pids from containers are not compared."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """True if a process with ``pid`` exists here (zombies and other users' processes count as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True  # cannot tell: assume alive, waiting is the safe side
    return True


@dataclass(frozen=True)
class LockHolder:
    """Who holds a :class:`FileLock`, as recorded in the lock file by the holder itself."""

    pid: int
    host: str
    since: str  # ISO 8601 UTC
    purpose: str
    pid_namespace: str = ""

    def describe(self) -> str:
        what = f" ({self.purpose})" if self.purpose else ""
        return f"pid {self.pid} on {self.host} since {self.since}{what}"

    def is_dead_here(self) -> bool:
        """True only if the holder provably is gone: same host and pid namespace, pid not running."""
        if self.host != socket.gethostname():
            return False
        if self.pid_namespace and self.pid_namespace != _pid_namespace():
            return False
        return not pid_alive(self.pid)

    @classmethod
    def parse(cls, raw: bytes) -> LockHolder | None:
        try:
            data = json.loads(raw)
            return cls(
                int(data["pid"]),
                str(data["host"]),
                str(data["since"]),
                str(data.get("purpose", "")),
                str(data.get("pid_namespace", "")),
            )
        except (ValueError, TypeError, KeyError):
            return None  # empty (just created) or being rewritten: unknown holder


def _flock(fd: int, op: int) -> bool:
    """flock ``fd``; False if ``op`` has LOCK_NB and the lock is held elsewhere."""
    if fcntl is None:  # pragma: no cover - Windows
        return True
    try:
        fcntl.flock(fd, op)
    except BlockingIOError:
        return False
    return True


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)


_LOCK_EX = fcntl.LOCK_EX if fcntl is not None else 2
_LOCK_SH = fcntl.LOCK_SH if fcntl is not None else 1
_LOCK_NB = fcntl.LOCK_NB if fcntl is not None else 4


def _read_fd(fd: int) -> bytes:
    try:
        return os.pread(fd, 4096, 0)
    except (OSError, AttributeError):  # AttributeError: no pread on Windows
        return b""


class FileLock:
    """An exclusive, holder-recording lock on ``path`` (created on demand, unlinked on release).

    Not reentrant and not shared between threads: one ``FileLock`` object is one claim.
    Within a process two ``FileLock`` objects on the same path exclude each other too
    (``flock`` locks belong to the open file, not the process).
    """

    def __init__(self, path: str | os.PathLike[str], purpose: str = "") -> None:
        self.path = Path(path)
        self.purpose = purpose
        self._fd: int | None = None

    def __repr__(self) -> str:
        return f"FileLock({str(self.path)!r}, {'held' if self.held else 'free'})"

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def holder(self) -> LockHolder | None:
        """The holder recorded in the lock file right now (None if free, unknown or unreadable)."""
        try:
            return LockHolder.parse(self.path.read_bytes())
        except OSError:
            return None

    def acquire(
        self,
        *,
        blocking: bool = True,
        timeout: float | None = None,
        on_wait: Callable[[LockHolder | None], None] | None = None,
    ) -> bool:
        """Take the lock; False only if ``blocking`` is False and someone else holds it.

        While waiting, ``on_wait(holder)`` is called when the wait starts and again whenever
        the recorded holder changes (holder is None if it has not recorded itself yet).
        After ``timeout`` seconds :class:`LockTimeoutError` names the holder.
        """
        if self._fd is not None:
            raise RuntimeError(f"{self!r} is already held by this object; FileLock is not reentrant")
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = _POLL_MIN
        reported: object = object()  # sentinel: nothing reported yet
        suspect: tuple[int, bytes, float] | None = None  # (inode, record, first seen) of a dead holder
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            if _flock(fd, _LOCK_EX | _LOCK_NB):
                if self._is_current(fd):
                    self._fd = fd
                    self._record()
                    if self._is_current(fd):  # a stale-lock breaker may have unlinked it meanwhile
                        return True
                    self._fd = None
                    _unlock(fd)
                os.close(fd)
                continue  # locked an orphaned inode (released and unlinked under us): retry
            raw, inode = _read_fd(fd), os.fstat(fd).st_ino
            os.close(fd)
            holder = LockHolder.parse(raw)
            if holder is not None and holder.is_dead_here():
                now = time.monotonic()
                if suspect is not None and suspect[:2] == (inode, raw):
                    if now - suspect[2] >= STALE_CONFIRM_SECONDS:
                        self._break(inode)
                        suspect = None
                        continue
                else:
                    suspect = (inode, raw, now)
            else:
                suspect = None
            if not blocking:
                return False
            if on_wait is not None and holder != reported:
                on_wait(holder)
                reported = holder
            if deadline is not None and time.monotonic() >= deadline:
                who = holder.describe() if holder else "an unknown process"
                raise LockTimeoutError(
                    f"timed out after {timeout} s waiting for lock {self.path}"
                    f"{' (' + self.purpose + ')' if self.purpose else ''}: held by {who}",
                    holder.describe() if holder else None,
                )
            time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))
            poll = min(poll * 1.5, _POLL_MAX)

    def _is_current(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev)

    def _record(self) -> None:
        assert self._fd is not None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "pid_namespace": _pid_namespace(),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "purpose": self.purpose,
        }
        data = json.dumps(record).encode()
        try:
            # Not fsynced: a lock record is meaningless after a reboot, when every flock is gone anyway.
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
        except OSError:
            pass  # the record is only for messages; a full disk must not break locking

    def _break(self, inode: int) -> None:
        """Unlink a lock file held only by an orphan of a dead holder, if it is still that file."""
        try:
            if os.stat(self.path).st_ino == inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def release(self, unlink: bool = True) -> None:
        """Drop the lock; by default also remove the lock file (while still holding it, so no one
        can lock the file and then see it vanish)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if unlink and self._is_current(fd):
                try:
                    os.unlink(self.path)
                except OSError:
                    pass  # e.g. a read-only remount: the lock still goes away with the descriptor
        finally:
            try:
                _unlock(fd)
            finally:
                os.close(fd)

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        # A forgotten lock must not outlive its object (the descriptor would keep it held).
        if getattr(self, "_fd", None) is not None:
            try:
                self.release(unlink=False)
            except OSError:
                pass


class DirLock:
    """A shared or exclusive flock on a directory (an entry), identified by its inode.

    ``acquire`` returns False if the directory is gone or (with ``blocking=False``) the
    lock is held incompatibly. ``same_as(path)`` tells whether ``path`` still names the
    locked directory — False once it was renamed away (evicted or removed).

    The lock belongs to the process that took it. A forked child (a ``DataLoader`` worker)
    inherits the descriptor, and an flock lives on the shared open file: unlocking it there
    would drop the parent's lock. In the child, ``release`` (and garbage collection) only
    closes its copy of the descriptor.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None
        self._owner = 0  # pid of the process that took the lock
        self.shared = False

    def __repr__(self) -> str:
        state = ("shared" if self.shared else "exclusive") if self.held else "free"
        return f"DirLock({str(self.path)!r}, {state})"

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, *, shared: bool, blocking: bool) -> bool:
        if self._fd is not None:
            raise RuntimeError(f"{self!r} is already held by this object")
        if fcntl is None:  # pragma: no cover - Windows cannot open directories; no locking there
            try:
                st = os.stat(self.path)
            except OSError:
                return False
            self._fd, self._ident, self.shared = -1, (st.st_ino, st.st_dev), shared
            return True
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags)
        except (FileNotFoundError, NotADirectoryError):
            return False
        op = (_LOCK_SH if shared else _LOCK_EX) | (0 if blocking else _LOCK_NB)
        try:
            if not _flock(fd, op):
                os.close(fd)
                return False
        except BaseException:
            os.close(fd)
            raise
        st = os.fstat(fd)
        self._fd, self._ident, self.shared = fd, (st.st_ino, st.st_dev), shared
        self._owner = os.getpid()
        return True

    def same_as(self, path: str | os.PathLike[str]) -> bool:
        """True if ``path`` is (still) the directory this object holds locked."""
        if self._ident is None:
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_ino, st.st_dev) == self._ident

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None or fd < 0:
            return
        if self._owner != os.getpid():
            os.close(fd)  # a forked copy: the lock stays with the process that took it
            return
        try:
            _unlock(fd)
        finally:
            os.close(fd)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            try:
                self.release()
            except OSError:
                pass
