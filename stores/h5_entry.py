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
- The crc32 of every chunk's stored bytes, and the order rows were written in, recorded in
  the group ``/.ondevice_tl_chunks`` by ``close()`` (:mod:`stores.h5_chunks` says why), so
  ``cache verify`` names the damaged chunk and ``cache repair`` rewrites just it
  (:mod:`stores.h5_repair`).
- A chunk that was never written is reported as missing (HDF5 would silently return zeros).

Writing buffers at most one chunk per array (plus the whole chunks of the current batch,
held until their row is complete) and writes every chunk exactly once and whole, in one
canonical order: row by row (chunk ``i`` of every array of a group, arrays in name order),
groups one after another, a group's short last row as soon as its last sample arrives. HDF5
lays a file out in the order chunks are written, so the bytes of an entry depend only on
its data and settings, never on the caller's batch sizes or on an interruption (HDF5's
chunk cache is disabled, so written chunks go straight to the OS).

Resume (``H5Writer(..., resume=True)``), and why it works this way
------------------------------------------------------------------
An HDF5 file has no journal: after ``kill -9`` or a power cut its metadata (chunk B-trees,
object headers, superblock) may be stale, half-written or unopenable, and HDF5 cannot
tell which chunks are whole. Reopening such a file for writing and appending would risk
building on damage, and even when it opens, space the killed writer allocated would leave
different bytes than an uninterrupted build. So a leftover file is only ever **read**:

- After each row the writer flushes the file (so the row is in the on-disk chunk index)
  and appends a line to a sidecar **progress log** ``entry.h5.progress``: the row's group,
  index and the crc32 of every chunk's stored (compressed) bytes. Each line carries its
  own crc32, so a line torn by a kill is ignored. The file and the log are fsynced every
  ``SYNC_EVERY_S`` seconds (log after file), not per row: an SD card pays for every fsync,
  and durability of a logged row is re-checked on resume anyway. The log's first line
  holds a digest of the layout (arrays, counts, chunking, codec, attrs, h5py/HDF5 versions).
- Resuming opens the leftover read-only (if HDF5 cannot open it, or the log is missing or
  from another layout, everything is discarded with a :class:`StaleStagingWarning` and
  ``restart_reason``) and copies the logged rows, in log order, into a fresh
  ``entry.h5.partial`` with ``write_direct_chunk``: stored bytes, not decoded or
  recompressed, and each chunk must match its logged crc32. The copy stops at the first
  missing or mismatched chunk. The copy is then renamed over ``entry.h5`` (the open handle
  follows it; POSIX rename) and writing continues; a resume killed while copying leaves
  the original intact and is simply redone. Because the copy replays exactly the rows an
  uninterrupted build writes first, in the same order, the finished file is byte-identical
  to an uninterrupted build (tests/stores/test_h5_resume.py checks this after SIGKILLs).
- Cost: a resume rewrites the kept prefix once (sequential I/O, no upstream work) and
  needs its size again in free space while copying. ``close()`` marks the file complete
  and deletes the log, so a committed entry is the single plain ``entry.h5``.

A killed build never reads as complete: the ``ondevice_tl_complete`` attribute is set only
by ``close()``, and the catalog publishes only committed entries.

``path`` may be an HDF5 file path or a directory (e.g. a catalog staging directory); in a
directory the file is ``path / "entry.h5"``.

Reading is :mod:`stores.h5_reader`, the progress log :mod:`stores.h5_progress`. None of
these modules imports zarr.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from stores.chunking import ChunkedWriter
from stores.durable import FULL_DISK_ERRNOS, free_bytes, fsync_dir
from stores.errors import EntryWriteError, StaleStagingWarning, StoreFullError, StoreNotFoundError
from stores.h5_chunks import crc32, write_record
from stores.h5_format import (
    ATTR_COMPLETE,
    ATTR_FORMAT,
    ATTR_JSON,
    COMPRESSORS,
    ENTRY_FILENAME,
    FORMAT,
    Compressor,
    entry_file,
)
from stores.h5_progress import (
    PROGRESS_FORMAT,
    Row,
    append_line,
    layout_id,
    partial_file,
    progress_file,
    read_progress,
)
from stores.h5_reader import H5Reader
from stores.layout import ArraySpec, split_name

__all__ = ["ENTRY_FILENAME", "H5Reader", "H5Writer", "entry_file", "progress_file", "read_progress"]

# fsync the file and its progress log at most this often while building (see "Resume").
SYNC_EVERY_S = 2.0


