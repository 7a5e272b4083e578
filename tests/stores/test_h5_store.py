from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
from multiprocessing.connection import Connection
from pathlib import Path

import h5py
import numpy as np
import pytest

from stores.errors import KeyConflictError, StoreNotFoundError
from stores.h5_store import H5Store, H5StoreError
from stores.testing import StoreTests


class TestH5Store(StoreTests):
    def make_store(self, tmp_path: Path) -> H5Store:
        return H5Store(tmp_path / "store.h5")

    def reopen_read_only(self, store: H5Store, tmp_path: Path) -> H5Store:  # type: ignore[override]
        return H5Store(store.path, read_only=True)


def test_missing_file_without_create_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such.h5"
    with pytest.raises(StoreNotFoundError, match=str(missing)):
        H5Store(missing, create=False)
    with pytest.raises(FileNotFoundError, match="read_only"):
        H5Store(missing, read_only=True)
    assert not missing.exists()


def test_directory_and_non_hdf5_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError, match="is a directory"):
        H5Store(tmp_path)
    (tmp_path / "junk.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(H5StoreError, match="junk.h5") as info:
        H5Store(tmp_path / "junk.h5", read_only=True)
    assert isinstance(info.value, OSError)


def test_stock_h5py_sees_keys_as_uint8_datasets(tmp_path: Path) -> None:
    store = H5Store(tmp_path / "s.h5")
    store.set("g/sub/a.bin", b"abc")
    store.set("top", b"")
    store.close()
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert f["g/sub/a.bin"].dtype == np.uint8
        assert f["g/sub/a.bin"][()].tobytes() == b"abc"
        assert f["top"].shape == (0,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.h5"]


def test_writes_are_visible_to_another_process(tmp_path: Path) -> None:
    store = H5Store(tmp_path / "s.h5")
    store.set("a/b", b"1")
    store.set("a/b", b"22")
    store.set("c", b"3")
    store.delete("c")
    # A spawned process reads the file from disk, with no in-process HDF5 state to share; the
    # writer closes first to release HDF5's file lock (test_killed_writer_keeps_completed_sets
    # covers a writer that never closes).
    store.close()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply(_read_all, (str(tmp_path / "s.h5"),)) == {"a/b": b"22"}


def _read_all(path: str) -> dict[str, bytes]:
    store = H5Store(path, read_only=True)
    return {key: store.get(key) or b"" for key in store.list_prefix("")}


def test_killed_writer_keeps_completed_sets(tmp_path: Path) -> None:
    path = tmp_path / "s.h5"
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_write_then_die, args=(str(path),))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    store = H5Store(path)  # opens for writing: no stale "file is open" flag blocks it
    assert store.get("done") == b"x" * 1000 and store.get("k/0") == b"0"
    store.set("after", b"ok")


def _write_then_die(path: str) -> None:
    store = H5Store(path, fsync=False)
    for i in range(5):
        store.set(f"k/{i}", str(i).encode())
    store.set("done", b"x" * 1000)
    os.kill(os.getpid(), signal.SIGKILL)


def test_overwrite_reuses_freed_space(tmp_path: Path) -> None:
    store = H5Store(tmp_path / "s.h5")
    value = bytes(200_000)
    store.set("k", value)
    for _ in range(3):
        store.close()
        store.set("k", value)
    # Without free-space reuse across sessions the file would hold every old copy (> 800 kB).
    assert os.path.getsize(tmp_path / "s.h5") < 3.5 * len(value)


def test_group_of_only_leftovers_can_become_a_value(tmp_path: Path) -> None:
    store = H5Store(tmp_path / "s.h5")
    store.set("other", b"1")
    store.close()
    with h5py.File(tmp_path / "s.h5", "r+") as f:
        f.create_dataset("p/~tmp-deadbeef", data=np.zeros(3, np.uint8))  # an interrupted set
        f.create_dataset("q/foreign name", data=np.zeros(3, np.uint8))  # someone else's data
    assert sorted(store.list_prefix("")) == ["other"]
    store.set("p", b"value")
    assert store.get("p") == b"value"
    with pytest.raises(KeyConflictError, match="'q'"):
        store.set("q", b"value")


def test_pickle_round_trip_reopens(tmp_path: Path) -> None:
    store = H5Store(tmp_path / "s.h5")
    store.set("k", b"v")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.get("k") == b"v" and clone.read_only is False and clone.path == store.path


def test_read_only_store_in_forked_and_spawned_children(tmp_path: Path) -> None:
    writer = H5Store(tmp_path / "s.h5")
    for i in range(10):
        writer.set(f"g/{i}", bytes([i]) * (i + 1))
    writer.close()
    reader = H5Store(tmp_path / "s.h5", read_only=True)
    assert reader.get("g/3") == b"\x03" * 4  # the parent's handle is open before the fork
    for method in ("fork", "spawn"):
        with multiprocessing.get_context(method).Pool(2) as pool:
            got = pool.map(_get_from, [(reader, f"g/{i}") for i in range(10)])
        assert got == [bytes([i]) * (i + 1) for i in range(10)], method
    assert reader.get("g/9") == b"\x09" * 10  # the parent's handle still works


def _get_from(args: tuple[H5Store, str]) -> bytes | None:
    store, key = args
    return store.get(key)


def test_writable_store_inherited_through_fork_refuses(tmp_path: Path) -> None:
    writer = H5Store(tmp_path / "s.h5")
    writer.set("k", b"v")
    ctx = multiprocessing.get_context("fork")
    # Both the inherited object (Process args are not pickled under fork) and a pickled copy
    # (Pool args are) must refuse: either would be a second writer sharing the parent's handle.
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_report_error, args=(writer, child))
    proc.start()
    message = parent.recv()
    proc.join(30)
    assert "one writer" in message and "fork" in message
    with ctx.Pool(1) as pool:
        assert "had it open for writing" in pool.apply(_error_of_get, (writer,))
        reader = H5Store(tmp_path / "s.h5", read_only=True)
        assert "had it open for writing" in pool.apply(_error_of_get, (reader,))
    assert writer.get("k") == b"v"
    writer.close()  # once the writer is closed, a forked child may open the file
    with ctx.Pool(1) as pool:
        assert pool.apply(_error_of_get, (H5Store(tmp_path / "s.h5", read_only=True),)) == "no error"


def _error_of_get(store: H5Store) -> str:
    try:
        store.get("k")
    except H5StoreError as exc:
        return str(exc)
    return "no error"


def _report_error(store: H5Store, conn: Connection) -> None:
    conn.send(_error_of_get(store))
