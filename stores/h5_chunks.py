"""Per-chunk checksums inside an HDF5 entry, and decoding one chunk's stored bytes (through HDF5, or
without it: :class:`PlainDecoder`).

Why record a checksum per chunk when HDF5's ``fletcher32`` filter already checks each one:

- fletcher32 says a chunk is consistent with itself, not that it is the chunk written there:
  two chunks swapped in the file (or a chunk index pointing at another valid chunk) pass it,
  and h5py returns the wrong samples without a word (tests/stores/test_h5_integrity.py);
- a repair must know whether a recomputed chunk is byte-identical to the one it replaces
  (then the whole file is again the one the manifest's sha256 describes);
- an entry may have been written without fletcher32 (``checksum=False``).

So the writer records zlib's crc32 of every chunk's stored (filtered) bytes, the values its
progress log already computes for resume (:mod:`stores.h5_progress`), in the file itself
when it closes (format ``ondevice-tl-h5-entry/2``), one plain HDF5 group beside the arrays::

    /.ondevice_tl_chunks                  attrs: format, checksum ("crc32"), groups (JSON list)
    /.ondevice_tl_chunks/crc32/<array>    uint32, one per chunk of the array
    /.ondevice_tl_chunks/rows             int64 (rows, 2): group number, chunk index, in write order

In the file rather than beside it: a committed HDF5 entry stays one file (FAT/exFAT cards,
copying it around), and the record is as plain as the data (HDFView shows it). Datasets,
not attributes: an attribute in HDF5's default (oldest, most portable) file format holds at
most 64 KiB, 16 Ki chunks. The row order is what a repair needs to rewrite the file
byte-identical to its build (HDF5 lays chunks out in the order they are written, and a
caller may interleave groups). The name starts with '.', which no array name may (see
:func:`stores.layout.check_array_name`), so it never clashes with an array. Everything here
is a function of the data and settings (no times, no randomness): two builds of the same
data write the same record.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import h5py
import numpy as np

from stores.errors import EntryReadError

RECORD = ".ondevice_tl_chunks"
RECORD_FORMAT = "ondevice-tl-h5-chunks/1"
CHECKSUM: Literal["crc32"] = "crc32"


@dataclass(frozen=True)
class ChunkRecord:
    """The record read back: array -> crc32 of each chunk's stored bytes; rows (group, chunk), as written."""

    crc32: dict[str, np.ndarray]
    rows: list[tuple[str, int]]


def is_record(name: str) -> bool:
    """True for the record group and everything in it (an HDF5 path relative to the root)."""
    name = name.lstrip("/")
    return name == RECORD or name.startswith(RECORD + "/")


def crc32(raw: bytes) -> int:
    return zlib.crc32(raw) & 0xFFFFFFFF


def write_record(
    h5: h5py.File,
    rows: Iterable[tuple[str, int, Mapping[str, int]]],
    num_chunks: Mapping[str, int],
    groups: list[str],
) -> None:
    """Write the record of ``rows`` ((group, chunk index, array -> crc32), in write order) into ``h5``.

    ``num_chunks``: array -> its number of chunks; every chunk must have been logged once.
    """
    crcs = {name: np.zeros(count, dtype="<u4") for name, count in num_chunks.items()}
    seen = {name: np.zeros(count, dtype=bool) for name, count in num_chunks.items()}
    order: list[tuple[int, int]] = []
    number = {group: i for i, group in enumerate(groups)}
    for group, index, row in rows:
        order.append((number[group], index))
        for name, value in row.items():
            crcs[name][index] = value
            seen[name][index] = True
    unlogged = {name: int(np.flatnonzero(~s)[0]) for name, s in seen.items() if not s.all()}
    if unlogged:  # a writer bug, never a data problem: refuse to record a checksum that was not computed
        raise AssertionError(f"chunks written without a crc32 (array -> first such chunk): {unlogged}")
    record = h5.create_group(RECORD)
    record.attrs["format"] = RECORD_FORMAT
    record.attrs["checksum"] = CHECKSUM
    record.attrs["groups"] = json.dumps(groups)
    for name in sorted(crcs):
        record.create_dataset(f"crc32/{name}", data=crcs[name])
    record.create_dataset("rows", data=np.asarray(order, dtype="<i8").reshape(-1, 2))


def read_record(h5: h5py.File, file: object) -> ChunkRecord | None:
    """The record of ``h5`` (named ``file`` in errors), or None for a file written without one."""
    if RECORD not in h5:
        return None
    try:
        record = h5[RECORD]
        fmt = record.attrs.get("format")
        fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
        if fmt != RECORD_FORMAT:
            raise EntryReadError(
                f"HDF5 entry {file}: its chunk record {RECORD!r} has format {fmt!r}, "
                f"expected {RECORD_FORMAT!r}"
            )
        groups = json.loads(record.attrs["groups"])
        crcs: dict[str, np.ndarray] = {}

        def visit(name: str, node: Any) -> None:
            if isinstance(node, h5py.Dataset):
                crcs[name] = np.asarray(node[()], dtype=np.uint32)

        record["crc32"].visititems(visit)
        rows = [(str(groups[int(g)]), int(i)) for g, i in np.asarray(record["rows"][()]).reshape(-1, 2)]
    except EntryReadError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, OSError) as exc:
        raise EntryReadError(
            f"HDF5 entry {file}: its chunk record {RECORD!r} cannot be read ({type(exc).__name__}: {exc}); "
            "the entry is damaged: remove it and rebuild it"
        ) from None
    return ChunkRecord(crcs, rows)


