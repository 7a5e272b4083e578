"""idx(.gz) parsing: valid files round-trip; bad magic, truncation and count mismatches name the file."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from pipeline.data.idx import idx_sampleset, read_header, read_idx
from pipeline.errors import DataError


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    dtype = {0x08: ">u1", 0x0C: ">i4"}[type_code]
    return header + array.astype(dtype).tobytes()


def write(path: Path, payload: bytes) -> Path:
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)
    return path


@pytest.fixture
def images() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (7, 5, 4), dtype=np.uint8)


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_valid_files_round_trip(tmp_path: Path, images: np.ndarray, suffix: str) -> None:
    f = write(tmp_path / f"img{suffix}", idx_bytes(images))
    header = read_header(f, ndim=3)
    assert header.shape == (7, 5, 4) and header.dtype == np.uint8
    np.testing.assert_array_equal(read_idx(f), images)


def test_big_endian_int32_is_converted(tmp_path: Path) -> None:
    values = np.array([1, -2, 70000], dtype=np.int64)
    f = write(tmp_path / "x.gz", idx_bytes(values, 0x0C))
    out = read_idx(f, ndim=1)
    assert out.dtype.isnative
    np.testing.assert_array_equal(out, values)


def test_bad_magic_names_file_and_expectation(tmp_path: Path, images: np.ndarray) -> None:
    f = write(tmp_path / "img.gz", b"\x12\x34" + idx_bytes(images)[2:])
    with pytest.raises(DataError, match=r"img\.gz: not an idx file: magic number 0x12340803.*0x00000803"):
        read_header(f)


def test_wrong_number_of_dimensions(tmp_path: Path, images: np.ndarray) -> None:
    f = write(tmp_path / "img.gz", idx_bytes(images))
    with pytest.raises(DataError, match=r"img\.gz: idx file has 3 dimensions, expected 1"):
        read_header(f, ndim=1)


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_truncated_data_is_caught_at_indexing(tmp_path: Path, images: np.ndarray, suffix: str) -> None:
    f = write(tmp_path / f"img{suffix}", idx_bytes(images)[:-10])
    with pytest.raises(DataError, match=r"img(\.gz)?: truncated: header declares .*\(7, 5, 4\)"):
        read_header(f, ndim=3)


def test_truncated_gzip_stream_is_caught(tmp_path: Path, images: np.ndarray) -> None:
    f = tmp_path / "img.gz"
    f.write_bytes(gzip.compress(idx_bytes(images))[:-12])
    with pytest.raises(DataError, match=r"img\.gz: .*(corrupt or truncated|truncated)"):
        read_header(f, ndim=3)


def test_not_gzip_at_all(tmp_path: Path) -> None:
    f = tmp_path / "img.gz"
    f.write_bytes(b"this is plain text, not gzip")
    with pytest.raises(DataError, match=r"img\.gz: cannot read the idx magic number"):
        read_header(f)


def test_trailing_data_is_reported(tmp_path: Path, images: np.ndarray) -> None:
    f = write(tmp_path / "img", idx_bytes(images) + b"junk")
    with pytest.raises(DataError, match="has trailing data"):
        read_header(f)


def test_sampleset_checks_counts_and_label_range(tmp_path: Path, images: np.ndarray) -> None:
    img = write(tmp_path / "img.gz", idx_bytes(images))
    labels = np.array([0, 1, 2, 0, 1, 2, 0], np.uint8)
    ok = write(tmp_path / "lab.gz", idx_bytes(labels))
    s = idx_sampleset(img, ok, ["a", "b", "c"], name="t")
    assert len(s) == 7 and s.labels.tolist() == labels.tolist()
    np.testing.assert_array_equal(s.load(np.array([6, 0]))[..., 0], images[[6, 0]])

    short = write(tmp_path / "short.gz", idx_bytes(labels[:5]))
    with pytest.raises(DataError, match=r"short\.gz holds 5 labels but .*img\.gz holds 7 images"):
        idx_sampleset(img, short, ["a", "b", "c"], name="t")
    with pytest.raises(DataError, match=r"lab\.gz: label 2 at sample 2 is outside 0\.\.1"):
        idx_sampleset(img, ok, ["a", "b"], name="t")
    with pytest.raises(DataError, match=r"images are 5x4, expected 28x28"):
        idx_sampleset(img, ok, ["a", "b", "c"], name="t", image_shape=(28, 28))


def test_sampleset_identity_does_not_decompress_images(tmp_path: Path, images: np.ndarray) -> None:
    img = write(tmp_path / "img.gz", idx_bytes(images))
    lab = write(tmp_path / "lab.gz", idx_bytes(np.zeros(7, np.uint8)))
    s = idx_sampleset(img, lab, ["a"], name="t")
    s.identity()
    assert s._array is None  # still lazy
    other = tmp_path / "other"
    other.mkdir()
    moved_img = other / "i.gz"
    moved_img.write_bytes(img.read_bytes())
    assert idx_sampleset(moved_img, lab, ["a"], name="t").identity() == s.identity()
