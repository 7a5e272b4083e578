from __future__ import annotations

import os
from pathlib import Path

import pytest

from stores.errors import StoreNotFoundError
from stores.local import TEMP_MARKER, LocalStore, atomic_write_bytes
from stores.testing import StoreTests


class TestLocalStore(StoreTests):
    def make_store(self, tmp_path: Path) -> LocalStore:
        return LocalStore(tmp_path / "store")

    def reopen_read_only(self, store: LocalStore, tmp_path: Path) -> LocalStore:  # type: ignore[override]
        return LocalStore(store.root, read_only=True)


def test_missing_root_without_create_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(StoreNotFoundError, match=str(missing)):
        LocalStore(missing, create=False)
    with pytest.raises(FileNotFoundError, match="read_only"):
        LocalStore(missing, read_only=True)
    assert not missing.exists()


def test_root_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(StoreNotFoundError, match="is a file"):
        LocalStore(tmp_path / "f")


def test_keys_map_to_files_inside_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.set("g/a.bin", b"abc")
    assert (tmp_path / "s" / "g" / "a.bin").read_bytes() == b"abc"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_set_is_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "s")
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    store.set("new/dir/key", b"data")
    # at least: the temp file, its directory, and the directories created for it
    assert len(synced) >= 3


def test_failed_replace_keeps_old_value_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "s")
    store.set("k", b"old")

    def boom(src: str, dst: str) -> None:
        raise OSError("simulated power cut before rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="power cut"):
        store.set("k", b"new")
    monkeypatch.undo()
    assert store.get("k") == b"old"
    assert os.listdir(tmp_path / "s") == ["k"]


def test_temp_files_are_never_listed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.set("a/k", b"1")
    (tmp_path / "s" / "a" / f"{TEMP_MARKER}deadbeef").write_bytes(b"partial")
    (tmp_path / "s" / "a" / "not a key").write_bytes(b"foreign")
    assert list(store.list_prefix("")) == ["a/k"]
    # a stray temp file keeps the directory alive, so the parent key stays a conflict, loudly
    store.delete("a/k")
    with pytest.raises(ValueError, match="parent"):
        store.set("a", b"x")


def test_atomic_write_bytes_replaces(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    atomic_write_bytes(target, b"1")
    atomic_write_bytes(target, memoryview(b"22"))
    assert target.read_bytes() == b"22"
    assert os.listdir(tmp_path) == ["f.json"]
