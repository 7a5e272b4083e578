from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import pytest
import zarr

from stores.catalog import Catalog
from stores.errors import CorruptChunkError, EntryWriteError
from stores.zarr_entry import ArraySpec, ZarrReader, ZarrWriter, suggest_chunk_samples
from tests.stores import entry_checks
from tests.stores.entry_checks import SPECS

write_entry = functools.partial(entry_checks.write_entry, ZarrWriter)


@pytest.mark.parametrize("compressor", ["zstd", "blosc", "none"])
def test_round_trip_groups_of_different_lengths(tmp_path: Path, compressor: str) -> None:
    data = write_entry(tmp_path, {"train": 23, "val": 10}, chunk=4, batch=3, compressor=compressor)
    entry_checks.check_23_and_10_in_chunks_of_4(ZarrReader(tmp_path), data)


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


def test_each_chunk_written_once_and_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_array = entry_checks.record_slice_writes(monkeypatch, zarr.Array, lambda arr: arr.path)
    write_entry(tmp_path, {"train": 23, "val": 10}, chunk=4, batch=3)
    assert by_array["train/codes"] == [(i, min(i + 4, 23)) for i in range(0, 23, 4)]
    assert by_array["val/features"] == [(0, 4), (4, 8), (8, 10)]


def test_a_groups_short_last_chunk_is_written_with_its_last_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = entry_checks.record_slice_writes(monkeypatch, zarr.Array, lambda arr: arr.path)
    entry_checks.check_tail_written_with_last_sample(ZarrWriter, tmp_path, writes, lambda name: name)


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


def test_writing_over_an_existing_hierarchy_is_refused(tmp_path: Path) -> None:
    ZarrWriter(tmp_path, SPECS, {"train": 4, "val": 4}, 2)
    with pytest.raises(EntryWriteError, match="already holds a zarr"):
        ZarrWriter(tmp_path, SPECS, 4, 2)


def test_suggest_chunk_samples() -> None:
    assert suggest_chunk_samples([ArraySpec((256, 16, 16), "uint8"), ArraySpec((), "int64")]) == 16
    assert suggest_chunk_samples([ArraySpec((4096, 4096), "float32")]) == 1


def test_each_group_can_have_its_own_chunk_length(tmp_path: Path) -> None:
    # A 2-bit train split beside float16 eval splits: each group's chunks sized for its own samples.
    chunks = {"train": 7, "val": 3}
    data = entry_checks.write_entry(ZarrWriter, tmp_path / "e", {"train": 30, "val": 10}, chunks, 4)
    reader = ZarrReader(tmp_path / "e")
    assert {g: reader.chunk_samples(g) for g in chunks} == chunks
    assert (reader.num_chunks("train"), reader.num_chunks("val")) == (5, 4)
    for name, expected in data.items():
        np.testing.assert_array_equal(reader.read(*name.split("/")), expected)
    stock = zarr.open_group(str(tmp_path / "e"), mode="r")
    assert stock["train/codes"].chunks == (7, 2, 3) and stock["val/features"].chunks == (3, 5)


@pytest.mark.parametrize("chunks", [{"train": 4}, {"train": 4, "val": 4, "test": 4}, {"train": 0, "val": 4}])
def test_a_chunk_length_per_group_must_name_each_group_once(tmp_path: Path, chunks: dict[str, int]) -> None:
    with pytest.raises(EntryWriteError, match="chunk"):
        ZarrWriter(tmp_path / "e", SPECS, {"train": 8, "val": 8}, chunks)
