"""Content identity: canonical JSON and file hashes ignore names, places and mtimes, but not bytes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from pipeline.data.identity import SAMPLE_BYTES, file_identity, files_identity, hash_array, hash_json


def test_hash_json_ignores_key_order_but_not_values() -> None:
    assert hash_json({"a": 1, "b": [1, 2]}) == hash_json({"b": [1, 2], "a": 1})
    assert hash_json({"a": 1}) != hash_json({"a": 2})
    assert len(hash_json(None)) == 64


def test_hash_array_covers_dtype_shape_and_bytes() -> None:
    a = np.arange(12, dtype=np.uint8)
    assert hash_array(a) == hash_array(a.copy())
    assert hash_array(a) != hash_array(a.reshape(3, 4))
    assert hash_array(a) != hash_array(a.astype(np.int16))
    b = a.copy()
    b[5] += 1
    assert hash_array(a) != hash_array(b)


def test_file_identity_is_content_not_path_or_mtime(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(b"hello" * 100)
    ident = file_identity(f)
    moved = tmp_path / "sub" / "renamed.dat"
    moved.parent.mkdir()
    shutil.move(f, moved)
    os.utime(moved, (1, 1))
    assert file_identity(moved) == ident
    moved.write_bytes(b"hellO" * 100)
    assert file_identity(moved) != ident


def test_large_files_are_sampled_at_both_ends(tmp_path: Path) -> None:
    data = bytearray(np.random.default_rng(0).integers(0, 256, 4 * SAMPLE_BYTES, dtype=np.uint8).tobytes())
    f = tmp_path / "big.bin"
    f.write_bytes(data)
    ident = file_identity(f, full_hash_limit=SAMPLE_BYTES)
    assert ":sampled:" in ident
    middle = bytearray(data)
    middle[2 * SAMPLE_BYTES] ^= 0xFF
    f.write_bytes(middle)
    assert file_identity(f, full_hash_limit=SAMPLE_BYTES) == ident  # documented trade-off
    tail = bytearray(data)
    tail[-1] ^= 0xFF
    f.write_bytes(tail)
    assert file_identity(f, full_hash_limit=SAMPLE_BYTES) != ident
    f.write_bytes(data + b"x")
    assert file_identity(f, full_hash_limit=SAMPLE_BYTES) != ident  # size is part of it


def test_files_identity_depends_on_order_and_content(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"1")
    b.write_bytes(b"2")
    assert files_identity([a, b]) != files_identity([b, a])
    assert files_identity([a, b]) == files_identity([tmp_path / "a", tmp_path / "b"])
