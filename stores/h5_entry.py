"""Write and read sample-chunked arrays in one HDF5 file: the HDF5 twin of :mod:`stores.zarr_entry`.

Same arguments, same semantics, different container. Why offer it: one file per entry instead
of one file per chunk (FAT/exFAT SD cards handle few large files much better than thousands of
small ones), and HDF5 is readable from MATLAB, C, Julia and HDFView without zarr.

The result is plain HDF5 (``h5py.File(path)["train/codes"][:]`` reads an array):

- Array ``group/leaf`` is the dataset ``/group/leaf`` of shape ``(num_samples, *sample_shape)``,
  chunked ``(chunk_samples, *sample_shape)``: chunks split axis 0 (samples) only, exactly as in
  the zarr layout, so a chunk index addresses the same samples in every array of a group.
  Axis 0 is declared resizable (``maxshape=None``) only because HDF5 refuses a chunk longer
  than a fixed dimension; the writer never resizes.
- Filters: optional byte ``shuffle`` (for multi-byte dtypes) and ``gzip`` (level 0-9) or
  ``lzf``, then HDF5's ``fletcher32`` checksum per chunk (``checksum=True``), so a flipped bit
  in a chunk is reported as :class:`CorruptChunkError` naming file, array and chunk.
- Root attributes: ``ondevice_tl_attrs`` (the user's attrs as a JSON string, so any JSON value
  round-trips, which HDF5 attributes alone cannot do), ``ondevice_tl_format`` and
  ``ondevice_tl_complete`` (set only by a successful ``close()``, so a reader refuses a file
  whose writer crashed or was abandoned instead of returning fill values).
- A chunk that was never written is reported as missing (HDF5 would silently return zeros).

Writing buffers at most one chunk per array and writes every chunk exactly once and whole,
strictly in sample order (no read-modify-write; bounded memory; HDF5's chunk cache is
disabled so written chunks go straight to the OS). Durability is the catalog's job: a staging
directory is fsynced and renamed on commit. An HDF5 file is not crash-consistent on its own
(see :mod:`stores.h5_store`), which is fine here because an unpublished entry is rebuilt.

``path`` may be an HDF5 file path or a directory (e.g. a catalog staging directory); in a
directory the file is ``path / "entry.h5"``.

Readers open the file lazily, read-only and once per process (h5py handles do not survive
``fork``) and pickle as path + layout, so they can be shipped to DataLoader/dask workers.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import h5py
import numpy as np

from stores.errors import CorruptChunkError, EntryReadError, EntryWriteError, StoreNotFoundError
from stores.zarr_entry import ArraySpec, _check_name, _did_you_mean, _sample_counts, split_name

__all__ = ["ENTRY_FILENAME", "H5Reader", "H5Writer", "entry_file"]

Compressor = Literal["gzip", "lzf", "none"]
_COMPRESSORS = ("gzip", "lzf", "none")
ENTRY_FILENAME = "entry.h5"
FORMAT = "ondevice-tl-h5-entry/1"
_ATTR_FORMAT = "ondevice_tl_format"
_ATTR_JSON = "ondevice_tl_attrs"
_ATTR_COMPLETE = "ondevice_tl_complete"
# h5py/HDF5 report a failed fletcher32 check or an undecodable gzip/lzf stream as OSError;
# numpy/h5py conversion problems surface as ValueError/RuntimeError/TypeError.
_DECODE_ERRORS = (OSError, ValueError, RuntimeError, TypeError)
# Handles inherited through fork are parked, never closed in the child (see stores.h5_store).
_INHERITED: list[Any] = []


def entry_file(path: str | os.PathLike[str]) -> Path:
    """The HDF5 file of an entry: ``path`` itself, or ``path/entry.h5`` if ``path`` is a directory."""
    path = Path(path)
    return path / ENTRY_FILENAME if path.is_dir() else path


class H5Writer:
    """Append samples group by group; ``close()`` checks every array got exactly its sample count.

    ``compressor`` is "gzip" (``level`` 0-9), "lzf" (fast, no level) or "none"; ``level`` is
    validated for gzip and ignored otherwise.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        arrays: Mapping[str, ArraySpec],
        num_samples: int | Mapping[str, int],
        chunk_samples: int,
        attrs: Mapping[str, Any] | None = None,
        compressor: Compressor = "gzip",
        level: int = 4,
        checksum: bool = True,
    ) -> None:
        self.path = Path(path)
        self.file = entry_file(self.path)
        if compressor not in _COMPRESSORS:
            raise EntryWriteError(f"compressor must be one of {list(_COMPRESSORS)}, got {compressor!r}")
        if compressor == "gzip" and (not isinstance(level, int) or not 0 <= level <= 9):
            raise EntryWriteError(f"gzip level must be in [0, 9], got {level!r}")
        if not isinstance(chunk_samples, int) or chunk_samples < 1:
            raise EntryWriteError(f"chunk_samples must be a positive int, got {chunk_samples!r}")
        if not arrays:
            raise EntryWriteError(f"no arrays declared for HDF5 entry {self.file}")
        self.chunk_samples = chunk_samples
        self.specs = {_check_name(name): spec for name, spec in arrays.items()}
        for name in self.specs:
            clash = [other for other in self.specs if other.startswith(name + "/")]
            if clash:
                raise EntryWriteError(f"array {name!r} cannot also be a group holding {clash} in {self.file}")
        self.groups = sorted({split_name(name)[0] for name in self.specs})
        self.num_samples = _sample_counts(num_samples, self.groups, self.file)
        try:
            attrs_json = json.dumps(dict(attrs or {}), allow_nan=False, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise EntryWriteError(f"attrs for HDF5 entry {self.file} are not JSON-able: {exc}") from None
        if self.file.exists():
            raise EntryWriteError(f"{self.file} already exists; write an HDF5 entry into a fresh file")
        if not self.file.parent.is_dir():
            raise StoreNotFoundError(
                f"directory {self.file.parent} for HDF5 entry {self.file} does not exist"
            )
        try:
            # rdcc_nbytes=0: no chunk cache, so memory is bounded by our one-chunk buffers.
            self._h5 = h5py.File(self.file, "w-", rdcc_nbytes=0)
        except (OSError, ValueError) as exc:
            raise EntryWriteError(f"cannot create HDF5 entry {self.file}: {exc}") from exc
        try:
            self._h5.attrs[_ATTR_FORMAT] = FORMAT
            self._h5.attrs[_ATTR_JSON] = attrs_json
            self._h5.attrs[_ATTR_COMPLETE] = False
            self._dsets: dict[str, h5py.Dataset] = {}
            for name, spec in sorted(self.specs.items()):
                self._dsets[name] = self._create(name, spec, compressor, level, checksum)
        except BaseException:
            self._h5.close()
            self.file.unlink(missing_ok=True)
            raise
        self._buffers: dict[str, np.ndarray] = {}
        self._filled = dict.fromkeys(self.specs, 0)  # samples in the buffer
        self._written = dict.fromkeys(self.specs, 0)  # samples already persisted in whole chunks
        self._closed = False

    def _create(
        self, name: str, spec: ArraySpec, compressor: str, level: int, checksum: bool
    ) -> h5py.Dataset:
        n = self.num_samples[split_name(name)[0]]
        itemsize = np.dtype(spec.dtype).itemsize
        compressing = compressor != "none"
        return self._h5.create_dataset(
            name,
            shape=(n, *spec.sample_shape),
            maxshape=(None, *spec.sample_shape),
            chunks=(self.chunk_samples, *spec.sample_shape),
            dtype=spec.dtype,
            compression=compressor if compressing else None,
            compression_opts=level if compressor == "gzip" else None,
            shuffle=compressing and itemsize > 1,
            fletcher32=checksum,
            fillvalue=np.zeros((), spec.dtype),
        )

    def received(self, name: str) -> int:
        """Samples accepted so far for array ``name``."""
        return self._written[name] + self._filled[name]

    def write(self, group: str, batch: Mapping[str, np.ndarray]) -> None:
        """Append the next samples of ``group`` ('' for top-level arrays); keys are leaf names.

        Arrays of one batch must have the same number of samples; arrays of a group may be
        written in separate calls but each one strictly in sample order.
        """
        if self._closed:
            raise EntryWriteError(f"HDF5 writer for {self.file} is closed")
        group = group.strip("/")
        if group not in self.num_samples:
            raise EntryWriteError(
                f"unknown group {group!r} in HDF5 entry {self.file}; groups are {self.groups}"
                + _did_you_mean(group, self.groups)
            )
        if not batch:
            raise EntryWriteError(f"empty batch written to group {group!r} of {self.file}")
        prepared: dict[str, np.ndarray] = {}
        for leaf, data in batch.items():
            name = f"{group}/{leaf}" if group else leaf
            prepared[name] = self._check_batch(name, group, data)
        lengths = {name: len(arr) for name, arr in prepared.items()}
        if len(set(lengths.values())) > 1:
            raise EntryWriteError(f"batch for group {group!r} of {self.file} mixes sample counts: {lengths}")
        for name, data in prepared.items():
            self._append(name, data)

    def _check_batch(self, name: str, group: str, data: np.ndarray) -> np.ndarray:
        if name not in self.specs:
            leaves = [split_name(n)[1] for n in self.specs if split_name(n)[0] == group]
            raise EntryWriteError(
                f"array {split_name(name)[1]!r} is not declared in group {group!r} of {self.file}; "
                f"declared: {leaves}" + _did_you_mean(split_name(name)[1], leaves)
            )
        spec = self.specs[name]
        arr = np.asarray(data)
        if arr.ndim == 0 or arr.shape[1:] != spec.sample_shape:
            raise EntryWriteError(
                f"array {name!r} in {self.file}: expected a batch of samples of shape {spec.sample_shape} "
                f"(array shape (n, *{spec.sample_shape})), got {arr.shape}"
            )
        if arr.dtype != np.dtype(spec.dtype) and not np.can_cast(arr.dtype, spec.dtype, casting="safe"):
            raise EntryWriteError(
                f"array {name!r} in {self.file}: expected dtype {spec.dtype} (or one that casts safely), "
                f"got {arr.dtype}"
            )
        expected = self.num_samples[split_name(name)[0]]
        if self.received(name) + len(arr) > expected:
            raise EntryWriteError(
                f"array {name!r} in {self.file}: expected {expected} samples in total, got at least "
                f"{self.received(name) + len(arr)} (this batch of {len(arr)} overflows)"
            )
        return arr

    def _append(self, name: str, data: np.ndarray) -> None:
        c = self.chunk_samples
        pos = 0
        if self._filled[name]:  # top up the pending chunk first
            take = min(c - self._filled[name], len(data))
            buf = self._buffer(name)
            buf[self._filled[name] : self._filled[name] + take] = data[:take]
            self._filled[name] += take
            pos = take
            if self._filled[name] == c:
                self._flush(name)
        while len(data) - pos >= c:  # whole chunks straight from the caller's batch
            self._store(name, np.ascontiguousarray(data[pos : pos + c], dtype=self.specs[name].dtype))
            pos += c
        if pos < len(data):
            rest = len(data) - pos
            self._buffer(name)[:rest] = data[pos:]
            self._filled[name] = rest

    def _buffer(self, name: str) -> np.ndarray:
        if name not in self._buffers:
            spec = self.specs[name]
            self._buffers[name] = np.empty((self.chunk_samples, *spec.sample_shape), dtype=spec.dtype)
        return self._buffers[name]

    def _flush(self, name: str) -> None:
        self._store(name, self._buffers[name][: self._filled[name]])
        self._filled[name] = 0

    def _store(self, name: str, data: np.ndarray) -> None:
        start = self._written[name]
        self._dsets[name][start : start + len(data)] = data
        self._written[name] = start + len(data)

    def close(self) -> None:
        """Flush the last (possibly short) chunks, mark the file complete; raise if any count is off."""
        if self._closed:
            return
        self._closed = True
        wrong = {
            name: (self.num_samples[split_name(name)[0]], self.received(name))
            for name in self.specs
            if self.received(name) != self.num_samples[split_name(name)[0]]
        }
        try:
            if wrong:
                detail = "; ".join(
                    f"array {n!r}: expected {e} samples, got {g}" for n, (e, g) in sorted(wrong.items())
                )
                raise EntryWriteError(f"HDF5 entry {self.file} is incomplete: {detail}")
            for name in self.specs:
                if self._filled[name]:
                    self._flush(name)
            self._h5.attrs[_ATTR_COMPLETE] = True
        finally:
            self._buffers.clear()
            self._h5.close()

    def abort(self) -> None:
        """Stop without marking the file complete (readers refuse it); the caller removes the file."""
        if not self._closed:
            self._closed = True
            self._buffers.clear()
            self._h5.close()

    def __enter__(self) -> H5Writer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()  # abandoned: the catalog's staging cleanup removes the file


class H5Reader:
    """Read a sample-chunked HDF5 entry; turns checksum/decode failures into CorruptChunkError."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.file = entry_file(self.path)
        self._handle: h5py.File | None = None
        self._pid: int | None = None
        self._locks: dict[int, threading.Lock] = {}
        self._dsets: dict[str, h5py.Dataset] = {}
        if not self.file.is_file():
            raise StoreNotFoundError(f"HDF5 entry file {self.file} does not exist")
        with self._lock():
            f = self._file()
            self._attrs, shapes = self._read_layout(f)
        self._specs: dict[str, ArraySpec] = {}
        self._chunk: dict[str, int] = {}
        self._count: dict[str, int] = {}
        for name, (shape, chunks, dtype) in sorted(shapes.items()):
            self._check_layout(name, shape, chunks, dtype)

    # ----------------------------------------------------------------- process/handle management

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_handle=None, _pid=None, _locks={}, _dsets={})
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
            self._handle = h5py.File(self.file, "r", rdcc_nbytes=0)
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
            self._handle, self._pid, self._dsets = None, None, {}

    def __enter__(self) -> H5Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------------------------- layout

    def _read_layout(
        self, f: h5py.File
    ) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], tuple[int, ...] | None, str]]]:
        fmt = f.attrs.get(_ATTR_FORMAT)
        fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
        if fmt != FORMAT:
            raise EntryReadError(
                f"{self.file} is not an ondevice-tl HDF5 entry: root attribute {_ATTR_FORMAT!r} is "
                f"{fmt!r}, expected {FORMAT!r}"
            )
        if not bool(f.attrs.get(_ATTR_COMPLETE, False)):
            raise EntryReadError(
                f"HDF5 entry {self.file} was never completed (its writer crashed, was abandoned, or "
                "close() failed); remove it and rebuild the entry"
            )
        try:
            attrs = json.loads(f.attrs[_ATTR_JSON])
        except (KeyError, TypeError, ValueError) as exc:
            raise EntryReadError(
                f"HDF5 entry {self.file}: attribute {_ATTR_JSON!r} is not JSON: {exc}"
            ) from None
        shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None, str]] = {}

        def visit(name: str, node: Any) -> None:
            if isinstance(node, h5py.Dataset):
                shapes[name] = (tuple(node.shape), node.chunks, str(node.dtype))

        f.visititems(visit)
        return attrs, shapes

    def _check_layout(
        self, name: str, shape: tuple[int, ...], chunks: tuple[int, ...] | None, dtype: str
    ) -> None:
        group = split_name(name)[0]
        if not shape or chunks is None or tuple(chunks[1:]) != tuple(shape[1:]):
            raise EntryReadError(
                f"array {name!r} in {self.file} is not chunked along samples only: "
                f"shape {shape}, chunks {chunks}"
            )
        n, c = int(shape[0]), int(chunks[0])
        if self._chunk.setdefault(group, c) != c or self._count.setdefault(group, n) != n:
            raise EntryReadError(
                f"arrays of group {group!r} in {self.file} disagree: {name!r} has {n} samples "
                f"in chunks of {c}, others {self._count[group]} in chunks of {self._chunk[group]}"
            )
        self._specs[name] = ArraySpec(tuple(shape[1:]), dtype)

    @property
    def arrays(self) -> dict[str, ArraySpec]:
        """Full array name -> per-sample spec."""
        return dict(self._specs)

    @property
    def groups(self) -> list[str]:
        return sorted(self._chunk)

    @property
    def attrs(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._attrs))  # a deep copy: callers may mutate it

    def _group(self, group: str) -> str:
        group = group.strip("/")
        if group not in self._chunk:
            raise EntryReadError(
                f"no group {group!r} in HDF5 entry {self.file}; groups are {self.groups}"
                + _did_you_mean(group, self.groups)
            )
        return group

    def num_samples(self, group: str = "") -> int:
        return self._count[self._group(group)]

    def chunk_samples(self, group: str = "") -> int:
        return self._chunk[self._group(group)]

    def num_chunks(self, group: str = "") -> int:
        group = self._group(group)
        return -(-self._count[group] // self._chunk[group])

    # ---------------------------------------------------------------------------------- reads

    def read_chunk(self, group: str, index: int) -> dict[str, np.ndarray]:
        """All arrays of ``group`` for the samples of chunk ``index`` (leaf name -> array)."""
        group = self._group(group)
        total = self.num_chunks(group)
        if not isinstance(index, int | np.integer) or not 0 <= index < total:
            raise EntryReadError(
                f"chunk index {index!r} out of range for group {group!r} ({total} chunks) in {self.file}"
            )
        c = self._chunk[group]
        lo, hi = int(index) * c, min((int(index) + 1) * c, self._count[group])
        return {
            split_name(name)[1]: self._read_in_chunk(name, int(index), lo, hi)
            for name in sorted(self._specs)
            if split_name(name)[0] == group
        }

    def read(self, group: str, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Samples ``[start, stop)`` of array ``name`` (leaf name within ``group``)."""
        group = self._group(group)
        full = f"{group}/{name}" if group else name
        if full not in self._specs:
            leaves = [split_name(n)[1] for n in self._specs if split_name(n)[0] == group]
            raise EntryReadError(
                f"no array {name!r} in group {group!r} of {self.file}; arrays: {leaves}"
                + _did_you_mean(name, leaves)
            )
        n, c = self._count[group], self._chunk[group]
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise EntryReadError(
                f"sample range [{start}, {stop}) is outside [0, {n}] for {full!r} in {self.file}"
            )
        spec = self._specs[full]
        out = np.empty((stop - start, *spec.sample_shape), dtype=spec.dtype)
        # Chunk by chunk so a decode failure names the exact chunk.
        for index in range(start // c, -(-stop // c)):
            lo, hi = max(start, index * c), min(stop, (index + 1) * c)
            out[lo - start : hi - start] = self._read_in_chunk(full, index, lo, hi)
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
            return dset[lo:hi]
        except CorruptChunkError:
            raise
        except _DECODE_ERRORS as exc:
            raise CorruptChunkError(
                str(self.file),
                name,
                index,
                f"fletcher32 checksum mismatch or undecodable data ({type(exc).__name__}: {exc})",
            ) from exc
