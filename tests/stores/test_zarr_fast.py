"""The one fast path into zarr internals (stores/zarr_fast.py) is there and decodes as stock zarr does.

These tests fail when a zarr upgrade moves the hooks the fast path uses (the reader would then
fall back to stock reads, slower): update stores/zarr_fast.py, or drop it, when they do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from stores import zarr_fast
from stores.errors import CorruptChunkError
from stores.zarr_entry import ArraySpec, ZarrReader, ZarrWriter

SPECS = {"train/codes": ArraySpec((3, 2), "uint8"), "train/scale": ArraySpec((), "float16")}


def _write(path: Path, compressor: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    data = {
        "train/codes": rng.integers(0, 255, (11, 3, 2), dtype=np.uint8),
        "train/scale": rng.random(11).astype(np.float16),
    }
    with ZarrWriter(path, SPECS, {"train": 11}, 4, {}, compressor=compressor) as writer:  # type: ignore[arg-type]
        writer.write("train", {"codes": data["train/codes"], "scale": data["train/scale"]})
    return data


@pytest.mark.parametrize("compressor", ["zstd", "blosc", "none"])
def test_fast_path_is_available_and_decodes_as_stock_zarr(tmp_path: Path, compressor: str) -> None:
    data = _write(tmp_path, compressor)
    group = zarr.open_group(tmp_path, mode="r")
    reader = ZarrReader(tmp_path)
    for name in SPECS:
        arr = group[name]
        assert isinstance(arr, zarr.Array)
        decode = zarr_fast.decoder(arr)
        assert decode is not None, f"zarr {zarr.__version__} lacks the hooks stores/zarr_fast.py uses"
        for index in range(3):
            raw = reader.fetch_chunk("train", index)
            fast = decode(raw.data[name], index)[: raw.hi - raw.lo]
            np.testing.assert_array_equal(fast, arr[raw.lo : raw.hi])
            np.testing.assert_array_equal(fast, data[name][raw.lo : raw.hi])
            assert fast.dtype == arr.dtype


def test_fetched_bytes_are_the_chunk_files(tmp_path: Path) -> None:
    _write(tmp_path, "zstd")
    reader = ZarrReader(tmp_path)
    raw = reader.fetch_chunk("train", 1)
    for name, buf in raw.data.items():
        assert buf.to_bytes() == (tmp_path / reader.chunk_key(name, 1)).read_bytes()


def test_fast_path_reports_a_flipped_bit(tmp_path: Path) -> None:
    _write(tmp_path, "zstd")
    reader = ZarrReader(tmp_path)
    target = tmp_path / reader.chunk_key("train/codes", 2)
    blob = bytearray(target.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    target.write_bytes(bytes(blob))
    with pytest.raises(CorruptChunkError, match="chunk 2 of array 'train/codes'"):
        reader.read_chunk("train", 2)


def test_reader_without_the_hooks_falls_back_to_stock_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _write(tmp_path, "zstd")
    monkeypatch.setattr(zarr_fast, "decoder", lambda arr: None)
    reader = ZarrReader(tmp_path)
    np.testing.assert_array_equal(reader.read_chunk("train", 2)["codes"], data["train/codes"][8:11])
