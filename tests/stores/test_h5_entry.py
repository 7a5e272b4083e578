from __future__ import annotations

import hashlib
import json
import multiprocessing
import pickle
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stores.catalog import Catalog
from stores.errors import CorruptChunkError, EntryReadError, EntryWriteError, StoreNotFoundError
from stores.h5_entry import ENTRY_FILENAME, H5Reader, H5Writer
from stores.zarr_entry import ArraySpec

SPECS = {
    "train/codes": ArraySpec((2, 3), "uint8"),
    "train/labels": ArraySpec((), "int64"),
    "val/features": ArraySpec((5,), "float16"),
}


def sample_data(n: int, spec: ArraySpec, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.random((n, *spec.sample_shape)) * 100).astype(spec.dtype)


def write_entry(
    path: Path, counts: dict[str, int], chunk: int, batch: int, **kw: object
) -> dict[str, np.ndarray]:
    data = {
        name: sample_data(counts[name.split("/")[0]], spec, i) for i, (name, spec) in enumerate(SPECS.items())
    }
    with H5Writer(path, SPECS, counts, chunk, {"model": "tiny", "cut": [1, 2]}, **kw) as writer:  # type: ignore[arg-type]
        for start in range(0, counts["train"], batch):
            writer.write(
                "train", {leaf: data[f"train/{leaf}"][start : start + batch] for leaf in ("codes", "labels")}
            )
        for start in range(0, counts["val"], batch + 1):
            writer.write("val", {"features": data["val/features"][start : start + batch + 1]})
    return data


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
    reader = H5Reader(file)
    assert reader.groups == ["train", "val"]
    assert reader.arrays == SPECS
    assert reader.attrs == {"model": "tiny", "cut": [1, 2]}
    assert (reader.num_samples("train"), reader.num_chunks("train"), reader.chunk_samples("train")) == (
        23,
        6,
        4,
    )
    assert (reader.num_samples("val"), reader.num_chunks("val")) == (10, 3)
    last = reader.read_chunk("train", 5)  # odd tail: 3 samples
    np.testing.assert_array_equal(last["codes"], data["train/codes"][20:23])
    np.testing.assert_array_equal(last["labels"], data["train/labels"][20:23])
    rebuilt = np.concatenate([reader.read_chunk("val", i)["features"] for i in range(3)])
    np.testing.assert_array_equal(rebuilt, data["val/features"])
    np.testing.assert_array_equal(reader.read("train", "labels", 3, 17), data["train/labels"][3:17])
    np.testing.assert_array_equal(reader.read("train", "codes"), data["train/codes"])


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


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_train=st.integers(0, 30),
    n_val=st.integers(0, 12),
    chunk=st.integers(1, 9),
    batch=st.integers(1, 11),
)
def test_round_trip_any_batching(
    tmp_path_factory: pytest.TempPathFactory, n_train: int, n_val: int, chunk: int, batch: int
) -> None:
    path = tmp_path_factory.mktemp("e") / "e.h5"
    data = write_entry(path, {"train": n_train, "val": n_val}, chunk=chunk, batch=batch)
    reader = H5Reader(path)
    for name, expected in data.items():
        group, leaf = name.split("/")
        np.testing.assert_array_equal(reader.read(group, leaf), expected)
        assert reader.num_chunks(group) == -(-len(expected) // chunk)


def test_each_chunk_written_once_and_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[tuple[str, int, int]] = []
    real = h5py.Dataset.__setitem__

    def spy(self: h5py.Dataset, selection: slice, value: np.ndarray) -> None:
        writes.append((self.name, selection.start, selection.stop))
        real(self, selection, value)

    monkeypatch.setattr(h5py.Dataset, "__setitem__", spy)
    write_entry(tmp_path / "e.h5", {"train": 23, "val": 10}, chunk=4, batch=3)
    by_array: dict[str, list[tuple[int, int]]] = {}
    for name, start, stop in writes:
        by_array.setdefault(name, []).append((start, stop))
    assert by_array["/train/codes"] == [(i, min(i + 4, 23)) for i in range(0, 23, 4)]
    assert by_array["/val/features"] == [(0, 4), (4, 8), (8, 10)]


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


def test_missing_chunk_is_not_silently_zero(tmp_path: Path) -> None:
    file = tmp_path / "e.h5"
    with H5Writer(file, {"x": ArraySpec((), "uint8")}, 8, 4) as writer:
        writer.write("", {"x": np.zeros(8, np.uint8)})  # all-zero chunks are still stored
    np.testing.assert_array_equal(H5Reader(file).read("", "x"), np.zeros(8, np.uint8))
    with h5py.File(file, "r+") as f:  # simulate loss: shrink and regrow, which drops chunk 1
        f["x"].resize((4,))
        f["x"].resize((8,))
    with pytest.raises(CorruptChunkError, match="chunk 1 .* missing"):
        H5Reader(file).read_chunk("", 1)


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


def test_too_few_samples_is_a_clear_error(tmp_path: Path) -> None:
    writer = H5Writer(tmp_path / "e.h5", SPECS, {"train": 10, "val": 3}, 4)
    writer.write("train", {"codes": np.zeros((10, 2, 3), np.uint8), "labels": np.arange(10)})
    writer.write("val", {"features": np.zeros((2, 5), np.float16)})
    with pytest.raises(EntryWriteError, match="'val/features': expected 3 samples, got 2"):
        writer.close()
    with pytest.raises(EntryReadError, match="never completed"):
        H5Reader(tmp_path / "e.h5")


def test_too_many_samples_is_refused_before_writing(tmp_path: Path) -> None:
    with H5Writer(tmp_path / "e.h5", {"x": ArraySpec((), "int32")}, 5, 4) as writer:
        writer.write("", {"x": np.arange(4, dtype=np.int32)})
        with pytest.raises(EntryWriteError, match="'x'.*expected 5 samples in total, got at least 7"):
            writer.write("", {"x": np.arange(3, dtype=np.int32)})
        writer.write("", {"x": np.array([9], np.int32)})
    np.testing.assert_array_equal(H5Reader(tmp_path / "e.h5").read("", "x"), [0, 1, 2, 3, 9])


def test_bad_batches_are_explained(tmp_path: Path) -> None:
    writer = H5Writer(tmp_path / "e.h5", SPECS, {"train": 4, "val": 4}, 2)
    with pytest.raises(EntryWriteError, match="unknown group 'trian'.*did you mean 'train'"):
        writer.write("trian", {"codes": np.zeros((1, 2, 3), np.uint8)})
    with pytest.raises(EntryWriteError, match="'code' is not declared.*did you mean 'codes'"):
        writer.write("train", {"code": np.zeros((1, 2, 3), np.uint8)})
    with pytest.raises(EntryWriteError, match=r"shape \(2, 3\).*got \(1, 3, 2\)"):
        writer.write("train", {"codes": np.zeros((1, 3, 2), np.uint8)})
    with pytest.raises(EntryWriteError, match="expected dtype uint8.*got float32"):
        writer.write("train", {"codes": np.zeros((1, 2, 3), np.float32)})
    with pytest.raises(EntryWriteError, match="mixes sample counts"):
        writer.write("train", {"codes": np.zeros((2, 2, 3), np.uint8), "labels": np.zeros(1, np.int64)})
    writer.abort()
    with pytest.raises(EntryWriteError, match="one count per group"):
        H5Writer(tmp_path / "x.h5", SPECS, {"train": 4}, 2)
    with pytest.raises(EntryWriteError, match="already exists"):
        H5Writer(tmp_path / "e.h5", SPECS, 4, 2)
    with pytest.raises(EntryWriteError, match="reserved"):
        H5Writer(tmp_path / "y.h5", {"manifest.json": ArraySpec((), "uint8")}, 4, 2)
    with pytest.raises(EntryWriteError, match="invalid array name"):
        H5Writer(tmp_path / "z.h5", {"../up": ArraySpec((), "uint8")}, 4, 2)
    with pytest.raises(EntryWriteError, match="not JSON"):
        H5Writer(tmp_path / "w.h5", SPECS, 4, 2, attrs={"x": float("nan")})
    with pytest.raises(EntryWriteError, match="compressor must be one of"):
        H5Writer(tmp_path / "c.h5", SPECS, 4, 2, compressor="zstd")  # type: ignore[arg-type]
    with pytest.raises(EntryWriteError, match=r"gzip level must be in \[0, 9\], got 12"):
        H5Writer(tmp_path / "c.h5", SPECS, 4, 2, level=12)
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        H5Writer(tmp_path / "no" / "dir.h5", SPECS, 4, 2)
    # refused writers leave no file behind; the aborted one keeps its progress log for a resume
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.h5", "e.h5.progress"]


def test_reader_errors_name_group_and_range(tmp_path: Path) -> None:
    file = tmp_path / "e.h5"
    write_entry(file, {"train": 5, "val": 0}, chunk=2, batch=2)
    reader = H5Reader(file)
    assert reader.num_samples("val") == 0 and reader.num_chunks("val") == 0
    assert reader.chunk_samples("val") == 2
    with pytest.raises(EntryReadError, match="no group 'tran'.*did you mean 'train'"):
        reader.num_samples("tran")
    with pytest.raises(EntryReadError, match="chunk index 3 out of range.*3 chunks"):
        reader.read_chunk("train", 3)
    with pytest.raises(EntryReadError, match=r"\[2, 9\) is outside \[0, 5\]"):
        reader.read("train", "labels", 2, 9)
    with pytest.raises(EntryReadError, match="no array 'label'.*did you mean 'labels'"):
        reader.read("train", "label")
    with pytest.raises(FileNotFoundError):
        H5Reader(tmp_path / "absent.h5")


def test_writer_memory_does_not_grow_with_samples(tmp_path: Path) -> None:
    spec = ArraySpec((64, 64), "uint8")  # 4 KiB per sample
    chunk = 16  # 64 KiB chunks
    n = 1024  # 4 MiB in total
    batch = np.random.default_rng(0).integers(0, 255, (8, 64, 64), dtype=np.uint8)
    writer = H5Writer(tmp_path / "e.h5", {"x": spec}, n, chunk, compressor="none")
    tracemalloc.start()
    try:
        for _ in range(n // len(batch)):
            writer.write("", {"x": batch})
        writer.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = n * spec.sample_bytes
    assert peak < total / 8, f"peak {peak} bytes for {total} bytes written"
    assert H5Reader(tmp_path / "e.h5").num_chunks() == n // chunk


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
