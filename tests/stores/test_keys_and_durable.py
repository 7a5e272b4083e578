"""Key validation (names stay inside their directory) and the one durable write of the stores package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stores.durable import TEMP_MARKER, atomic_write_bytes
from stores.errors import InvalidKeyError
from stores.keys import is_valid_key, validate_key

INVALID_KEYS = [
    "",
    "/abs",
    "/",
    "../escape",
    "a/../../b",
    "..",
    ".",
    "./a",
    "a/./b",
    "a\\b",
    "a\x00b",
    "a//b",
    "a/",
    "with space",
    "uni\u00e9",
    "colon:x",
    "star*",
    "x" * 256,
]


@pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
def test_invalid_keys_are_refused_naming_the_key(key: str) -> None:
    with pytest.raises(InvalidKeyError, match="store key"):
        validate_key(key)
    assert not is_valid_key(key)


@pytest.mark.parametrize("key", ["a", "train/codes", "a.b-c_d/e", "x" * 255, "c/0/0"])
def test_valid_keys_pass_unchanged(key: str) -> None:
    assert validate_key(key) == key and is_valid_key(key)


def test_temp_names_are_never_keys() -> None:
    assert not is_valid_key(f"{TEMP_MARKER}deadbeef")


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    atomic_write_bytes(target, b"1")
    atomic_write_bytes(target, memoryview(b"22"))
    assert target.read_bytes() == b"22"
    assert os.listdir(tmp_path) == ["f.json"]


def test_atomic_write_fsyncs_file_and_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    atomic_write_bytes(tmp_path / "k", b"data")
    assert len(synced) == 2  # the temp file, then the directory holding the new name
    synced.clear()
    atomic_write_bytes(tmp_path / "deep" / "chunk", b"data", sync_dir=False, make_parents=True)
    assert len(synced) == 1 and (tmp_path / "deep" / "chunk").read_bytes() == b"data"


def test_failed_rename_keeps_the_old_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "k"
    atomic_write_bytes(target, b"old")

    def boom(src: str, dst: str) -> None:
        raise OSError("simulated power cut before rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="power cut"):
        atomic_write_bytes(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["k"]


def test_exclusive_write_refuses_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "k"
    atomic_write_bytes(target, b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        atomic_write_bytes(target, b"second", exclusive=True)
    assert target.read_bytes() == b"first" and os.listdir(tmp_path) == ["k"]
