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
- Every file (chunks and ``zarr.json``) is written through :class:`DurableLocalStore`:
  a temp file in the same directory, ``fsync``, then ``rename`` over the final name.
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
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import LocalStore as ZarrLocalStore
from zarr.storage import MemoryStore

from stores.chunking import ChunkedWriter
from stores.errors import (
    CorruptChunkError,
    EntryReadError,
    EntryWriteError,
    StaleStagingWarning,
    StoreFullError,
    StoreNotFoundError,
)
from stores.layout import ArraySpec, ChunkedReader, did_you_mean, split_name
from stores.local import FULL_DISK_ERRNOS, TEMP_MARKER, free_bytes, fsync_dir

Compressor = Literal["zstd", "blosc", "none"]
_LEVELS = {"zstd": range(-7, 23), "blosc": range(0, 10), "none": range(-7, 23)}
_META = "zarr.json"
# Errors zarr/numcodecs raise for an undecodable chunk: crc32c mismatch is ValueError,
# a damaged zstd/blosc frame RuntimeError, a truncated buffer TypeError/ValueError.
_DECODE_ERRORS = (ValueError, RuntimeError, TypeError, OSError)
OnMismatch = Literal["raise", "wipe"]


def suggest_chunk_samples(specs: Iterable[ArraySpec], target_bytes: int = 1 << 20) -> int:
    """Samples per chunk so the widest array's chunks are about ``target_bytes`` (at least 1)."""
    widest = max((spec.sample_bytes for spec in specs), default=1)
    return max(1, target_bytes // widest)


def _codecs(compressor: str, level: int, checksum: bool, itemsize: int) -> list[Any]:
    chain: list[Any] = []
    if compressor == "zstd":
        chain.append(ZstdCodec(level=level, checksum=False))  # crc32c below covers integrity
    elif compressor == "blosc":
        chain.append(BloscCodec(cname="zstd", clevel=level, shuffle="shuffle", typesize=itemsize))
    if checksum:
        chain.append(Crc32cCodec())
    return chain


def _write_all(fd: int, data: memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (a module-level hook, so tests can simulate a full disk)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def durable_put(path: Path, data: bytes | memoryview, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename; the directory itself is not fsynced.

    After a crash ``path`` is absent, the old bytes, or the complete new bytes. The temp
    name starts with ``TEMP_MARKER`` (never a valid key), so leftovers are recognisable.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.parent / f"{TEMP_MARKER}{secrets.token_hex(6)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            continue
        break
    try:
        try:
            _write_all(fd, memoryview(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, path)  # raises FileExistsError instead of replacing
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class DurableLocalStore(ZarrLocalStore):
    """zarr's LocalStore whose writes are fsynced before they are renamed into place.

    Only writing differs (see :func:`durable_put`); reading, listing and deleting are
    stock. A store wrapper rather than post-write fsyncs because only the writer knows
    the temp file before it becomes visible under its final name.
    """

    def set_sync(self, key: str, value: Buffer) -> None:
        self._ensure_open_sync()
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"DurableLocalStore.set(): value must be a zarr Buffer, got {type(value)}")
        durable_put(self.root / key, value.as_buffer_like())

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        if not self._is_open:
            await self._open()
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"DurableLocalStore.set(): value must be a zarr Buffer, got {type(value)}")
        await asyncio.to_thread(durable_put, self.root / key, value.as_buffer_like(), exclusive)


@dataclass(frozen=True)
class ChunkProblem:
    """One bad chunk found by :meth:`ZarrReader.verify`: array (full name), chunk index, why."""

    array: str
    chunk: int
    reason: str

    def describe(self) -> str:
        return f"chunk {self.chunk} of array {self.array!r}: {self.reason}"


@dataclass(frozen=True)
class RawChunk:
    """The stored, still encoded bytes of one chunk of each array of a group (:meth:`ZarrReader.fetch_chunk`).

    ``data`` maps full array name -> the chunk file's bytes (a zarr ``Buffer``). Splitting a
    chunk read into this I/O half and a CPU half (:meth:`ZarrReader.decode_chunk`) lets a
    prefetcher keep slow storage busy on one thread while another decompresses.
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


def _chunk_key(arr: Any, index: int) -> str:
    """Store key (relative to the array) of chunk ``index`` along the sample axis, e.g. 'c/3/0/0'."""
    return str(arr.metadata.encode_chunk_key((index,) + (0,) * (arr.ndim - 1)))


def _chunk_index(arr: Any, rel: str) -> int | None:
    """Inverse of :func:`_chunk_key` for this array's chunk grid; None if ``rel`` is not one of its chunks."""
    parts = rel.split("/")
    if len(parts) != arr.ndim + 1 or parts[0] != "c" or any(p != "0" for p in parts[2:]):
        return None
    if not parts[1].isdigit() or (len(parts[1]) > 1 and parts[1].startswith("0")):
        return None
    index = int(parts[1])
    n, c = int(arr.shape[0]), int(arr.chunks[0])
    return index if index < -(-n // c) else None


def _metadata_docs(
    attrs: dict[str, Any],
    specs: Mapping[str, ArraySpec],
    num_samples: Mapping[str, int],
    chunk_samples: Mapping[str, int],
    compressor: str,
    level: int,
    checksum: bool,
) -> dict[str, bytes]:
    """The exact zarr.json documents (key -> bytes) of the requested hierarchy, built in memory.

    Generating them with zarr itself (rather than hand-written JSON) keeps them identical
    to what zarr would write, and gives resume a complete description to compare against.
    """
    store = MemoryStore()
    root = zarr.open_group(store=store, mode="w-", zarr_format=3, attributes=attrs)
    for name, spec in sorted(specs.items()):
        root.create_array(
            name,
            shape=(num_samples[split_name(name)[0]], *spec.sample_shape),
            dtype=spec.dtype,
            chunks=(chunk_samples[split_name(name)[0]], *spec.sample_shape),
            serializer=BytesCodec(),
            compressors=_codecs(compressor, level, checksum, np.dtype(spec.dtype).itemsize),
            fill_value=0,
            config={"write_empty_chunks": True},
        )
    docs = {key: bytes(value.to_bytes()) for key, value in store._store_dict.items()}
    if any(not key.endswith(_META) for key in docs):
        raise AssertionError(f"unexpected non-metadata keys from zarr: {sorted(docs)}")
    return docs


def _describe_difference(key: str, on_disk: Any, wanted: Any) -> str:
    node = key[: -len(_META)].rstrip("/") or "(root group)"
    if isinstance(on_disk, dict) and isinstance(wanted, dict):
        for field in sorted(set(on_disk) | set(wanted)):
            if on_disk.get(field) != wanted.get(field):
                disk_value, wanted_value = on_disk.get(field), wanted.get(field)
                return f"{node!r}: {field} is {disk_value!r} on disk but {wanted_value!r} was requested"
    return f"{node!r}: metadata on disk is {on_disk!r}, requested {wanted!r}"


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
        if compressor not in _LEVELS:
            raise EntryWriteError(f"compressor must be one of {sorted(_LEVELS)}, got {compressor!r}")
        if level not in _LEVELS[compressor]:
            lv = _LEVELS[compressor]
            raise EntryWriteError(f"{compressor} level must be in [{lv.start}, {lv.stop - 1}], got {level}")
        if on_mismatch not in ("raise", "wipe"):
            raise EntryWriteError(f"on_mismatch must be 'raise' or 'wipe', got {on_mismatch!r}")
        self._declare(self.path, arrays, num_samples, chunk_samples)
        try:
            attrs_json = json.loads(json.dumps(dict(attrs or {}), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise EntryWriteError(f"attrs for zarr entry {self.path} are not JSON-able: {exc}") from None
        self._docs = _metadata_docs(
            attrs_json, self.specs, self.num_samples, self.group_chunk_samples, compressor, level, checksum
        )
        self.resumed = False
        self._resume_chunks = {g: 0 for g in self.groups}
        if (self.path / _META).exists():
            if not resume:
                raise EntryWriteError(
                    f"{self.path} already holds a zarr hierarchy; write into a fresh directory "
                    "(or pass resume=True to continue an interrupted build)"
                )
            mismatch = self._compare_metadata()
            if mismatch is None:
                self.resumed = True
            elif on_mismatch == "wipe":
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
        self._arrays: dict[str, Any] = {
            name: root[name].with_config({"write_empty_chunks": True}) for name in sorted(self.specs)
        }
        if self.resumed:
            self._adopt_chunks()
        self._unwritten: list[tuple[str, int, np.ndarray]] = []  # (array, first sample, chunk) to write
        self._start_buffers()

    # ------------------------------------------------------------------ resume
    def _top_level_names(self) -> list[str]:
        return sorted({key.split("/")[0] for key in self._docs if "/" in key})

    def _compare_metadata(self) -> str | None:
        """None if every zarr.json on disk equals the requested one (missing ones are fine), else why not."""
        for key, wanted in sorted(self._docs.items()):
            try:
                raw = (self.path / key).read_bytes()
            except FileNotFoundError:
                continue  # killed while writing metadata: rewritten below
            try:
                on_disk = json.loads(raw)
            except ValueError:
                return f"{key} on disk is not valid JSON"
            if on_disk != json.loads(wanted):
                return _describe_difference(key, on_disk, json.loads(wanted))
        for dirpath, _dirnames, filenames in os.walk(self.path):
            if _META in filenames:
                key = Path(dirpath, _META).relative_to(self.path).as_posix()
                if key not in self._docs:
                    node = key[: -len(_META)].rstrip("/")
                    wanted = sorted(self.specs)
                    return f"{node!r} exists on disk but is not among the requested arrays {wanted}"
        return None

    def _wipe(self) -> None:
        # The root zarr.json goes first: if this is interrupted, what remains is "no hierarchy".
        try:
            (self.path / _META).unlink()
        except FileNotFoundError:
            pass
        if not self.path.is_dir():
            return
        for child in sorted(self.path.iterdir()):
            if child.name.startswith(TEMP_MARKER):
                child.unlink(missing_ok=True)
            elif child.is_dir() and (child.name in self._top_level_names() or (child / _META).exists()):
                shutil.rmtree(child)

    def _write_metadata(self) -> None:
        """Write every metadata document that is missing or not byte-identical; the root one last."""
        for key in sorted(self._docs, key=lambda k: (k == _META, k)):
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
                _check_chunk(self.path, name, self._arrays[name], good, n, c) is None for name in names
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
                if rel == _META:
                    continue
                index = _chunk_index(arr, rel)
                if index is None or index >= keep_below:
                    os.unlink(os.path.join(dirpath, fname))
            if dirpath != str(base) and not os.listdir(dirpath):
                os.rmdir(dirpath)

    def resume_samples(self, group: str = "") -> int:
        """Leading samples of ``group`` already durably stored (0 for a fresh build); write from here."""
        group = self._known_group(group)
        return min(self._resume_chunks[group] * self.group_chunk_samples[group], self.num_samples[group])

    def write_at(self, group: str, start: int, batch: Mapping[str, np.ndarray]) -> None:
        """Like :meth:`write`, for a batch whose first sample has absolute index ``start``.

        Samples an array already has (e.g. kept by resume) are dropped; a gap raises
        :class:`EntryWriteError`. Lets a caller replay its input from any earlier point.
        """
        group = group.strip("/")
        if group not in self.num_samples:
            self.write(group, batch)  # raises the usual unknown-group error
        offsets: dict[str, int] = {}
        for leaf, data in batch.items():
            name = f"{group}/{leaf}" if group else leaf
            have = self.received(name) if name in self.specs else start
            if start > have:
                raise EntryWriteError(
                    f"array {name!r} in {self.path}: batch starts at sample {start} but only {have} samples "
                    "were written; samples must be contiguous"
                )
            offsets[leaf] = min(have - start, len(data))
        if len(set(offsets.values())) <= 1:
            skip = next(iter(offsets.values()), 0)
            rest = {leaf: data[skip:] for leaf, data in batch.items()}
            if rest and len(next(iter(rest.values()))):
                self.write(group, rest)
            elif rest:  # still validate names, shapes and dtypes of an all-dropped batch
                for leaf, data in batch.items():
                    self._check_batch(f"{group}/{leaf}" if group else leaf, group, np.asarray(data)[:0])
            return
        for leaf, data in batch.items():
            if len(data) > offsets[leaf]:
                self.write(group, {leaf: data[offsets[leaf] :]})

    def _emit(self, name: str, chunk: np.ndarray) -> None:
        # Queued, written when the batch is in (_write_queued): its chunks of all arrays go out together.
        data = np.asarray(chunk, dtype=self.specs[name].dtype)
        start = self._written[name]
        self._unwritten.append((name, start, data))
        self._written[name] = start + len(data)

    def _after_batch(self, group: str) -> None:
        self._write_queued()

    def _write_queued(self) -> None:
        """Write the chunks the batch completed, every array's at once.

        One trip to zarr's event loop for all of them instead of one per array (each trip:
        encode, then a worker thread for the file write and fsync, then the wake-up): a
        group's five small arrays took ~10 ms one by one and ~7.5 together, and the writes
        after a build's last batch, which it waits for, went from 20-28 ms to 8-14.
        """
        chunks, self._unwritten = self._unwritten, []
        if not chunks:
            return

        async def write_all() -> list[BaseException | None]:
            writes = [
                self._arrays[name].async_array.setitem(slice(start, start + len(data)), data)
                for name, start, data in chunks
            ]
            return list(await asyncio.gather(*writes, return_exceptions=True))

        for (name, start, _data), exc in zip(chunks, sync(write_all()), strict=True):
            if exc is None:
                continue
            if isinstance(exc, OSError) and exc.errno in FULL_DISK_ERRNOS:
                raise StoreFullError(
                    None,
                    str(self.path / name),
                    free_bytes(self.path),
                    f"chunk {start // self.chunk_samples_of(name)} of array {name!r}",
                ) from exc
            raise exc

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
        repair whose data is not bit-identical to the original.
        """
        path = Path(path)
        try:
            root = zarr.open_group(store=DurableLocalStore(path), mode="r+", zarr_format=3)
        except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
            raise EntryWriteError(f"{path} is not a writable zarr v3 group: {exc}") from None
        names = sorted(_array_members(root))
        if array not in names:
            raise EntryWriteError(
                f"no array {array!r} in zarr entry {path}; arrays: {names}" + did_you_mean(array, names)
            )
        arr = root[array].with_config({"write_empty_chunks": True})
        n, c = int(arr.shape[0]), int(arr.chunks[0])
        total = -(-n // c)
        prepared: list[tuple[int, np.ndarray]] = []
        for index, data in sorted(chunks.items()):
            if not isinstance(index, int | np.integer) or not 0 <= index < total:
                raise EntryWriteError(
                    f"chunk index {index!r} out of range for array {array!r} ({total} chunks) in {path}"
                )
            lo, hi = int(index) * c, min((int(index) + 1) * c, n)
            values = np.asarray(data)
            if values.shape != (hi - lo, *arr.shape[1:]):
                raise EntryWriteError(
                    f"chunk {index} of array {array!r} in {path}: expected shape {(hi - lo, *arr.shape[1:])} "
                    f"(samples {lo}..{hi - 1}), got {values.shape}"
                )
            if values.dtype != arr.dtype and not np.can_cast(values.dtype, arr.dtype, casting="safe"):
                raise EntryWriteError(
                    f"chunk {index} of array {array!r} in {path}: expected dtype {arr.dtype}, "
                    f"got {values.dtype}"
                )
            prepared.append((int(index), values))
        done: list[int] = []
        for index, values in prepared:  # validated all first: no half-applied repair on a typo
            lo = index * c
            try:
                arr[lo : lo + len(values)] = values
            except OSError as exc:
                if exc.errno in FULL_DISK_ERRNOS:
                    raise StoreFullError(
                        None, str(path / array), free_bytes(path), f"rewriting chunk {index}"
                    ) from exc
                raise
            fsync_dir((path / array / _chunk_key(arr, index)).parent)
            done.append(index)
        return done

    def close(self) -> None:
        """Finish writing: raise if any array's sample count is off (its chunks, the short last ones
        too, were written as their samples arrived)."""
        if self._closed:
            return
        self._write_queued()  # nothing is queued after a completed write(); never drop a chunk if so
        self._closed = True
        self._check_complete()
        self._buffers.clear()

    def _abandon(self) -> None:
        self._closed = True  # the catalog's staging cleanup removes the files
        self._buffers.clear()


def _array_members(group: Any) -> dict[str, Any]:
    """Full name -> zarr.Array for every array under ``group``."""
    with warnings.catch_warnings():
        # A catalog entry keeps its manifest and bookkeeping files beside the hierarchy.
        warnings.filterwarnings("ignore", message="Object at .* is not recognized as a component")
        members = group.members(max_depth=None)
    return {name: node for name, node in members if isinstance(node, zarr.Array)}


def _check_chunk(root: Path, name: str, arr: Any, index: int, n: int, c: int) -> str | None:
    """None if chunk ``index`` of array ``name`` under ``root`` exists and decodes, else the reason."""
    key = _chunk_key(arr, index)
    if not (root / name / key).is_file():
        return f"chunk file {name}/{key} is missing"
    try:
        arr[index * c : min((index + 1) * c, n)]
    except _DECODE_ERRORS as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class ZarrReader(ChunkedReader):
    """Read a sample-chunked entry with stock zarr; turns decode failures into CorruptChunkError.

    ``zarr_store``: an optional zarr v3 store to read through instead of the default
    local one (e.g. a throttled store simulating slow storage). It must present the
    hierarchy at its root; ``path`` is then used for messages only.
    """

    KIND = "zarr"
    # read_chunk = decode_chunk(fetch_chunk(...)), and only fetch_chunk does I/O: a prefetcher
    # may run the two halves on different threads.
    SEPARATE_DECODE = True

    def __init__(self, path: str | os.PathLike[str], *, zarr_store: Any | None = None) -> None:
        self.path = Path(path)
        self._zarr_store = zarr_store
        if zarr_store is None and not self.path.is_dir():
            raise StoreNotFoundError(f"zarr entry directory {self.path} does not exist")
        try:
            if zarr_store is None:
                self._root = zarr.open_group(self.path, mode="r", zarr_format=3)
            else:
                self._root = zarr.open_group(store=zarr_store, mode="r", zarr_format=3)
        except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
            raise EntryReadError(f"{self.path} is not a readable zarr v3 group: {exc}") from None
        self._arrays: dict[str, Any] = _array_members(self._root)
        self._start_layout(self.path)
        for name, arr in sorted(self._arrays.items()):
            self._add_array(name, arr.shape, arr.chunks)

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

    def read_chunk(self, group: str, index: int) -> dict[str, np.ndarray]:
        """All arrays of ``group`` for the samples of chunk ``index`` (leaf name -> array)."""
        return self.decode_chunk(self.fetch_chunk(group, index))

    def fetch_chunk(self, group: str, index: int) -> RawChunk:
        """The I/O half of :meth:`read_chunk`: encoded bytes of chunk ``index`` of every array of ``group``.

        One whole-object ``get`` per array from the store (so a throttled store charges its
        latency and transfer here, and nothing in :meth:`decode_chunk` touches storage). A
        missing chunk file is a :class:`CorruptChunkError` here already, as in :meth:`read`.
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
        keys = {name: _chunk_key(self._arrays[name], index) for name in names}

        if self._zarr_store is None:
            return RawChunk(group, index, lo, hi, self._read_files(names, keys, index))

        async def get_all() -> list[Any]:
            # One trip to zarr's event loop for the whole chunk: the requests queue back to back
            # on the device instead of leaving it idle while this thread wakes up between them.
            prototype = default_buffer_prototype()
            gets = []
            for name in names:
                where = self._arrays[name].store_path
                gets.append(
                    where.store.get(f"{where.path}/{keys[name]}" if where.path else keys[name], prototype)
                )
            return list(await asyncio.gather(*gets))

        data: dict[str, Any] = {}
        for name, buf in zip(names, sync(get_all()), strict=True):
            if buf is None:
                raise CorruptChunkError(
                    str(self.path), name, index, f"chunk file {name}/{keys[name]} is missing"
                )
            data[name] = buf
        return RawChunk(group, index, lo, hi, data)

    def _read_files(self, names: list[str], keys: dict[str, str], index: int) -> dict[str, Any]:
        """The chunk files of a plain directory store, read straight from disk.

        What zarr's ``LocalStore.get`` returns, without its trip through the event loop and a
        worker thread: ~0.1 ms instead of ~0.5 ms of CPU for a chunk of five arrays. That work runs
        on the reader threads beside the training step (the next epoch's chunks are read while
        this one's first step trains), where it slows the step it shares the cores with.
        """
        make = default_buffer_prototype().buffer.from_bytes
        data: dict[str, Any] = {}
        for name in names:
            try:
                with open(self._chunk_file(name, keys[name]), "rb") as f:
                    data[name] = make(f.read())
            except FileNotFoundError:
                raise CorruptChunkError(
                    str(self.path), name, index, f"chunk file {name}/{keys[name]} is missing"
                ) from None
        return data

    def decode_chunk(self, raw: RawChunk) -> dict[str, np.ndarray]:
        """The CPU half of :meth:`read_chunk`: crc32c check, decompression and bytes -> array (leaf -> array).

        Runs each array's own zarr codecs (the ones named in its ``zarr.json``) in reverse,
        so the crc32c check and the errors are exactly those of a stock zarr read; a failure
        is a :class:`CorruptChunkError` naming the entry, array and chunk.
        """
        out: dict[str, np.ndarray] = {}
        for name, buf in raw.data.items():
            out[split_name(name)[1]] = self._decode(name, raw.index, buf)[: raw.hi - raw.lo]
        return out

    def _decode(self, name: str, index: int, buf: Any) -> np.ndarray:
        arr = self._arrays[name]
        inner = arr._async_array
        pipeline = inner.codec_pipeline
        stages = ("array_array_codecs", "array_bytes_codec", "bytes_bytes_codecs")
        if not all(hasattr(pipeline, a) for a in stages) or not hasattr(inner.metadata, "get_chunk_spec"):
            # A zarr without these hooks: decode by reading the chunk the stock way (I/O again).
            c, n = int(arr.chunks[0]), int(arr.shape[0])
            return self._read_in_chunk(name, index, index * c, min((index + 1) * c, n))
        coords = (index,) + (0,) * (arr.ndim - 1)
        spec = inner.metadata.get_chunk_spec(coords, inner.config, default_buffer_prototype())
        try:
            value: Any = buf
            for codec in reversed(pipeline.bytes_bytes_codecs):
                value = codec._decode_sync(value, spec)
            value = pipeline.array_bytes_codec._decode_sync(value, spec)
            for codec in reversed(pipeline.array_array_codecs):
                value = codec._decode_sync(value, spec)
            out = np.asarray(value.as_numpy_array())
        except _DECODE_ERRORS as exc:
            # crc32c mismatch raises ValueError; a damaged zstd/blosc frame raises RuntimeError.
            raise CorruptChunkError(str(self.path), name, index, f"{type(exc).__name__}: {exc}") from exc
        # A codec may hand back a view of its immutable bytes; callers (torch) expect to own the array.
        return out if out.flags.writeable else out.copy()

    def _chunk_file(self, name: str, key: str) -> Path:
        """Where chunk ``key`` of array ``name`` lives in a plain directory entry (no ``zarr_store``)."""
        return self.path / name / key

    def _chunk_exists(self, name: str, key: str) -> bool:
        if self._zarr_store is None:
            return self._chunk_file(name, key).is_file()
        return bool(sync(self._zarr_store.exists(f"{name}/{key}")))

    def _read_in_chunk(self, name: str, index: int, lo: int, hi: int) -> np.ndarray:
        arr = self._arrays[name]
        key = _chunk_key(arr, index)
        # Stock zarr returns the fill value for a missing chunk; here that is data loss, not zeros.
        if not self._chunk_exists(name, key):
            raise CorruptChunkError(str(self.path), name, index, f"chunk file {name}/{key} is missing")
        try:
            return arr[lo:hi]
        except _DECODE_ERRORS as exc:
            # crc32c mismatch raises ValueError; a damaged zstd/blosc frame raises RuntimeError.
            raise CorruptChunkError(str(self.path), name, index, f"{type(exc).__name__}: {exc}") from exc

    def chunk_key(self, array: str, index: int) -> str:
        """Path of chunk ``index`` of ``array`` (full name) relative to the hierarchy root, e.g. 'a/c/3/0'."""
        if array not in self._arrays:
            raise EntryReadError(f"no array {array!r} in {self.path}; arrays: {sorted(self._arrays)}")
        return f"{array}/{_chunk_key(self._arrays[array], index)}"

    def verify(self) -> list[ChunkProblem]:
        """Read and decode every chunk of every array (crc32c checked); the ones that fail, in order.

        Reads the whole entry once, chunk by chunk (memory stays at one chunk).
        """
        problems: list[ChunkProblem] = []
        for name in sorted(self._arrays):
            group = split_name(name)[0]
            n, c = self._count[group], self._chunk[group]
            for index in range(-(-n // c)):
                try:
                    self._read_in_chunk(name, index, index * c, min((index + 1) * c, n))
                except CorruptChunkError as exc:
                    problems.append(ChunkProblem(name, index, exc.reason))
        return problems
