"""Read a sample-chunked HDF5 entry (written by :class:`stores.h5_entry.H5Writer`) chunk by chunk.

Readers open the file lazily, read-only and once per process (h5py handles do not survive
``fork``) and pickle as path + layout, so they can be shipped to DataLoader/dask workers.
:meth:`H5Reader.verify` checks every chunk against the crc32 recorded when it was written
(:mod:`stores.h5_chunks`) and decodes it; files written before that record existed (format
``/1``) are read as before, and verify can only decode theirs. This module does not import zarr.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from stores.errors import CorruptChunkError, EntryReadError, StoreNotFoundError
from stores.h5_chunks import CHECKSUM, ChunkDecoder, ChunkRecord, PlainDecoder, crc32, is_record, read_record
from stores.h5_format import (
    ATTR_COMPLETE,
    ATTR_FORMAT,
    ATTR_JSON,
    DECODE_ERRORS,
    FORMAT,
    READABLE_FORMATS,
    entry_file,
)
from stores.integrity import ChunkChecksum, ChunkProblem
from stores.layout import ArraySpec, ChunkedReader, split_name
from stores.throttle import ThrottleDevice, ThrottledFile, ThrottleProfile, as_device


@dataclass(frozen=True)
class _StoredChunk:
    """One chunk as :meth:`H5Reader.fetch_chunk` read it: array name -> (filter mask, stored bytes)."""

    index: int
    count: int
    arrays: dict[str, tuple[int, bytes]]


def _crc_mismatch(raw: bytes, recorded: np.ndarray, index: int) -> str | None:
    """Why chunk ``index``'s stored bytes ``raw`` do not match the crc32s ``recorded`` for its array (None:
    they do)."""
    if index >= len(recorded):
        return f"no crc32 is recorded for it (the record holds {len(recorded)} chunks)"
    found = crc32(raw)
    if found != int(recorded[index]):
        return (f"its stored bytes have crc32 {found:08x}, the crc32 recorded when it was written "
                f"is {int(recorded[index]):08x}")
    return None


# Handles inherited through fork are parked, never closed in the child: closing an HDF5 handle
# that the parent still uses would flush or free state the parent relies on.
_INHERITED: list[Any] = []


class H5Reader(ChunkedReader):
    """Read a sample-chunked HDF5 entry; turns checksum/decode failures into CorruptChunkError.

    ``throttle``: a slow-storage profile (``sdcard``, ``emmc``, ``ssd``, a
    :class:`~stores.throttle.ThrottleProfile` or a shared device) to read the file through
    :class:`~stores.throttle.ThrottledFile`, for benchmarks and tests; ``device`` then
    holds the simulated device's statistics.
    """

    KIND = "HDF5"
    # True where every array's filters can be undone without HDF5 (PlainDecoder) and the file records
    # each chunk's crc32: fetch_chunk then reads the stored bytes only (under h5py's lock) and
    # decode_chunk checks and inflates them outside it, so a prefetcher overlaps the two. Else
    # fetch_chunk reads and decodes through h5py and decode_chunk is the identity.
    separate_decode = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        throttle: ThrottleProfile | ThrottleDevice | str | None = None,
    ) -> None:
        self.path = Path(path)
        self.file = entry_file(self.path)
        self.device = None if throttle is None else as_device(throttle)
        self._fileobj: ThrottledFile | None = None
        self._handle: h5py.File | None = None
        self._pid: int | None = None
        self._locks: dict[int, threading.Lock] = {}
        self._dsets: dict[str, h5py.Dataset] = {}
        if not self.file.is_file():
            raise StoreNotFoundError(f"HDF5 entry file {self.file} does not exist")
        with self._lock():
            f = self._file()
            self._attrs, shapes = self._read_layout(f)
            self.record: ChunkRecord | None = read_record(f, self.file)
        # What verify() checks each chunk against: the recorded crc32s (format /2), or nothing (/1).
        self.chunk_checksum: ChunkChecksum | None = CHECKSUM if self.record is not None else None
        self._specs: dict[str, ArraySpec] = {}
        self._start_layout(self.file)
        for name, (shape, chunks, dtype) in sorted(shapes.items()):
            self._add_array(name, shape, chunks)
            self._specs[name] = ArraySpec(tuple(shape[1:]), dtype)
        self._plain = {name: PlainDecoder.of(self._dataset(name)) for name in self._specs}
        self.separate_decode = self.record is not None and all(d is not None for d in self._plain.values())

    # ----------------------------------------------------------------- process/handle management

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_handle=None, _pid=None, _locks={}, _dsets={}, _fileobj=None)
        return state

    def _lock(self) -> threading.Lock:
        pid = os.getpid()
        lock = self._locks.get(pid)
        if lock is None:
            lock = self._locks.setdefault(pid, threading.Lock())
        return lock

    def _file(self) -> h5py.File:
        """This process's read-only handle, opened on first use; call with the lock held."""
        pid = os.getpid()
        if self._pid == pid and self._handle is not None:
            return self._handle
        if self._handle is not None:  # inherited through fork: park it, never use or close it here
            _INHERITED.append(self._handle)
        self._handle, self._dsets = None, {}
        try:
            # No chunk cache: every read_chunk decodes a chunk once; caching would only hold
            # copies of data the pipeline already has (RAM is scarce on the devices this targets).
            if self.device is None:
                self._handle = h5py.File(self.file, "r", rdcc_nbytes=0)
            else:
                self._fileobj = ThrottledFile(self.file, self.device)
                self._handle = h5py.File(self._fileobj, "r", rdcc_nbytes=0)
        except (OSError, ValueError) as exc:
            raise EntryReadError(
                f"{self.file} cannot be opened as an HDF5 file: {exc}. Expected a complete HDF5 entry "
                "not held open for writing by another process."
            ) from exc
        self._pid = pid
        return self._handle

    def _dataset(self, name: str) -> h5py.Dataset:
        with self._lock():
            f = self._file()
            dset = self._dsets.get(name)
            if dset is None:
                dset = self._dsets[name] = f[name]
            return dset

    def close(self) -> None:
        """Close this process's handle; the reader reopens on next use."""
        with self._lock():
            if self._handle is not None and self._pid == os.getpid():
                self._handle.close()
                if self._fileobj is not None:
                    self._fileobj.close()
            self._handle, self._pid, self._dsets, self._fileobj = None, None, {}, None

    def __enter__(self) -> H5Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------------------------- layout

    def _read_layout(
        self, f: h5py.File
    ) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], tuple[int, ...] | None, str]]]:
        fmt = f.attrs.get(ATTR_FORMAT)
        fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
        if fmt not in READABLE_FORMATS:
            raise EntryReadError(
                f"{self.file} is not an ondevice-tl HDF5 entry this version reads: root attribute "
                f"{ATTR_FORMAT!r} is {fmt!r}, expected one of {list(READABLE_FORMATS)}"
                + (" (written by a newer version?)" if str(fmt).startswith(FORMAT.rpartition("/")[0]) else "")
            )
        if not bool(f.attrs.get(ATTR_COMPLETE, False)):
            raise EntryReadError(
                f"HDF5 entry {self.file} was never completed (its writer crashed, was abandoned, or "
                "close() failed); remove it and rebuild the entry"
            )
        try:
            attrs = json.loads(f.attrs[ATTR_JSON])
        except (KeyError, TypeError, ValueError) as exc:
            raise EntryReadError(
                f"HDF5 entry {self.file}: attribute {ATTR_JSON!r} is not JSON: {exc}"
            ) from None
        shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None, str]] = {}

        def visit(name: str, node: Any) -> None:
            if isinstance(node, h5py.Dataset) and not is_record(name):  # the checksums are not an array
                shapes[name] = (tuple(node.shape), node.chunks, str(node.dtype))

        f.visititems(visit)
        return attrs, shapes

    @property
    def arrays(self) -> dict[str, ArraySpec]:
        """Full array name -> per-sample spec."""
        return dict(self._specs)

    @property
    def _names(self) -> dict[str, ArraySpec]:
        return self._specs

    @property
    def attrs(self) -> dict[str, Any]:
        copied: dict[str, Any] = json.loads(json.dumps(self._attrs))  # a deep copy: callers may mutate it
        return copied

    # ---------------------------------------------------------------------------------- reads

    def _chunk_rows(self, group: str, index: int) -> tuple[str, int, int]:
        """(group, first row, end row) of chunk ``index`` of ``group``; EntryReadError when out of range."""
        group = self._group(group)
        total = self.num_chunks(group)
        if not isinstance(index, int | np.integer) or not 0 <= index < total:
            raise EntryReadError(
                f"chunk index {index!r} out of range for group {group!r} ({total} chunks) in {self.file}"
            )
        c = self._chunk[group]
        return group, int(index) * c, min((int(index) + 1) * c, self._count[group])

    def read_chunk(self, group: str, index: int) -> dict[str, np.ndarray]:
        """All arrays of ``group`` for the samples of chunk ``index`` (leaf name -> array)."""
        if self.separate_decode:
            return self.decode_chunk(self.fetch_chunk(group, index))
        group, lo, hi = self._chunk_rows(group, index)
        return {
            split_name(name)[1]: self._read_in_chunk(name, int(index), lo, hi)
            for name in sorted(self._specs)
            if split_name(name)[0] == group
        }

    def fetch_chunk(self, group: str, index: int) -> Any:
        """The I/O half of :meth:`read_chunk`: each array's stored bytes of chunk ``index`` (with
        ``separate_decode``; else the whole read, decoded). A missing chunk is a CorruptChunkError here."""
        if not self.separate_decode:
            return self.read_chunk(group, index)
        group, lo, hi = self._chunk_rows(group, index)
        stored: dict[str, tuple[int, bytes]] = {}
        for name in sorted(self._specs):
            if split_name(name)[0] != group:
                continue
            try:
                found = self.stored_chunk(name, int(index))
            except DECODE_ERRORS as exc:
                raise CorruptChunkError(str(self.file), name, int(index), f"its stored bytes cannot be read "
                                        f"({type(exc).__name__}: {exc})") from exc
            if found is None:
                raise CorruptChunkError(str(self.file), name, int(index),
                                        "the chunk is missing (never written; HDF5 would return zeros)")
            stored[name] = (found[0], found[1])
        return _StoredChunk(int(index), hi - lo, stored)

    def decode_chunk(self, raw: Any) -> dict[str, np.ndarray]:
        """The CPU half: each array's stored bytes checked against the recorded crc32 and decoded
        (:class:`~stores.h5_chunks.PlainDecoder`, no HDF5 call). A chunk :meth:`fetch_chunk` already
        decoded is returned as it is."""
        if not isinstance(raw, _StoredChunk):
            return raw  # type: ignore[no-any-return]
        assert self.record is not None
        out: dict[str, np.ndarray] = {}
        for name, (mask, data) in raw.arrays.items():
            recorded = self.record.crc32.get(name)
            mismatch = "no crc32 is recorded for it" if recorded is None else \
                _crc_mismatch(data, recorded, raw.index)
            if mismatch is not None:
                raise CorruptChunkError(str(self.file), name, raw.index, mismatch)
            decode = self._plain[name]
            assert decode is not None
            try:
                out[split_name(name)[1]] = decode(data, mask, raw.count)
            except (ValueError, zlib.error) as exc:
                raise CorruptChunkError(str(self.file), name, raw.index,
                                        f"undecodable data ({type(exc).__name__}: {exc})") from exc
        return out

    def _read_in_chunk(self, name: str, index: int, lo: int, hi: int) -> np.ndarray:
        dset = self._dataset(name)
        coord = (index * self._chunk[split_name(name)[0]],) + (0,) * (dset.ndim - 1)
        try:
            if dset.id.get_chunk_info_by_coord(coord).byte_offset is None:
                raise CorruptChunkError(
                    str(self.file),
                    name,
                    index,
                    "the chunk is missing (never written; HDF5 would return zeros)",
                )
            return np.asarray(dset[lo:hi])
        except CorruptChunkError:
            raise
        except DECODE_ERRORS as exc:
            raise CorruptChunkError(
                str(self.file),
                name,
                index,
                f"fletcher32 checksum mismatch or undecodable data ({type(exc).__name__}: {exc})",
            ) from exc

    # --------------------------------------------------------------------------------- verify

    def stored_chunk(self, name: str, index: int) -> tuple[int, bytes, int, int] | None:
        """Chunk ``index`` of array ``name`` as stored: (filter mask, bytes, byte offset, size), or None
        when the file has no such chunk. Raises what h5py raises for an unreadable one."""
        dset = self._dataset(name)
        coord = (index * self._chunk[split_name(name)[0]],) + (0,) * (dset.ndim - 1)
        info = dset.id.get_chunk_info_by_coord(coord)
        if info.byte_offset is None:
            return None
        mask, raw = dset.id.read_direct_chunk(coord)
        return int(mask), bytes(raw), int(info.byte_offset), int(info.size)

    def verify(self) -> list[ChunkProblem]:
        """Check every chunk of every array against its recorded crc32 and decode it; the bad ones.

        Each chunk's stored bytes are read once (through the slow-storage simulator when the
        reader has one) and decoded from memory (:class:`~stores.h5_chunks.ChunkDecoder`:
        HDF5's own filters, fletcher32 included). A problem names the file and the bytes the
        chunk occupies in it. Without a record (format /1) chunks are only decoded.
        """
        problems: list[ChunkProblem] = []
        crcs = self.record.crc32 if self.record is not None else {}
        for name in sorted(self._specs):
            group = split_name(name)[0]
            n, c = self._count[group], self._chunk[group]
            decode = ChunkDecoder(self._dataset(name))
            try:
                for index in range(-(-n // c)):
                    count = min(c, n - index * c)
                    reason, where = self._check_chunk(name, index, count, crcs.get(name), decode)
                    if reason is not None:
                        problems.append(ChunkProblem(name, index, reason, file=self.file, where=where))
            finally:
                decode.close()
        return problems

    def _check_chunk(
        self, name: str, index: int, count: int, recorded: np.ndarray | None, decode: ChunkDecoder
    ) -> tuple[str | None, str | None]:
        """(why chunk ``index`` of ``name`` is bad, or None; where it is in the file)."""
        try:
            stored = self.stored_chunk(name, index)
        except DECODE_ERRORS as exc:
            return f"its stored bytes cannot be read ({type(exc).__name__}: {exc})", None
        if stored is None:
            return "the chunk is missing (never written; HDF5 would return zeros)", None
        mask, raw, offset, size = stored
        where = f"bytes {offset}..{offset + size - 1}"
        if recorded is not None and (mismatch := _crc_mismatch(raw, recorded, index)) is not None:
            return mismatch, where
        try:
            decode(raw, mask, count)
        except DECODE_ERRORS as exc:
            return f"fletcher32 checksum mismatch or undecodable data ({type(exc).__name__}: {exc})", where
        return None, where
