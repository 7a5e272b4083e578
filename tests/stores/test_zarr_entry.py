from __future__ import annotations

import hashlib
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stores.catalog import Catalog
from stores.errors import CorruptChunkError, EntryReadError, EntryWriteError
from stores.zarr_entry import ArraySpec, ZarrReader, ZarrWriter, suggest_chunk_samples

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
    with ZarrWriter(path, SPECS, counts, chunk, {"model": "tiny", "cut": [1, 2]}, **kw) as writer:  # type: ignore[arg-type]
        for start in range(0, counts["train"], batch):
            writer.write(
                "train", {leaf: data[f"train/{leaf}"][start : start + batch] for leaf in ("codes", "labels")}
            )
        for start in range(0, counts["val"], batch + 1):
            writer.write("val", {"features": data["val/features"][start : start + batch + 1]})
    return data


@pytest.mark.parametrize("compressor", ["zstd", "blosc", "none"])
def test_round_trip_groups_of_different_lengths(tmp_path: Path, compressor: str) -> None:
    data = write_entry(tmp_path, {"train": 23, "val": 10}, chunk=4, batch=3, compressor=compressor)
    reader = ZarrReader(tmp_path)
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


def test_stock_zarr_reads_entry_written_through_catalog(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    fp = hashlib.sha256(b"entry").hexdigest()
    with cat.stage(fp, "features", {"model": "tiny"}) as staging:
        data = write_entry(staging.path, {"train": 9, "val": 2}, chunk=4, batch=5)
        entry = staging.commit({"chunk_samples": 4})
    group = zarr.open(entry.path, mode="r")
    assert dict(group.attrs) == {"model": "tiny", "cut": [1, 2]}
    for name, expected in data.items():
        np.testing.assert_array_equal(group[name][:], expected)
    assert group["train/codes"].chunks == (4, 2, 3)
    assert "train/codes/c/2/0/0" in entry.files and entry.size_bytes == sum(entry.files.values())


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
    path = tmp_path_factory.mktemp("e")
    data = write_entry(path, {"train": n_train, "val": n_val}, chunk=chunk, batch=batch)
    reader = ZarrReader(path)
    for name, expected in data.items():
        group, leaf = name.split("/")
        np.testing.assert_array_equal(reader.read(group, leaf), expected)
        assert reader.num_chunks(group) == -(-len(expected) // chunk)


def test_each_chunk_written_once_and_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[tuple[str, int, int]] = []
    real = zarr.Array.__setitem__

    def spy(self: zarr.Array, selection: slice, value: np.ndarray) -> None:
        writes.append((self.path, selection.start, selection.stop))
        real(self, selection, value)

    monkeypatch.setattr(zarr.Array, "__setitem__", spy)
    write_entry(tmp_path, {"train": 23, "val": 10}, chunk=4, batch=3)
    by_array: dict[str, list[tuple[int, int]]] = {}
    for name, start, stop in writes:
        by_array.setdefault(name, []).append((start, stop))
    assert by_array["train/codes"] == [(i, min(i + 4, 23)) for i in range(0, 23, 4)]
    assert by_array["val/features"] == [(0, 4), (4, 8), (8, 10)]


def test_flipped_byte_is_reported_with_chunk(tmp_path: Path) -> None:
    write_entry(tmp_path, {"train": 23, "val": 10}, chunk=4, batch=3)
    chunk_file = tmp_path / "train" / "codes" / "c" / "2" / "0" / "0"
    raw = bytearray(chunk_file.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    chunk_file.write_bytes(bytes(raw))
    reader = ZarrReader(tmp_path)
    with pytest.raises(CorruptChunkError, match="chunk 2 of array 'train/codes'") as info:
        reader.read_chunk("train", 2)
    assert info.value.chunk == 2 and info.value.array == "train/codes" and str(tmp_path) in str(info.value)
    with pytest.raises(CorruptChunkError, match="chunk 2"):
        reader.read("train", "codes", 0, 23)
    reader.read_chunk("train", 1)  # neighbours are intact
    np.testing.assert_array_equal(reader.read("train", "codes", 12, 23).shape, (11, 2, 3))


def test_missing_chunk_file_is_not_silently_zero(tmp_path: Path) -> None:
    with ZarrWriter(tmp_path, {"x": ArraySpec((), "uint8")}, 8, 4) as writer:
        writer.write("", {"x": np.zeros(8, np.uint8)})  # all-fill chunks must still get files
    np.testing.assert_array_equal(ZarrReader(tmp_path).read("", "x"), np.zeros(8, np.uint8))
    (tmp_path / "x" / "c" / "1").unlink()
    with pytest.raises(CorruptChunkError, match="chunk 1 .* missing"):
        ZarrReader(tmp_path).read_chunk("", 1)


def test_too_few_samples_is_a_clear_error(tmp_path: Path) -> None:
    writer = ZarrWriter(tmp_path, SPECS, {"train": 10, "val": 3}, 4)
    writer.write("train", {"codes": np.zeros((10, 2, 3), np.uint8), "labels": np.arange(10)})
    writer.write("val", {"features": np.zeros((2, 5), np.float16)})
    with pytest.raises(EntryWriteError, match="'val/features': expected 3 samples, got 2"):
        writer.close()


def test_too_many_samples_is_refused_before_writing(tmp_path: Path) -> None:
    with ZarrWriter(tmp_path, {"x": ArraySpec((), "int32")}, 5, 4) as writer:
        writer.write("", {"x": np.arange(4, dtype=np.int32)})
        with pytest.raises(EntryWriteError, match="'x'.*expected 5 samples in total, got at least 7"):
            writer.write("", {"x": np.arange(3, dtype=np.int32)})
        writer.write("", {"x": np.array([9], np.int32)})
    np.testing.assert_array_equal(ZarrReader(tmp_path).read("", "x"), [0, 1, 2, 3, 9])


def test_bad_batches_are_explained(tmp_path: Path) -> None:
    writer = ZarrWriter(tmp_path, SPECS, {"train": 4, "val": 4}, 2)
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
    with pytest.raises(EntryWriteError, match="one count per group"):
        ZarrWriter(tmp_path / "x", SPECS, {"train": 4}, 2)
    with pytest.raises(EntryWriteError, match="already holds a zarr"):
        ZarrWriter(tmp_path, SPECS, 4, 2)
    with pytest.raises(EntryWriteError, match="reserved"):
        ZarrWriter(tmp_path / "y", {"manifest.json": ArraySpec((), "uint8")}, 4, 2)
    with pytest.raises(EntryWriteError, match="invalid array name"):
        ZarrWriter(tmp_path / "z", {"../up": ArraySpec((), "uint8")}, 4, 2)
    with pytest.raises(EntryWriteError, match="not JSON"):
        ZarrWriter(tmp_path / "w", SPECS, 4, 2, attrs={"x": float("nan")})


def test_reader_errors_name_group_and_range(tmp_path: Path) -> None:
    write_entry(tmp_path, {"train": 5, "val": 0}, chunk=2, batch=2)
    reader = ZarrReader(tmp_path)
    assert reader.num_samples("val") == 0 and reader.num_chunks("val") == 0
    with pytest.raises(EntryReadError, match="no group 'tran'.*did you mean 'train'"):
        reader.num_samples("tran")
    with pytest.raises(EntryReadError, match="chunk index 3 out of range.*3 chunks"):
        reader.read_chunk("train", 3)
    with pytest.raises(EntryReadError, match=r"\[2, 9\) is outside \[0, 5\]"):
        reader.read("train", "labels", 2, 9)
    with pytest.raises(FileNotFoundError):
        ZarrReader(tmp_path / "absent")


def test_writer_memory_does_not_grow_with_samples(tmp_path: Path) -> None:
    spec = ArraySpec((64, 64), "uint8")  # 4 KiB per sample
    chunk = 16  # 64 KiB chunks
    n = 1024  # 4 MiB in total
    batch = np.random.default_rng(0).integers(0, 255, (8, 64, 64), dtype=np.uint8)
    writer = ZarrWriter(tmp_path, {"x": spec}, n, chunk, compressor="none")
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
    assert ZarrReader(tmp_path).num_chunks() == n // chunk


def test_suggest_chunk_samples() -> None:
    assert suggest_chunk_samples([ArraySpec((256, 16, 16), "uint8"), ArraySpec((), "int64")]) == 16
    assert suggest_chunk_samples([ArraySpec((4096, 4096), "float32")]) == 1
