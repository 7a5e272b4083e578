"""Cross-process build locks: one builder per fingerprint, waiting, timeouts, stale locks, gc."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stores.catalog import Catalog
from stores.errors import CatalogError, LockTimeoutError
from stores.lock import FileLock, LockHolder, pid_alive

REPO = Path(__file__).resolve().parents[2]


def fp(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


# A builder that reports each step on stdout and, when it builds, waits for a line on stdin
# before writing, so the test controls the interleaving without timing assumptions.
BUILDER = """
import os, sys
from stores.catalog import Catalog
root, key, builds = sys.argv[1:4]
catalog = Catalog(root)
def on_wait(holder):
    print("waiting", holder.pid if holder else None, flush=True)
with catalog.stage(key, "features", {}, on_wait=on_wait) as staging:
    print("locked", flush=True)
    if staging.existing is None:
        with open(builds, "a") as fh:
            fh.write(f"{os.getpid()}\\n")
        sys.stdin.readline()
        (staging.path / "data.bin").write_bytes(b"built by one process" * 100)
        staging.commit()
    handle = catalog.use(key)
print("done", catalog.content_hash(key), flush=True)
handle.release()
"""

# Holds a lock or an entry until told to stop (a line on stdin).
HOLD_STAGING = """
import sys
from stores.catalog import Catalog
with Catalog(sys.argv[1]).stage(sys.argv[2], "features", {}, resume=True) as staging:
    (staging.path / "partial.bin").write_bytes(b"half")
    print("locked", flush=True)
    sys.stdin.readline()
"""


@contextmanager
def child(code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    text = proc.stdout.readline()
    assert text, f"child {proc.pid} exited early with {proc.wait(timeout=60)}"
    return text.strip()


def test_two_processes_build_the_same_fingerprint_once(tmp_path: Path) -> None:
    builds = tmp_path / "builds.txt"
    key = fp("shared")
    args = (str(tmp_path / "cache"), key, str(builds))
    with child(BUILDER, *args) as first:
        assert line(first) == "locked"
        with child(BUILDER, *args) as second:
            assert line(second) == f"waiting {first.pid}"  # it names who it waits for
            assert first.stdin is not None
            first.stdin.write("go\n")
            first.stdin.flush()
            done_first = line(first)
            assert line(second) == "locked"
            done_second = line(second)
            assert second.wait(timeout=60) == 0
        assert first.wait(timeout=60) == 0
    assert done_first == done_second and done_first.startswith("done ")
    assert builds.read_text().split() == [str(first.pid)]
    catalog = Catalog(tmp_path / "cache")
    assert [e.fingerprint for e in catalog.entries()] == [key]
    assert list((tmp_path / "cache" / "staging").iterdir()) == []
    assert list((tmp_path / "cache" / "locks").iterdir()) == []  # released locks leave no files


def test_waiting_times_out_naming_the_holder(tmp_path: Path) -> None:
    key = fp("slow")
    with child(HOLD_STAGING, str(tmp_path), key) as holder:
        assert line(holder) == "locked"
        seen: list[LockHolder | None] = []
        with pytest.raises(LockTimeoutError, match=f"pid {holder.pid} on {socket.gethostname()}") as info:
            with Catalog(tmp_path).stage(key, "features", {}, wait_timeout=0.3, on_wait=seen.append):
                pass
        assert f"building entry {key}" in str(info.value)
        assert [h.pid for h in seen if h is not None] == [holder.pid]
        assert isinstance(info.value, TimeoutError) and info.value.holder is not None
        # the waiter did not touch the holder's staging directory
        assert (tmp_path / "staging" / key / "partial.bin").read_bytes() == b"half"


def test_killed_holder_releases_its_lock_and_the_build_resumes(tmp_path: Path) -> None:
    key = fp("crash")
    with child(HOLD_STAGING, str(tmp_path), key) as holder:
        assert line(holder) == "locked"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    lock_file = tmp_path / "locks" / f"{key}.lock"
    assert json.loads(lock_file.read_text())["pid"] == holder.pid  # left behind, but not held
    with Catalog(tmp_path).stage(key, "features", {}, resume=True, wait_timeout=5) as staging:
        assert staging.resumed and (staging.path / "partial.bin").read_bytes() == b"half"
        (staging.path / "partial.bin").write_bytes(b"whole")
        entry = staging.commit()
    assert entry.files == {"partial.bin": 5}


# Holds the flock but records a dead pid: what a fork()ed worker outliving its killed parent leaves.
ORPHAN = """
import fcntl, json, os, socket, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
record = {"pid": int(sys.argv[2]), "host": socket.gethostname(), "since": "2024-01-01T00:00:00+00:00",
          "purpose": "building", "pid_namespace": os.readlink("/proc/self/ns/pid")}
