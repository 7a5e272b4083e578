"""The idx format of MNIST-style datasets (optionally gzipped), read with validation.

Layout: two zero bytes, a type byte (0x08 = uint8, ...), a byte with the number of
dimensions, one big-endian uint32 per dimension, then the data in C order.

Headers are validated when a dataset is indexed, and so is the data length: for
.gz files the gzip trailer stores the uncompressed size, so a truncated or
mismatched file is caught before training without decompressing it. Only when the
trailer disagrees is the stream decompressed to report the exact size.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

import numpy as np

from ..errors import DataError
from .identity import file_identity, hash_json
from .sampleset import ArraySampleSet

IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}
_GZIP_ERRORS = (OSError, EOFError, zlib.error)


@dataclass(frozen=True)
class IdxHeader:
    """What an idx file declares: element type and shape (the first dimension counts samples)."""

    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def header_bytes(self) -> int:
        return 4 + 4 * len(self.shape)

    @property
    def data_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _open(path: Path) -> IO[bytes]:
    return cast(IO[bytes], gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb"))


def _read_exact(f: IO[bytes], n: int, path: Path, what: str) -> bytes:
    try:
        data = f.read(n)
    except _GZIP_ERRORS as exc:
        raise DataError(f"{path}: cannot read the {what}: {exc} (corrupt or not gzip-compressed?)") from exc
    if len(data) != n:
        raise DataError(f"{path}: truncated: expected {n} bytes of {what}, found {len(data)}")
    return data


def _uncompressed_size(path: Path) -> int:
    """Actual decompressed size of a .gz file, by streaming through it (used only on a mismatch)."""
    total = 0
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    except _GZIP_ERRORS as exc:
        raise DataError(f"{path}: gzip stream is corrupt or truncated after {total} bytes: {exc}") from exc
    return total


def read_header(path: str | Path, *, ndim: int | None = None) -> IdxHeader:
    """Parse and validate an idx(.gz) header, and check that the file holds exactly the declared data."""
    path = Path(path)
    with _open(path) as f:
        magic = _read_exact(f, 4, path, "idx magic number")
        if magic[0] != 0 or magic[1] != 0 or magic[2] not in IDX_TYPES or magic[3] == 0:
            types = ", ".join(f"{t:02x}" for t in IDX_TYPES)
            raise DataError(f"{path}: not an idx file: magic number 0x{magic.hex()} (expected 0x0000TTNN "
                            f"with type TT in {{{types}}} and NN dimensions, e.g. 0x00000803 for uint8 "
                            f"images)")
        dims = magic[3]
        if ndim is not None and dims != ndim:
            raise DataError(f"{path}: idx file has {dims} dimensions, expected {ndim} "
                            f"({'images N x rows x cols' if ndim == 3 else 'one label per sample'})")
        shape = struct.unpack(f">{dims}I", _read_exact(f, 4 * dims, path, "idx dimensions"))
    header = IdxHeader(path, IDX_TYPES[magic[2]], tuple(int(d) for d in shape))
    expected = header.header_bytes + header.data_bytes
    if path.suffix == ".gz":
        with path.open("rb") as raw:
            raw.seek(-4, 2)
            isize = struct.unpack("<I", raw.read(4))[0]  # uncompressed size mod 2**32 (gzip trailer)
        actual = expected if isize == expected % 2**32 else _uncompressed_size(path)
    else:
        actual = path.stat().st_size
    if actual != expected:
        problem = "truncated" if actual < expected else "has trailing data"
        raise DataError(f"{path}: {problem}: header declares {header.dtype} data of shape {header.shape} "
                        f"({expected} bytes with header), but the file holds {actual} bytes uncompressed")
    return header


def read_idx(path: str | Path, *, ndim: int | None = None, header: IdxHeader | None = None) -> np.ndarray:
    """The whole array of an idx(.gz) file in native byte order, after validating its header and length."""
    path = Path(path)
    header = header or read_header(path, ndim=ndim)
    with _open(path) as f:
        _read_exact(f, header.header_bytes, path, "idx header")
        data = _read_exact(f, header.data_bytes, path, f"data of shape {header.shape}")
    array = np.frombuffer(data, header.dtype).reshape(header.shape)
    return array.astype(header.dtype.newbyteorder("="), copy=False)


def idx_sampleset(images_path: str | Path, labels_path: str | Path, class_names: Sequence[str], *,
                  name: str, image_shape: tuple[int, int] | None = None) -> ArraySampleSet:
    """A lazily-read sample set from an idx image file (N x rows x cols uint8) and its label file.

    Headers, sizes, counts and label values are checked now; pixels are decompressed
    on first use. Identity is the two files' content identity, so a cached run does
    not need to decompress the images at all.
    """
    images_path, labels_path = Path(images_path), Path(labels_path)
    img = read_header(images_path, ndim=3)
    if img.dtype != np.uint8:
        raise DataError(f"{images_path}: images must be uint8 (idx type 0x08), found {img.dtype}")
    if image_shape is not None and img.shape[1:] != tuple(image_shape):
        raise DataError(f"{images_path}: images are {img.shape[1]}x{img.shape[2]}, "
                        f"expected {image_shape[0]}x{image_shape[1]}")
    lab = read_header(labels_path, ndim=1)
    if lab.shape[0] != img.shape[0]:
        raise DataError(f"{labels_path} holds {lab.shape[0]} labels but {images_path} holds "
                        f"{img.shape[0]} images; the two files must come from the same split")
    labels = read_idx(labels_path, header=lab).astype(np.int64)
    bad = (labels < 0) | (labels >= len(class_names))
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise DataError(f"{labels_path}: label {labels[first]} at sample {first} is outside "
                        f"0..{len(class_names) - 1}")
    content_id = hash_json({"format": "idx", "images": file_identity(images_path)})
    return ArraySampleSet(lambda: read_idx(images_path, header=img), labels, class_names, name=name,
                          content_id=content_id)
