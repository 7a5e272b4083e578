"""The committed golden entries (tests/golden/entries/) read back bit-exactly, with this code and stock tools.

A failure means the on-disk format changed; see tests/golden/README.md before regenerating.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

from stores.entry import FORMATS, H5_FILE, ZARR_DIR, entry_format, open_reader

ENTRIES = Path(__file__).resolve().parent / "entries"
CODECS = ("bits1", "bits2", "bits4", "bits8", "float16")
CHUNK = 4
COUNTS = {"train": 13, "val": 5}
CASES = [(fmt, codec) for fmt in FORMATS for codec in CODECS]


def expected(codec: str) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted((ENTRIES / f"expected-{codec}").glob("*.npy")):
        group, leaf = path.stem.split(".")
        out[f"{group}/{leaf}"] = np.load(path, allow_pickle=False)
    return out


def assert_bit_exact(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert got.tobytes() == want.tobytes(), f"{what} does not read back bit-exactly"


def test_every_golden_entry_is_committed() -> None:
    for fmt, codec in CASES:
        entry_dir = ENTRIES / f"{fmt}-{codec}"
        assert entry_dir.is_dir(), f"missing golden entry {entry_dir}; run tests/golden/make_entries.py"
        assert entry_format(entry_dir) == fmt
        assert expected(codec), f"no expected arrays for {codec}"


@pytest.mark.parametrize(("fmt", "codec"), CASES)
def test_golden_entry_reads_back_bit_exactly(fmt: str, codec: str) -> None:
    want = expected(codec)
    reader = open_reader(ENTRIES / f"{fmt}-{codec}")
    assert sorted(reader.arrays) == sorted(want)
    assert reader.attrs == {"golden": {"codec": codec, "format": fmt}}
    for group, count in COUNTS.items():
        assert (reader.num_samples(group), reader.chunk_samples(group)) == (count, CHUNK)
        chunks = [reader.read_chunk(group, i) for i in range(reader.num_chunks(group))]
        for name, values in want.items():
            if not name.startswith(group + "/"):
                continue
            leaf = name.split("/")[1]
            assert_bit_exact(reader.read(group, leaf), values, f"{fmt}-{codec} {name}")
            stitched = np.concatenate([chunk[leaf] for chunk in chunks])
            assert_bit_exact(stitched, values, f"{fmt}-{codec} {name} chunk by chunk")
    reader.close()


@pytest.mark.parametrize("codec", CODECS)
def test_stock_zarr_reads_golden_entries(codec: str) -> None:
    root = zarr.open_group(ENTRIES / f"zarr-{codec}" / ZARR_DIR, mode="r")
    for name, values in expected(codec).items():
        array = root[name]
        assert isinstance(array, zarr.Array)
        assert_bit_exact(np.asarray(array[:]), values, f"zarr.open {name}")


@pytest.mark.parametrize("codec", CODECS)
def test_stock_h5py_reads_golden_entries(codec: str) -> None:
    with h5py.File(ENTRIES / f"hdf5-{codec}" / H5_FILE, "r") as f:
        for name, values in expected(codec).items():
            assert_bit_exact(f[name][:], values, f"h5py.File {name}")
        assert json.loads(f.attrs["ondevice_tl_attrs"]) == {"golden": {"codec": codec, "format": "hdf5"}}


def test_make_entries_reproduces_the_expected_arrays() -> None:
    """The generator still describes the committed arrays (so regenerating changes format, not data)."""
    from tests.golden import make_entries

    for codec in CODECS:
        for name, values in make_entries.expected(codec).items():
            assert_bit_exact(values, expected(codec)[name], f"make_entries.expected({codec!r}) {name}")