class H5Writer(ChunkedWriter):
    """Append samples group by group; ``close()`` checks every array got exactly its sample count.

    ``compressor`` is "gzip" (``level`` 0-9), "lzf" (fast, no level) or "none"; ``level`` is
    validated for gzip and ignored otherwise.

    Chunks are written in one canonical order whatever the caller's batch sizes: row by row
    (chunk ``i`` of every array of a group, arrays in name order), each group's rows in
    sample order, a group's short last row as soon as its last sample arrives. HDF5 lays
    out a file in the order chunks are written, so this is what makes two builds of the
    same data (interrupted or not) byte-identical. After each row the file is flushed and
    the row is appended to the progress log (see the module docstring, "Resume").

    With ``resume=True`` a file and progress log left by an interrupted build are salvaged:
    :meth:`resume_samples` then says, per group, how many leading samples are kept, and the
    caller continues with :meth:`write` from there. ``restart_reason`` says why nothing
    could be kept, if so.
    """

    KIND = "HDF5"

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
        *,
        resume: bool = False,
    ) -> None:
        self.path = Path(path)
        self.file = entry_file(self.path)
        if compressor not in COMPRESSORS:
            raise EntryWriteError(f"compressor must be one of {list(COMPRESSORS)}, got {compressor!r}")
        if compressor == "gzip" and (not isinstance(level, int) or not 0 <= level <= 9):
            raise EntryWriteError(f"gzip level must be in [0, 9], got {level!r}")
        self._declare(self.file, arrays, num_samples, chunk_samples)
        if len(set(self.group_chunk_samples.values())) > 1:  # datasets and row log use self.chunk_samples
            raise EntryWriteError(
                f"HDF5 entry {self.file} has one chunk length for every group; got {self.group_chunk_samples}"
            )
        try:
            attrs_json = json.dumps(dict(attrs or {}), allow_nan=False, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise EntryWriteError(f"attrs for HDF5 entry {self.file} are not JSON-able: {exc}") from None
        if not self.file.parent.is_dir():
            raise StoreNotFoundError(
                f"directory {self.file.parent} for HDF5 entry {self.file} does not exist"
            )
        self._members = {g: sorted(n for n in self.specs if split_name(n)[0] == g) for g in self.groups}
        self._settings = (compressor, level, checksum, attrs_json)
        self.layout_id = layout_id(self.specs, self.num_samples, chunk_samples, *self._settings)
        self.progress_file = progress_file(self.file)
        self.restart_reason: str | None = None
        self._log_fd: int | None = None
        self._last_sync = time.monotonic()
        self._rows = dict.fromkeys(self.groups, 0)  # rows (chunk indices) durable-logged per group
        # Every row written, in order, with its chunks' crc32s: recorded in the file by close().
        self._row_log: list[tuple[str, int, dict[str, int]]] = []
        salvage: tuple[h5py.File, list[Row]] | None = None
        if resume:
            salvage = self._salvage()
        elif self.file.exists():
            raise EntryWriteError(
                f"{self.file} already exists; write an HDF5 entry into a fresh file "
                "(or pass resume=True to continue an interrupted build)"
            )
        target = partial_file(self.file) if salvage is not None else self.file
        self._h5 = self._create(target)
        try:
            self._open_log(progress_file(target))
            if salvage is not None:
                self._replay(*salvage)
                os.fsync(self._h5.id.get_vfd_handle())
                os.fsync(self._log_fd)  # type: ignore[arg-type]
                # The open handles follow the renamed inodes (POSIX), so writing continues.
                os.replace(target, self.file)
                os.replace(progress_file(target), self.progress_file)
                fsync_dir(self.file.parent)
        except BaseException:
            self._h5.close()
            self._close_log()
            raise
        # Whole chunks waiting for their row to be complete (see _emit, _drain).
        self._pending: dict[str, list[np.ndarray]] = {name: [] for name in self.specs}
        self._start_buffers()

    # ------------------------------------------------------------------------------ creation

    def _create(self, file: Path) -> h5py.File:
        compressor, level, checksum, attrs_json = self._settings
        try:
            # rdcc_nbytes=0: no chunk cache, so memory is bounded by our one-chunk buffers.
            h5 = h5py.File(file, "w-", rdcc_nbytes=0)
        except (OSError, ValueError) as exc:
            raise EntryWriteError(f"cannot create HDF5 entry {file}: {exc}") from exc
        try:
            h5.attrs[ATTR_FORMAT] = FORMAT
            h5.attrs[ATTR_JSON] = attrs_json
            h5.attrs[ATTR_COMPLETE] = False
            self._dsets: dict[str, h5py.Dataset] = {}
            for name, spec in sorted(self.specs.items()):
                self._dsets[name] = self._dataset(h5, name, spec, compressor, level, checksum)
        except BaseException:
            h5.close()
            file.unlink(missing_ok=True)
            raise
        return h5

    def _dataset(
        self, h5: h5py.File, name: str, spec: ArraySpec, compressor: str, level: int, checksum: bool
    ) -> h5py.Dataset:
        n = self.num_samples[split_name(name)[0]]
        itemsize = np.dtype(spec.dtype).itemsize
        compressing = compressor != "none"
        return h5.create_dataset(
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

    # -------------------------------------------------------------------------------- resume

    def _restart(self, reason: str) -> None:
        """Give up on a leftover build: say why (warning + ``restart_reason``) and remove its files."""
        self.restart_reason = reason
        warnings.warn(
            f"discarding the interrupted HDF5 build {self.file}: {reason}; rebuilding from scratch",
            StaleStagingWarning,
            stacklevel=4,
        )
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        for leftover in (
            self.file,
            self.progress_file,
            partial_file(self.file),
            progress_file(partial_file(self.file)),
        ):
            leftover.unlink(missing_ok=True)

    def _salvage(self) -> tuple[h5py.File, list[Row]] | None:
        """The leftover file (open read-only) and its logged rows, or None (leftovers removed)."""
        for partial in (partial_file(self.file), progress_file(partial_file(self.file))):
            partial.unlink(missing_ok=True)  # a resume killed while copying: its source is still intact
        if not self.file.exists():
            self._remove_leftovers()
            return None
        layout, rows = read_progress(self.progress_file)
        if layout is None:
            self._restart(f"its progress log {self.progress_file.name} is missing or unreadable")
            return None
        if layout != self.layout_id:
            self._restart("it was written with other arrays, counts, chunking, codec, attributes or h5py")
            return None
        if not rows:
            self._remove_leftovers()  # nothing durable yet: not worth a message
            return None
        try:
            old = h5py.File(self.file, "r", rdcc_nbytes=0)
        except Exception as exc:  # noqa: BLE001 - whatever HDF5 says, the file is not usable
            self._restart(f"the file cannot be opened ({type(exc).__name__}: {exc})")
            return None
        return old, rows

    def _replay(self, old: h5py.File, rows: list[Row]) -> None:
        """Copy the logged rows whose stored bytes still match their crc32, in log order, into the new file.

        The copy is of stored (compressed) chunk bytes, so no sample is decoded or
        recompressed; it stops at the first row that is missing, mismatched or out of order.
        """
        try:
            for row in rows:
                if row.group not in self._members or row.index != self._rows[row.group]:
                    break
                if sorted(row.crcs) != self._members[row.group]:
                    break
                chunks: dict[str, tuple[int, bytes]] = {}
                for name in self._members[row.group]:
                    try:
                        offset = (row.index * self.chunk_samples,) + (0,) * len(self.specs[name].sample_shape)
                        mask, raw = old[name].id.read_direct_chunk(offset)
                    except Exception:  # noqa: BLE001 - missing or unreadable: the prefix ends here
                        break
                    if crc32(raw) != row.crcs[name]:
                        break
                    chunks[name] = (int(mask), bytes(raw))
                if len(chunks) != len(self._members[row.group]):
                    break
                self._write_row(row.group, direct=chunks)
        finally:
            old.close()

    def resume_samples(self, group: str = "") -> int:
        """Leading samples of ``group`` already stored (0 for a fresh build); continue writing from there."""
        group = self._known_group(group)
        return min(self._rows[group] * self.chunk_samples, self.num_samples[group])

    # ------------------------------------------------------------------------- progress log

    def _open_log(self, path: Path) -> None:
        self._log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
        append_line(self._log_fd, {"format": PROGRESS_FORMAT, "layout": self.layout_id})
        os.fsync(self._log_fd)

    def _close_log(self) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None

    def _write_row(
        self,
        group: str,
        *,
        data: Mapping[str, np.ndarray] | None = None,
        direct: Mapping[str, tuple[int, bytes]] | None = None,
    ) -> None:
        """Write chunk ``self._rows[group]`` of each array of ``group``, flush, and log it with crc32s.

        Each array's chunk is either stored bytes to copy as they are (``direct``: filter mask
        and bytes) or samples to encode (``data``); a row may mix both (a repair's copy).
        """
        index = self._rows[group]
        crcs: dict[str, int] = {}
        for name in self._members[group]:
            dset = self._dsets[name]
            offset = (index * self.chunk_samples,) + (0,) * (dset.ndim - 1)
            if direct is not None and name in direct:
                mask, raw = direct[name]
                dset.id.write_direct_chunk(offset, raw, mask)
            else:
                assert data is not None
                chunk = data[name]
                self._checked_write(dset, name, index, chunk)
                raw = dset.id.read_direct_chunk(offset)[1]  # what is stored, from the page cache
            crcs[name] = crc32(raw)
        # Flush before logging: a logged row is in the file's chunk index on disk.
        self._h5.flush()
        assert self._log_fd is not None
        append_line(self._log_fd, {"g": group, "i": index, "crc": crcs})
        self._row_log.append((group, index, crcs))
        self._rows[group] = index + 1
        if time.monotonic() - self._last_sync >= SYNC_EVERY_S:
            # Durable against power loss every few seconds; the log is fsynced after the file,
            # so a durable log line describes durable chunks (and resume re-checks them anyway).
            os.fsync(self._h5.id.get_vfd_handle())
            os.fsync(self._log_fd)
            self._last_sync = time.monotonic()

    def copy_row(
        self,
        group: str,
        stored: Mapping[str, tuple[int, bytes]],
        samples: Mapping[str, np.ndarray],
    ) -> dict[str, int]:
        """Write the next row of ``group`` from stored chunk bytes and/or samples; its crc32s.

        For :mod:`stores.h5_repair`, which rebuilds a file row by row in its recorded order:
        ``stored`` maps arrays to (filter mask, stored bytes) copied from the old file,
        ``samples`` the others to their recomputed samples (the row's whole chunk, fewer
        for the group's last). Not to be mixed with :meth:`write` on one writer.
        """
        group = self._known_group(group)
        index = self._rows[group]
        count = min(self.chunk_samples, self.num_samples[group] - index * self.chunk_samples)
        names = self._members[group]
        if count <= 0 or sorted({*stored, *samples}) != names or set(stored) & set(samples):
            raise EntryWriteError(
                f"row {index} of group {group!r} in {self.file}: expected each of {names} once "
                f"(stored or samples) and at most {-(-self.num_samples[group] // self.chunk_samples)} rows"
            )
        values = {name: np.asarray(v, dtype=self.specs[name].dtype) for name, v in samples.items()}
        self._write_row(group, data=values, direct=stored)
        for name in names:
            self._written[name] += count
        return self._row_log[-1][2]

    def _checked_write(self, dset: h5py.Dataset, name: str, index: int, chunk: np.ndarray) -> None:
        lo = index * self.chunk_samples
        try:
            dset[lo : lo + len(chunk)] = chunk
        except OSError as exc:
            if exc.errno in FULL_DISK_ERRNOS:
                raise StoreFullError(
                    None, str(self.file), free_bytes(self.file), f"chunk {index} of array {name!r}"
                ) from exc
            raise

    # -------------------------------------------------------------------------------- writing

    def _after_batch(self, group: str) -> None:
        self._drain(group)

    def _emit(self, name: str, chunk: np.ndarray) -> None:
        """Hold a whole chunk until its row is complete (a copy: the caller may reuse its array)."""
        self._pending[name].append(np.array(chunk, dtype=self.specs[name].dtype, order="C"))
        self._written[name] += len(chunk)

    def _drain(self, group: str) -> None:
        members = self._members[group]
        while all(self._pending[name] for name in members):
            self._write_row(group, data={name: self._pending[name].pop(0) for name in members})

    def close(self) -> None:
        """Mark the file complete (every chunk, the short last ones too, is written by now); raise if any
        count is off.

        On success the progress log is removed (it is not part of the entry).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._check_complete()
            for group in self.groups:
                self._drain(group)
            chunks = {
                name: -(-self.num_samples[split_name(name)[0]] // self.chunk_samples) for name in self.specs
            }
            write_record(self._h5, self._row_log, chunks, self.groups)
            self._h5.attrs[ATTR_COMPLETE] = True
        finally:
            self._buffers.clear()
            self._pending.clear()
            self._h5.close()
            self._close_log()
        self.progress_file.unlink(missing_ok=True)

    def abort(self) -> None:
        """Stop without marking the file complete (readers refuse it); the progress log stays for a resume."""
        if not self._closed:
            self._closed = True
            self._buffers.clear()
            self._pending.clear()
            self._h5.close()
            self._close_log()

    def _abandon(self) -> None:
        self.abort()  # the catalog's staging cleanup removes the file, or a resume continues
