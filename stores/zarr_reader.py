"""Read a sample-chunked zarr v3 entry (written by :class:`stores.zarr_entry.ZarrWriter`) chunk by chunk.

A chunk read has an I/O half (:meth:`ZarrReader.fetch_chunk`: the chunk files' stored
bytes, read straight from disk) and a CPU half (:meth:`ZarrReader.decode_chunk`: crc32c
check, decompression, bytes -> array), so a prefetcher can keep slow storage busy on one
thread while another decompresses. Decoding goes through :mod:`stores.zarr_fast`, the one
place zarr internals are used; everything else here is public zarr API.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype
from zarr.codecs import Crc32cCodec

from stores import zarr_fast
from stores.errors import CorruptChunkError, EntryReadError, StoreNotFoundError
from stores.integrity import ChunkChecksum, ChunkProblem
from stores.layout import ArraySpec, ChunkedReader, split_name
from stores.throttle import ThrottleDevice, ThrottleProfile, as_device
from stores.zarr_format import DECODE_ERRORS, META, array_members, chunk_key


@dataclass(frozen=True)
class RawChunk:
    """The stored, still encoded bytes of one chunk of each array of a group (:meth:`ZarrReader.fetch_chunk`).

    ``data`` maps full array name -> the chunk file's bytes (a zarr ``Buffer``).
    """

    group: str
    index: int
    lo: int
    hi: int
    data: Mapping[str, Any]

    @property
    def nbytes(self) -> int:
        """Encoded bytes held (what this chunk costs in a queue of fetched chunks)."""
        return sum(len(buf) for buf in self.data.values())


class ZarrReader(ChunkedReader):
    """Read a sample-chunked entry with stock zarr; turns decode failures into CorruptChunkError.

    ``throttle``: a slow-storage profile (``sdcard``, ``emmc``, ``ssd``, a
    :class:`~stores.throttle.ThrottleProfile` or a shared :class:`~stores.throttle.ThrottleDevice`)
    whose device every file read is booked on, for benchmarks and tests; ``device`` then
    holds the simulated device's statistics.
    """

    KIND = "zarr"
    # read_chunk = decode_chunk(fetch_chunk(...)), and only fetch_chunk does I/O: a prefetcher
    # may run the two halves on different threads.
    separate_decode = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        throttle: ThrottleProfile | ThrottleDevice | str | None = None,
    ) -> None:
        self.path = Path(path)
        self.device: ThrottleDevice | None = None if throttle is None else as_device(throttle)
        if not self.path.is_dir():
            raise StoreNotFoundError(f"zarr entry directory {self.path} does not exist")
        try:
            self._root = zarr.open_group(self.path, mode="r", zarr_format=3)
        except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
            raise EntryReadError(f"{self.path} is not a readable zarr v3 group: {exc}") from None
        self._arrays: dict[str, Any] = array_members(self._root)
        self._decoders = {name: zarr_fast.decoder(arr) for name, arr in self._arrays.items()}
        if self.device is not None:  # opening read the metadata documents: one command each
            self.device.read_many(
                [(self.path / name / META).stat().st_size for name in ["", *sorted(self._arrays)]]
            )
        self._start_layout(self.path)
        for name, arr in sorted(self._arrays.items()):
            self._add_array(name, arr.shape, arr.chunks)
        # Every entry this package writes has the crc32c codec (ZarrWriter's checksum=True); one
        # written without it can only be decoded by verify, and says so.
        self.chunk_checksum: ChunkChecksum | None = (
            "crc32c"
            if all(any(isinstance(c, Crc32cCodec) for c in a.metadata.codecs) for a in self._arrays.values())
            else None
        )

    @property
    def arrays(self) -> dict[str, ArraySpec]:
        """Full array name -> per-sample spec."""
        return {n: ArraySpec(tuple(a.shape[1:]), str(a.dtype)) for n, a in sorted(self._arrays.items())}

    @property
    def _names(self) -> dict[str, Any]:
        return self._arrays

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self._root.attrs)

    def close(self) -> None:
        """Nothing to release: every read opens and closes its own files."""

    def read_chunk(self, group: str, index: int) -> dict[str, np.ndarray]:
        """All arrays of ``group`` for the samples of chunk ``index`` (leaf name -> array)."""
        return self.decode_chunk(self.fetch_chunk(group, index))

    def fetch_chunk(self, group: str, index: int) -> RawChunk:
        """The I/O half of :meth:`read_chunk`: encoded bytes of chunk ``index`` of every array of ``group``.

        One whole-file read per array (a throttled reader books them on its device back to back,
        and nothing in :meth:`decode_chunk` touches storage). A missing chunk file is a
        :class:`CorruptChunkError` here already, as in :meth:`read`.
        """
        group = self._group(group)
        total = self.num_chunks(group)
        if not isinstance(index, int | np.integer) or not 0 <= index < total:
            raise EntryReadError(
                f"chunk index {index!r} out of range for group {group!r} ({total} chunks) in {self.path}"
            )
        index = int(index)
        c = self._chunk[group]
        lo, hi = index * c, min((index + 1) * c, self._count[group])
        names = [name for name in sorted(self._arrays) if split_name(name)[0] == group]
        make = default_buffer_prototype().buffer.from_bytes
        data: dict[str, Any] = {}
        for name in names:
            key = chunk_key(self._arrays[name], index)
            try:
                with open(self.path / name / key, "rb") as f:
                    data[name] = make(f.read())
            except FileNotFoundError:
                raise CorruptChunkError(
                    str(self.path), name, index, f"chunk file {name}/{key} is missing"
                ) from None
        if self.device is not None:
            self.device.read_many([len(buf) for buf in data.values()])
        return RawChunk(group, index, lo, hi, data)

    def decode_chunk(self, raw: RawChunk) -> dict[str, np.ndarray]:
        """The CPU half of :meth:`read_chunk`: crc32c check, decompression and bytes -> array (leaf -> array).

        Runs each array's own zarr codecs (the ones named in its ``zarr.json``) in reverse
        (:mod:`stores.zarr_fast`), so the crc32c check and the errors are exactly those of a
        stock zarr read; a failure is a :class:`CorruptChunkError` naming the entry, array and chunk.
        """
        out: dict[str, np.ndarray] = {}
        for name, buf in raw.data.items():
            out[split_name(name)[1]] = self._decode(name, raw.index, buf)[: raw.hi - raw.lo]
        return out

    def _decode(self, name: str, index: int, buf: Any) -> np.ndarray:
        decode = self._decoders[name]
        if decode is None:
            # A zarr without the fast path's hooks: decode by reading the chunk the stock way (I/O again).
            arr = self._arrays[name]
            c, n = int(arr.chunks[0]), int(arr.shape[0])
            return self._read_in_chunk(name, index, index * c, min((index + 1) * c, n))
        try:
            out = decode(buf, index)
        except DECODE_ERRORS as exc:
            # crc32c mismatch raises ValueError; a damaged zstd/blosc frame raises RuntimeError.
            raise CorruptChunkError(str(self.path), name, index, f"{type(exc).__name__}: {exc}") from exc
        # A codec may hand back a view of its immutable bytes; callers (torch) expect to own the array.
        return out if out.flags.writeable else out.copy()

    def _read_in_chunk(self, name: str, index: int, lo: int, hi: int) -> np.ndarray:
        arr = self._arrays[name]
        file = self.path / name / chunk_key(arr, index)
        # Stock zarr returns the fill value for a missing chunk; here that is data loss, not zeros.
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            missing = f"chunk file {name}/{chunk_key(arr, index)} is missing"
            raise CorruptChunkError(str(self.path), name, index, missing) from None
        try:
            values = np.asarray(arr[lo:hi])
        except DECODE_ERRORS as exc:
            # crc32c mismatch raises ValueError; a damaged zstd/blosc frame raises RuntimeError.
            raise CorruptChunkError(str(self.path), name, index, f"{type(exc).__name__}: {exc}") from exc
        if self.device is not None:
            self.device.read_many([size])
        return values

    def chunk_key(self, array: str, index: int) -> str:
        """Path of chunk ``index`` of ``array`` (full name) relative to the hierarchy root, e.g. 'a/c/3/0'."""
        if array not in self._arrays:
            raise EntryReadError(f"no array {array!r} in {self.path}; arrays: {sorted(self._arrays)}")
        return f"{array}/{chunk_key(self._arrays[array], index)}"

    def verify(self) -> list[ChunkProblem]:
        """Read and decode every chunk of every array (crc32c checked); the ones that fail, in order.

        Reads the whole entry once, chunk by chunk (memory stays at one chunk), through the
        slow-storage simulator when the reader has one. Each problem names the chunk's file.
        """
        problems: list[ChunkProblem] = []
        for name in sorted(self._arrays):
            group = split_name(name)[0]
            n, c = self._count[group], self._chunk[group]
            for index in range(-(-n // c)):
                try:
                    self._read_in_chunk(name, index, index * c, min((index + 1) * c, n))
                except CorruptChunkError as exc:
                    file = self.path / name / chunk_key(self._arrays[name], index)
                    problems.append(ChunkProblem(name, index, exc.reason, file=file))
        return problems
