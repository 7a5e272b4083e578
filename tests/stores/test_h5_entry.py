from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import pickle
from pathlib import Path

import h5py
import numpy as np
import pytest

from stores.catalog import Catalog
from stores.errors import CorruptChunkError, EntryReadError, EntryWriteError, StoreNotFoundError
from stores.h5_entry import ENTRY_FILENAME, H5Reader, H5Writer
from stores.zarr_entry import ArraySpec
from tests.stores import entry_checks
from tests.stores.entry_checks import SPECS

write_entry = functools.partial(entry_checks.write_entry, H5Writer)


def flip_byte_in_chunk(file: Path, array: str, index: int) -> None:
    with h5py.File(file, "r") as f:
        dset = f[array]
        info = dset.id.get_chunk_info_by_coord((index * dset.chunks[0],) + (0,) * (dset.ndim - 1))
    raw = bytearray(file.read_bytes())
    raw[info.byte_offset + info.size // 2] ^= 0x01
    file.write_bytes(bytes(raw))


@pytest.mark.parametrize("compressor", ["gzip", "lzf", "none"])
def test_round_trip_groups_of_different_lengths(tmp_path: Path, compressor: str) -> None:
    file = tmp_path / "e.h5"
    data = write_entry(file, {"train": 23, "val": 10}, chunk=4, batch=3, compressor=compressor)
    entry_checks.check_23_and_10_in_chunks_of_4(H5Reader(file), data)


def test_stock_h5py_reads_entry_written_through_catalog(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    fp = hashlib.sha256(b"entry").hexdigest()
    with cat.stage(fp, "features", {"model": "tiny"}) as staging:
        data = write_entry(staging.path, {"train": 9, "val": 2}, chunk=4, batch=5)  # a directory
        entry = staging.commit({"chunk_samples": 4})
    assert list(entry.files) == [ENTRY_FILENAME]
    with h5py.File(entry.path / ENTRY_FILENAME) as f:  # stock h5py, default mode
        assert json.loads(f.attrs["ondevice_tl_attrs"]) == {"model": "tiny", "cut": [1, 2]}
        for name, expected in data.items():
            np.testing.assert_array_equal(f[name][:], expected)
        assert f["train/codes"].chunks == (4, 2, 3) and f["train/codes"].fletcher32
        assert f["train/codes"].compression == "gzip"
    reader = H5Reader(entry.path)  # the directory resolves to its entry file too
    np.testing.assert_array_equal(reader.read("val", "features"), data["val/features"])


def test_each_chunk_written_once_and_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_array = entry_checks.record_slice_writes(monkeypatch, h5py.Dataset, lambda dset: dset.name)
    write_entry(tmp_path / "e.h5", {"train": 23, "val": 10}, chunk=4, batch=3)
    assert by_array["/train/codes"] == [(i, min(i + 4, 23)) for i in range(0, 23, 4)]
    assert by_array["/val/features"] == [(0, 4), (4, 8), (8, 10)]


def test_a_groups_short_last_chunk_is_written_with_its_last_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = entry_checks.record_slice_writes(monkeypatch, h5py.Dataset, lambda dset: dset.name)
    path = tmp_path / "entry.h5"
    entry_checks.check_tail_written_with_last_sample(H5Writer, path, writes, lambda name: f"/{name}")

@pytest.mark.parametrize("compressor", ["gzip", "lzf", "none"])
def test_flipped_byte_is_reported_with_chunk(tmp_path: Path, compressor: str) -> None:
    file = tmp_path / "e.h5"
    write_entry(file, {"train": 23, "val": 10}, chunk=4, batch=3, compressor=compressor)
    flip_byte_in_chunk(file, "train/codes", 2)
    reader = H5Reader(file)
    with pytest.raises(CorruptChunkError, match="chunk 2 of array 'train/codes'") as info:
        reader.read_chunk("train", 2)
    assert info.value.chunk == 2 and info.value.array == "train/codes" and info.value.path == str(file)
    with pytest.raises(CorruptChunkError, match="chunk 2"):
        reader.read("train", "codes", 0, 23)
    reader.read_chunk("train", 1)  # neighbours are intact
    assert reader.read("train", "codes", 12, 23).shape == (11, 2, 3)
    restored = pickle.loads(pickle.dumps(info.value))
    assert (restored.path, restored.array, restored.chunk) == (str(file), "train/codes", 2)


def test_unfinished_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "e.h5"
    with pytest.raises(RuntimeError, match="boom"):
        with H5Writer(file, {"x": ArraySpec((), "uint8")}, 8, 4) as writer:
            writer.write("", {"x": np.zeros(8, np.uint8)})
            raise RuntimeError("boom")
    with pytest.raises(EntryReadError, match="never completed"):
        H5Reader(file)
    (tmp_path / "junk.h5").write_bytes(b"\x00" * 64)
    with pytest.raises(EntryReadError, match="junk.h5"):
        H5Reader(tmp_path / "junk.h5")
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(EntryReadError, match="not an ondevice-tl HDF5 entry"):
        H5Reader(tmp_path / "foreign.h5")


def test_bad_batches_are_explained(tmp_path: Path) -> None:
    writer = H5Writer(tmp_path / "e.h5", SPECS, {"train": 4, "val": 4}, 2)
    entry_checks.check_bad_batches(writer)
    writer.abort()
    entry_checks.check_bad_declarations(lambda name, *a, **kw: H5Writer(tmp_path / f"{name}.h5", *a, **kw))
    with pytest.raises(EntryWriteError, match="already exists"):
        H5Writer(tmp_path / "e.h5", SPECS, 4, 2)
    with pytest.raises(EntryWriteError, match="compressor must be one of"):
        H5Writer(tmp_path / "c.h5", SPECS, 4, 2, compressor="zstd")  # type: ignore[arg-type]
    with pytest.raises(EntryWriteError, match=r"gzip level must be in \[0, 9\], got 12"):
        H5Writer(tmp_path / "c.h5", SPECS, 4, 2, level=12)
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        H5Writer(tmp_path / "no" / "dir.h5", SPECS, 4, 2)
    # refused writers leave no file behind; the aborted one keeps its progress log for a resume
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.h5", "e.h5.progress"]


def _chunk_sums(args: tuple[H5Reader, int]) -> int:
    reader, index = args
    return int(reader.read_chunk("train", index)["labels"].sum())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_reader_in_child_processes(tmp_path: Path, method: str) -> None:
    data = write_entry(tmp_path / "e.h5", {"train": 23, "val": 10}, chunk=4, batch=3)
    reader = H5Reader(tmp_path / "e.h5")
    reader.read_chunk("train", 0)  # the parent's handle is open when the children start
    with multiprocessing.get_context(method).Pool(2) as pool:
        sums = pool.map(_chunk_sums, [(reader, i) for i in range(6)])
    labels = data["train/labels"]
    assert sums == [int(labels[i * 4 : i * 4 + 4].sum()) for i in range(6)]
    np.testing.assert_array_equal(reader.read("train", "labels"), labels)  # parent still fine


def test_inherited_reader_is_reopened_after_fork(tmp_path: Path) -> None:
    data = write_entry(tmp_path / "e.h5", {"train": 8, "val": 1}, chunk=4, batch=3)
    reader = H5Reader(tmp_path / "e.h5")
    reader.read_chunk("train", 0)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_reads, args=(reader, child))  # inherited, not pickled
    proc.start()
    got = parent.recv()
    proc.join(30)
    assert got[0] != got[1]  # the child used its own handle
    np.testing.assert_array_equal(got[2], data["train/labels"][4:8])


def _child_reads(reader: H5Reader, conn: object) -> None:
    parent_handle = id(reader._handle)
    labels = reader.read_chunk("train", 1)["labels"]
    conn.send((parent_handle, id(reader._handle), labels))  # type: ignore[attr-defined]


def test_one_chunk_length_for_every_group(tmp_path: Path) -> None:
    with pytest.raises(EntryWriteError, match="one chunk length for every group"):
        H5Writer(tmp_path / "e", SPECS, {"train": 8, "val": 8}, {"train": 4, "val": 2})
