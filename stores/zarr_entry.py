"""Write and read sample-chunked zarr v3 arrays inside a catalog entry directory.

The on-disk result is plain zarr v3 (``zarr.open(path)`` reads it with no help from
this module). Choices and why:

- Chunks split axis 0 (samples) only, so a training epoch streams one chunk at a time
  and a later resume/verify can reason per chunk.
- The writer buffers one chunk per array and writes every chunk exactly once, whole:
  no read-modify-write of partial chunks (slow and torn-write-prone on SD cards) and
  peak memory independent of the number of samples.
- Codecs are ``bytes -> zstd|blosc -> crc32c``: the CRC is outermost, so any flipped
  bit in a chunk file is caught on read and reported as :class:`CorruptChunkError`.
- ``write_empty_chunks`` is forced on, so every chunk has a file and a missing file
  means loss, never "all fill value" (which stock zarr would return silently).
- Arrays named ``group/leaf`` share their group's sample count and chunk size, so a
  chunk index addresses the same samples in every array of the group.
- Every file (chunks and ``zarr.json``) is written through :class:`DurableLocalStore`
  (:func:`stores.durable.atomic_write_bytes`): a temp file in the same directory, ``fsync``,
  then ``rename`` over the final name.
  Stock zarr's ``LocalStore`` also renames a temp file into place but never fsyncs,
  so after a power cut a chunk could exist with garbage or zero-length content. With
  fsync-before-rename a chunk file that exists after a crash is complete, which is what
  makes chunk-level resume sound: "present and passing crc32c" means "durable". The
  directory entries are *not* fsynced per chunk (one extra journal commit per chunk on
  an SD card); a chunk whose name did not survive is simply missing and rewritten on
  resume, and the catalog fsyncs the whole tree once at commit.
- Resume (``ZarrWriter(..., resume=True)``) adopts a hierarchy left by an interrupted
  build only if its metadata documents equal the requested ones exactly, keeps the
  leading chunks that are present and decode in every array of a group, deletes the
  rest, and continues from there. Nothing time- or randomness-dependent is written, so
  a resumed entry is byte-identical to an uninterrupted one.

Reading is :mod:`stores.zarr_reader`; the zarr form itself (codecs, metadata documents,
chunk keys) is :mod:`stores.zarr_format`.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from stores.chunking import ChunkedWriter
from stores.durable import FULL_DISK_ERRNOS, TEMP_MARKER, free_bytes, fsync_dir
from stores.errors import EntryWriteError, StaleStagingWarning, StoreFullError
from stores.integrity import Rewrite
from stores.layout import ArraySpec, check_chunk_samples, did_you_mean, split_name
from stores.zarr_format import (
    LEVELS,
    META,
    ChunkProblem,
    Compressor,
    DurableLocalStore,
    OnMismatch,
    array_members,
    check_chunk,
    chunk_index,
    chunk_key,
    describe_difference,
    durable_put,
    metadata_docs,
    suggest_chunk_samples,
)
from stores.zarr_reader import RawChunk, ZarrReader

__all__ = [
    "ArraySpec",
    "ChunkProblem",
    "DurableLocalStore",
    "RawChunk",
    "ZarrReader",
    "ZarrChunkRewriter",
    "ZarrWriter",
    "suggest_chunk_samples",
]


class ZarrWriter(ChunkedWriter):
    """Append samples group by group; ``close()`` checks every array got exactly its sample count.

    With ``resume=True`` an existing hierarchy at ``path`` (left by an interrupted build)
    is adopted if its metadata equals the requested one: :meth:`resume_samples` then says,
    per group, how many leading samples are already durably stored, and writing continues
    after them (either skip them yourself and call :meth:`write`, or pass absolute sample
    offsets to :meth:`write_at`, which drops what is already there). If the metadata
    differs, ``on_mismatch="raise"`` raises :class:`EntryWriteError` naming the first
    difference, ``"wipe"`` deletes the old hierarchy (with a :class:`StaleStagingWarning`)
    and starts afresh; chunks of different layouts are never mixed.
    """

    KIND = "zarr"

    def __init__(
        self,
        path: str | os.PathLike[str],
        arrays: Mapping[str, ArraySpec],
        num_samples: int | Mapping[str, int],
        chunk_samples: int | Mapping[str, int],
        attrs: Mapping[str, Any] | None = None,
        compressor: Compressor = "zstd",
        level: int = 3,
        checksum: bool = True,
        *,
        resume: bool = False,
        on_mismatch: OnMismatch = "raise",
    ) -> None:
        self.path = Path(path)
        if compressor not in LEVELS:
            raise EntryWriteError(f"compressor must be one of {sorted(LEVELS)}, got {compressor!r}")
        if level not in LEVELS[compressor]:
            lv = LEVELS[compressor]
            raise EntryWriteError(f"{compressor} level must be in [{lv.start}, {lv.stop - 1}], got {level}")
        if on_mismatch not in ("raise", "wipe"):
            raise EntryWriteError(f"on_mismatch must be 'raise' or 'wipe', got {on_mismatch!r}")
        self._declare(self.path, arrays, num_samples, chunk_samples)
        try:
            attrs_json = json.loads(json.dumps(dict(attrs or {}), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise EntryWriteError(f"attrs for zarr entry {self.path} are not JSON-able: {exc}") from None
        self._docs = metadata_docs(
            attrs_json, self.specs, self.num_samples, self.group_chunk_samples, compressor, level, checksum
        )
        self.resumed = False
        self.restart_reason: str | None = None  # why an interrupted build was discarded (on_mismatch="wipe")
        self._resume_chunks = {g: 0 for g in self.groups}
        if (self.path / META).exists():
            if not resume:
                raise EntryWriteError(
                    f"{self.path} already holds a zarr hierarchy; write into a fresh directory "
                    "(or pass resume=True to continue an interrupted build)"
                )
            mismatch = self._compare_metadata()
            if mismatch is None:
                self.resumed = True
            elif on_mismatch == "wipe":
                self.restart_reason = f"its layout differs from the requested one ({mismatch})"
                warnings.warn(
                    f"discarding the interrupted zarr build in {self.path}: its layout differs from the "
                    f"requested one ({mismatch}); rebuilding from scratch",
                    StaleStagingWarning,
                    stacklevel=2,
                )
                self._wipe()
            else:
                raise EntryWriteError(
                    f"cannot resume the zarr build in {self.path}: the existing hierarchy differs from the "
                    f"requested one: {mismatch}. Remove that directory (or pass on_mismatch='wipe') "
                    "to rebuild"
                )
        elif resume:
            self._wipe()  # metadata of a build killed before its root zarr.json: nothing worth keeping
        else:
            existing = [n for n in self._top_level_names() if (self.path / n).exists()]
            if existing:
                raise EntryWriteError(
                    f"{self.path} is not a fresh directory: {existing} already exist where arrays of the "
                    "new zarr hierarchy go; write into a fresh directory"
                )
        self._write_metadata()
        root = zarr.open_group(store=DurableLocalStore(self.path), mode="r+", zarr_format=3)
        # write_empty_chunks is runtime config, not metadata: without it an all-zero chunk gets no file.
        members = array_members(root)
        self._arrays: dict[str, Any] = {
            name: members[name].with_config({"write_empty_chunks": True}) for name in sorted(self.specs)
        }
        if self.resumed:
            self._adopt_chunks()
        self._pool: ThreadPoolExecutor | None = None  # writes a batch's chunks side by side
        self._unwritten: list[tuple[str, int, np.ndarray]] = []  # (array, first sample, chunk) to write
        self._start_buffers()

    # ------------------------------------------------------------------ resume
    def _top_level_names(self) -> list[str]:
        return sorted({key.split("/")[0] for key in self._docs if "/" in key})

    def _compare_metadata(self) -> str | None:
        """None if every zarr.json on disk equals the requested one (missing ones are fine), else why not."""
        for key, wanted_doc in sorted(self._docs.items()):
            try:
                raw = (self.path / key).read_bytes()
            except FileNotFoundError:
                continue  # killed while writing metadata: rewritten below
            try:
                on_disk = json.loads(raw)
            except ValueError:
                return f"{key} on disk is not valid JSON"
            if on_disk != json.loads(wanted_doc):
                return describe_difference(key, on_disk, json.loads(wanted_doc))
        for dirpath, _dirnames, filenames in os.walk(self.path):
            if META in filenames:
                key = Path(dirpath, META).relative_to(self.path).as_posix()
                if key not in self._docs:
                    node = key[: -len(META)].rstrip("/")
                    wanted = sorted(self.specs)
                    return f"{node!r} exists on disk but is not among the requested arrays {wanted}"
        return None

    def _wipe(self) -> None:
        # The root zarr.json goes first: if this is interrupted, what remains is "no hierarchy".
        try:
            (self.path / META).unlink()
        except FileNotFoundError:
            pass
        if not self.path.is_dir():
            return
        for child in sorted(self.path.iterdir()):
            if child.name.startswith(TEMP_MARKER):
                child.unlink(missing_ok=True)
            elif child.is_dir() and (child.name in self._top_level_names() or (child / META).exists()):
                shutil.rmtree(child)

    def _write_metadata(self) -> None:
        """Write every metadata document that is missing or not byte-identical; the root one last."""
        for key in sorted(self._docs, key=lambda k: (k == META, k)):
            target = self.path / key
            try:
                if target.read_bytes() == self._docs[key]:
                    continue
            except FileNotFoundError:
                pass
            self._put(target, self._docs[key])

    def _put(self, target: Path, data: bytes) -> None:
        try:
            durable_put(target, data)
        except OSError as exc:
            if exc.errno in FULL_DISK_ERRNOS:
                raise StoreFullError(None, str(target), free_bytes(target)) from exc
            raise

    def _adopt_chunks(self) -> None:
        """Keep the leading chunks valid in every array of each group; delete everything after them."""
        for group in self.groups:
            names = [n for n in sorted(self.specs) if split_name(n)[0] == group]
            n, c = self.num_samples[group], self.group_chunk_samples[group]
            good = 0
            while good < -(-n // c) and all(
                check_chunk(self.path, name, self._arrays[name], good, n, c) is None for name in names
            ):
                good += 1
            self._resume_chunks[group] = good
            for name in names:
                self._prune(name, keep_below=good)
        for dirpath, _dirnames, filenames in os.walk(self.path):
            for fname in filenames:
                if fname.startswith(TEMP_MARKER):  # a write the crash interrupted before its rename
                    os.unlink(os.path.join(dirpath, fname))

    def _prune(self, name: str, keep_below: int) -> None:
        arr, base = self._arrays[name], self.path / name
        for dirpath, _dirnames, filenames in os.walk(base, topdown=False):
            for fname in filenames:
                rel = Path(dirpath, fname).relative_to(base).as_posix()
                if rel == META:
                    continue
                index = chunk_index(arr, rel)
                if index is None or index >= keep_below:
                    os.unlink(os.path.join(dirpath, fname))
            if dirpath != str(base) and not os.listdir(dirpath):
                os.rmdir(dirpath)

    def resume_samples(self, group: str = "") -> int:
        """Leading samples of ``group`` already durably stored (0 for a fresh build); write from here."""
        group = self._known_group(group)
        return min(self._resume_chunks[group] * self.group_chunk_samples[group], self.num_samples[group])

    def _emit(self, name: str, chunk: np.ndarray) -> None:
        # Queued, written when the batch is in (_write_queued): its chunks of all arrays go out together.
        data = np.asarray(chunk, dtype=self.specs[name].dtype)
        start = self._written[name]
        self._unwritten.append((name, start, data))
        self._written[name] = start + len(data)

    def _after_batch(self, group: str) -> None:
        self._write_queued()

    def _write_queued(self) -> None:
        """Write the chunks the batch completed (queued by :meth:`_emit`), every array's at once.

        Each is a public ``arr[lo:hi] = data`` (encode, then a durable file write with its
        fsync); the chunks of one batch are written side by side on a small thread pool, so
        their fsyncs overlap instead of queueing one behind the other.
        """
        chunks, self._unwritten = self._unwritten, []
        if len(chunks) <= 1:
            errors = [self._write_chunk(*chunk) for chunk in chunks]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(len(self.specs), thread_name_prefix="zarr-chunk-write")
            errors = list(self._pool.map(lambda chunk: self._write_chunk(*chunk), chunks))
        for error in errors:
            if error is not None:
                raise error

    def _write_chunk(self, name: str, start: int, data: np.ndarray) -> BaseException | None:
        """Write one chunk; the error to raise (a full disk as :class:`StoreFullError`), or None."""
        try:
            self._arrays[name][start : start + len(data)] = data
        except OSError as exc:
            if exc.errno in FULL_DISK_ERRNOS:
                full = StoreFullError(
                    None,
                    str(self.path / name),
                    free_bytes(self.path),
                    f"chunk {start // self.chunk_samples_of(name)} of array {name!r}",
                )
                full.__cause__ = exc
                return full
            return exc
        except Exception as exc:  # noqa: BLE001 - handed back to the writing thread, raised there
            return exc
        return None

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @classmethod
    def rewrite_chunks(
        cls, path: str | os.PathLike[str], array: str, chunks: Mapping[int, np.ndarray]
    ) -> list[int]:
        """Replace whole chunks of a finished array in place, each atomically (used by ``cache repair``).

        ``chunks`` maps chunk index -> that chunk's samples (``chunk_samples`` of them, fewer
        for the last chunk). Each new chunk file is written to a temp file, fsynced and
        renamed over the old one, so a reader sees the old or the new chunk, never a mix,
        and a crash mid-repair leaves every chunk whole. Returns the rewritten indices.
        Remember the entry's manifest records file sizes: call ``Catalog.reseal`` after a
        repair whose data is not bit-identical to the original. :class:`ZarrChunkRewriter`
        is the same for several arrays at once, through the entry contract.
        """
        return ZarrChunkRewriter(path).rewrite_chunks({array: chunks}).rewritten[array]

    def close(self) -> None:
        """Finish writing: raise if any array's sample count is off (its chunks, the short last ones
        too, were written as their samples arrived)."""
        if self._closed:
            return
        try:
            self._write_queued()  # nothing is queued after a completed write(); never drop a chunk if so
        finally:
            self._stop_pool()
        self._closed = True
        self._check_complete()
        self._buffers.clear()

    def _abandon(self) -> None:
        self._closed = True  # the catalog's staging cleanup removes the files
        self._stop_pool()
        self._buffers.clear()


class ZarrChunkRewriter:
    """The zarr :class:`~stores.entry.ChunkRewriter`: each chunk file replaced on its own, atomically.

    A chunk is one file here, so replacing it is one durable write (temp file, fsync,
    rename over the old one, then the directory fsynced): a reader sees the old or the new
    chunk, never a mix, and a crash leaves every chunk whole. ``identical`` is always None:
    a zarr chunk's checksum is inside the chunk file, so a damaged chunk keeps no record of
    the bytes it held.
    """

    KIND = "zarr"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def rewrite_chunks(self, chunks: Mapping[str, Mapping[int, np.ndarray]]) -> Rewrite:
        path = self.path
        try:
            root = zarr.open_group(store=DurableLocalStore(path), mode="r+", zarr_format=3)
        except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
            raise EntryWriteError(f"{path} is not a writable zarr v3 group: {exc}") from None
        members = array_members(root)
        names = sorted(members)
        prepared: list[tuple[str, Any, int, np.ndarray]] = []
        for array, by_index in sorted(chunks.items()):
            if array not in names:
                raise EntryWriteError(
                    f"no array {array!r} in zarr entry {path}; arrays: {names}" + did_you_mean(array, names)
                )
            arr = members[array].with_config({"write_empty_chunks": True})
            n, c = int(arr.shape[0]), int(arr.chunks[0])
            for index, data in sorted(by_index.items()):
                lo, hi = check_chunk_samples(path, array, index, data, n, c, arr.shape[1:], arr.dtype)
                prepared.append((array, arr, lo, np.asarray(data)))
        rewritten: dict[str, list[int]] = {}
        files: list[Path] = []
        for array, arr, lo, values in prepared:  # validated all first: no half-applied repair on a typo
            index = lo // int(arr.chunks[0])
            try:
                arr[lo : lo + len(values)] = values
            except OSError as exc:
                if exc.errno in FULL_DISK_ERRNOS:
                    raise StoreFullError(
                        None, str(path / array), free_bytes(path), f"rewriting chunk {index}"
                    ) from exc
                raise
            file = path / array / chunk_key(arr, index)
            fsync_dir(file.parent)
            rewritten.setdefault(array, []).append(index)
            files.append(file)
        return Rewrite(rewritten, tuple(files), None)