os.pwrite(fd, json.dumps(record).encode(), 0)
print("locked", flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="needs Linux /proc")
def test_lock_recorded_by_a_dead_pid_is_broken(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    assert not pid_alive(dead.pid)
    key = fp("orphan")
    Catalog(tmp_path)
    with child(ORPHAN, str(tmp_path / "locks" / f"{key}.lock"), str(dead.pid)) as orphan:
        assert line(orphan) == "locked"
        with Catalog(tmp_path).stage(key, "features", {}, wait_timeout=30) as staging:
            (staging.path / "f").write_bytes(b"1")
            staging.commit()
    assert Catalog(tmp_path).exists(key)


def test_live_holder_is_never_broken(tmp_path: Path) -> None:
    lock = FileLock(tmp_path / "x.lock", purpose="test")
    assert lock.acquire()
    holder = lock.holder()
    assert holder is not None and holder.pid == os.getpid() and not holder.is_dead_here()
    other = FileLock(tmp_path / "x.lock")
    assert other.acquire(blocking=False) is False  # flock excludes a second open file, even in-process
    lock.release()
    assert not (tmp_path / "x.lock").exists()
    assert other.acquire(blocking=False) is True
    other.release()


def test_same_fingerprint_in_one_process_is_still_refused(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    with catalog.stage(fp("a"), "k", {}):
        with pytest.raises(CatalogError, match="already being staged in this process"):
            with catalog.stage(fp("a"), "k", {}, wait_timeout=0.1):
                pass


def test_existing_entry_is_reported_and_reused(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    with catalog.stage(fp("a"), "k", {}) as staging:
        assert staging.existing is None
        (staging.path / "f").write_bytes(b"1")
        first = staging.commit()
    with catalog.stage(fp("a"), "k", {}) as staging:
        assert staging.existing is not None and staging.existing.path == first.path
        # a caller that ignores `existing` and builds again still ends with the one entry
        (staging.path / "f").write_bytes(b"1")
        assert staging.commit().path == first.path
    assert list((tmp_path / "staging").iterdir()) == []


def test_gc_removes_abandoned_staging_trash_and_stale_locks(tmp_path: Path) -> None:
    key_dead, key_live = fp("dead"), fp("live")
    with child(HOLD_STAGING, str(tmp_path), key_dead) as dead:
        assert line(dead) == "locked"
        dead.send_signal(signal.SIGKILL)
    with child(HOLD_STAGING, str(tmp_path), key_live) as live:
        assert line(live) == "locked"
        catalog = Catalog(tmp_path)
        (tmp_path / "trash" / "old-entry").mkdir()  # as a crash in the middle of a removal leaves it
        (tmp_path / "trash" / "old-entry" / "blob").write_bytes(b"x" * 100)
        (tmp_path / "locks" / f"{fp('other')}.lock").write_text("{}")
        assert (tmp_path / "locks" / f"{key_dead}.lock").exists()
        report = catalog.gc()
        assert report.staging == [key_dead]
        assert report.trash == 1 and report.bytes_freed == 4 + 100
        assert report.locks == [f"{fp('other')}.lock"]
        assert not (tmp_path / "locks" / f"{key_dead}.lock").exists()  # went with its staging dir
        assert "freed 104 B" in report.describe()
        # the live build keeps its staging directory and its lock
        assert (tmp_path / "staging" / key_live / "partial.bin").exists()
        assert (tmp_path / "locks" / f"{key_live}.lock").exists()
        assert live.stdin is not None
        live.stdin.write("\n")
        live.stdin.flush()
        assert live.wait(timeout=60) == 0
    # the live build ended without an error and without commit: it removed its own staging dir
    assert Catalog(tmp_path).gc().staging == []


def test_staging_is_kept_on_error_with_resume_and_removed_without(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with catalog.stage(fp("a"), "k", {}, resume=True) as staging:
                (staging.path / "part.bin").write_bytes(b"p")
                raise exc
        assert (tmp_path / "staging" / fp("a") / "part.bin").exists()
    with catalog.stage(fp("a"), "k", {}, resume=True) as staging:
        assert staging.resumed
        # leaving without commit and without error: nothing worth resuming, removed
    assert not (tmp_path / "staging" / fp("a")).exists()
    with pytest.raises(RuntimeError):
        with catalog.stage(fp("b"), "k", {}) as staging:
            (staging.path / "part.bin").write_bytes(b"p")
            raise RuntimeError("no resume")
    assert not (tmp_path / "staging" / fp("b")).exists()