def filter_settings(dset: h5py.Dataset) -> dict[str, Any]:
    """The ``create_dataset`` keywords giving ``dset``'s filters (compression, shuffle, checksum)."""
    return {
        "compression": dset.compression,
        "compression_opts": dset.compression_opts,
        "shuffle": bool(dset.shuffle),
        "fletcher32": bool(dset.fletcher32),
        "fillvalue": dset.fillvalue,
    }


class ChunkDecoder:
    """Decodes stored chunk bytes of one dataset with HDF5's own filter pipeline, in memory.

    Verify reads each chunk's stored bytes once (to checksum them) and decodes those same
    bytes here, instead of reading the chunk a second time through ``dset[...]``: on an SD
    card the read is what costs. An in-memory HDF5 file (core driver, never written to disk)
    holds a one-chunk dataset with the same filters; a fletcher32 mismatch or a damaged
    gzip/lzf stream raises what a normal read would.
    """

    def __init__(self, dset: h5py.Dataset) -> None:
        chunks = tuple(dset.chunks)
        self._h5 = h5py.File(f"decoder-{id(self)}", "w", driver="core", backing_store=False, rdcc_nbytes=0)
        self._dset = self._h5.create_dataset(
            "chunk", shape=chunks, chunks=chunks, dtype=dset.dtype, **filter_settings(dset)
        )
        self._origin = (0,) * len(chunks)

    def __call__(self, raw: bytes, filter_mask: int, count: int) -> np.ndarray:
        self._dset.id.write_direct_chunk(self._origin, raw, filter_mask)
        return np.asarray(self._dset[:count])

    def close(self) -> None:
        self._h5.close()


# The filters the writer applies (h5py's shuffle, deflate and fletcher32), in HDF5's filter ids.
SHUFFLE, DEFLATE, FLETCHER32 = h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_FLETCHER32


@dataclass(frozen=True)
class PlainDecoder:
    """Decodes one dataset's stored chunk bytes with zlib and numpy, without calling HDF5.

    Why: every h5py call holds h5py's one global lock, so a chunk decompressed through HDF5 (a
    ``dset[...]`` read or :class:`ChunkDecoder`) stops every other thread's read meanwhile; on slow
    storage the device then idles while the CPU inflates. Undone here, outside the lock (zlib
    releases the GIL), a prefetch thread keeps the next read going. Only for the filters the writer
    uses, undone in reverse order: fletcher32 (its 4 trailing bytes are dropped, not checked: the
    caller checks the chunk's recorded crc32 over all the stored bytes, which is stronger), deflate
    and shuffle. A filter whose bit is set in the chunk's filter mask was skipped on write and is
    skipped here. :meth:`of` gives None for a dataset with any other filter.
    """

    filters: tuple[int, ...]  # as applied on write
    chunk_shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def of(cls, dset: h5py.Dataset) -> PlainDecoder | None:
        if dset.chunks is None:
            return None
        plist = dset.id.get_create_plist()
        filters = tuple(int(plist.get_filter(i)[0]) for i in range(plist.get_nfilters()))
        if any(f not in (SHUFFLE, DEFLATE, FLETCHER32) for f in filters):
            return None
        return cls(filters, tuple(int(c) for c in dset.chunks), np.dtype(dset.dtype))

    def __call__(self, raw: bytes, filter_mask: int, count: int) -> np.ndarray:
        """The first ``count`` samples of the chunk ``raw`` holds; ValueError or zlib.error if damaged."""
        data: bytes | memoryview = raw
        for position in reversed(range(len(self.filters))):
            if filter_mask & (1 << position):
                continue
            kind = self.filters[position]
            if kind == FLETCHER32:
                if len(data) < 4:
                    raise ValueError(f"{len(data)} stored bytes cannot hold a fletcher32 checksum")
                data = memoryview(data)[:-4]
            elif kind == DEFLATE:
                data = zlib.decompress(data)
            elif self.dtype.itemsize > 1:  # SHUFFLE: byte k of every element was stored together
                size = self.dtype.itemsize
                flat = np.frombuffer(data, dtype=np.uint8)
                if flat.size % size:
                    raise ValueError(f"{flat.size} shuffled bytes are not whole {size}-byte values")
                unshuffled = np.empty(flat.size, dtype=np.uint8)  # written once, in element order
                unshuffled.reshape(-1, size)[:] = flat.reshape(size, -1).T
                data = unshuffled.data
        values = np.frombuffer(data, dtype=self.dtype)
        expected = int(np.prod(self.chunk_shape))
        if values.size != expected:
            raise ValueError(f"the chunk decodes to {values.size} values, its shape {self.chunk_shape} "
                             f"holds {expected}")
        chunk = values.reshape(self.chunk_shape)[:count]
        # writable, and not a view of the stored bytes (those are freed once decoded)
        return chunk if values.flags.writeable else chunk.copy()
