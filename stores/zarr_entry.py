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
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec

from stores.abc import validate_key
from stores.errors import (
    CorruptChunkError,
    EntryReadError,
    EntryWriteError,
    InvalidKeyError,
    StoreNotFoundError,
)

Compressor = Literal["zstd", "blosc", "none"]
_LEVELS = {"zstd": range(-7, 23), "blosc": range(0, 10), "none": range(-7, 23)}
_RESERVED = {"zarr.json", "manifest.json"}
# numpy kinds with a fixed-size, endian-portable byte layout zarr's BytesCodec can store.
_NUMERIC_KINDS = set("biuf")


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    hit = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {hit[0]!r}?)" if hit else ""


def split_name(name: str) -> tuple[str, str]:
    """'train/codes' -> ('train', 'codes'); 'codes' -> ('', 'codes')."""
    group, _, leaf = name.rpartition("/")
    return group, leaf


@dataclass(frozen=True)
class ArraySpec:
    """Per-sample shape and dtype of one array; the sample axis is implicit (axis 0 on disk)."""

    sample_shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        shape = tuple(self.sample_shape)
        if not all(isinstance(d, int | np.integer) and d >= 1 for d in shape):
            raise EntryWriteError(f"sample_shape must be positive integers, got {self.sample_shape!r}")
        try:
            dtype = np.dtype(self.dtype)
        except TypeError as exc:
            raise EntryWriteError(f"dtype {self.dtype!r} is not a numpy dtype: {exc}") from None
        if dtype.kind not in _NUMERIC_KINDS:
            raise EntryWriteError(f"dtype {self.dtype!r} is not a fixed-size numeric/bool dtype")
        object.__setattr__(self, "sample_shape", tuple(int(d) for d in shape))
        object.__setattr__(self, "dtype", dtype.name)

    @property
    def sample_bytes(self) -> int:
        return math.prod(self.sample_shape) * np.dtype(self.dtype).itemsize


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


class ZarrWriter:
    """Append samples group by group; ``close()`` checks every array got exactly its sample count."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        arrays: Mapping[str, ArraySpec],
        num_samples: int | Mapping[str, int],
        chunk_samples: int,
        attrs: Mapping[str, Any] | None = None,
        compressor: Compressor = "zstd",
        level: int = 3,
        checksum: bool = True,
    ) -> None:
        self.path = Path(path)
        if compressor not in _LEVELS:
            raise EntryWriteError(f"compressor must be one of {sorted(_LEVELS)}, got {compressor!r}")
        if level not in _LEVELS[compressor]:
            lv = _LEVELS[compressor]
            raise EntryWriteError(f"{compressor} level must be in [{lv.start}, {lv.stop - 1}], got {level}")
        if not isinstance(chunk_samples, int) or chunk_samples < 1:
            raise EntryWriteError(f"chunk_samples must be a positive int, got {chunk_samples!r}")
        if not arrays:
            raise EntryWriteError(f"no arrays declared for zarr entry {self.path}")
        self.chunk_samples = chunk_samples
        self.specs = {_check_name(name): spec for name, spec in arrays.items()}
        for name in self.specs:
            clash = [other for other in self.specs if other.startswith(name + "/")]
            if clash:
                raise EntryWriteError(f"array {name!r} cannot also be a group holding {clash} in {self.path}")
        self.groups = sorted({split_name(name)[0] for name in self.specs})
        self.num_samples = _sample_counts(num_samples, self.groups, self.path)
        try:
            attrs_json = json.loads(json.dumps(dict(attrs or {}), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise EntryWriteError(f"attrs for zarr entry {self.path} are not JSON-able: {exc}") from None
        if (self.path / "zarr.json").exists():
            raise EntryWriteError(f"{self.path} already holds a zarr hierarchy; write into a fresh directory")
        root = zarr.open_group(self.path, mode="w-", zarr_format=3, attributes=attrs_json)
        self._arrays: dict[str, Any] = {}
        self._buffers: dict[str, np.ndarray] = {}
        self._filled: dict[str, int] = {}  # samples in the buffer
        self._written: dict[str, int] = {}  # samples already persisted in whole chunks
        for name, spec in sorted(self.specs.items()):
            n = self.num_samples[split_name(name)[0]]
            self._arrays[name] = root.create_array(
                name,
                shape=(n, *spec.sample_shape),
                dtype=spec.dtype,
                chunks=(chunk_samples, *spec.sample_shape),
                serializer=BytesCodec(),
                compressors=_codecs(compressor, level, checksum, np.dtype(spec.dtype).itemsize),
                fill_value=0,
                config={"write_empty_chunks": True},
            )
            self._filled[name] = 0
            self._written[name] = 0
        self._closed = False

    def received(self, name: str) -> int:
        """Samples accepted so far for array ``name``."""
        return self._written[name] + self._filled[name]

    def write(self, group: str, batch: Mapping[str, np.ndarray]) -> None:
        """Append the next samples of ``group`` ('' for top-level arrays); keys are leaf names.

        Arrays of one batch must have the same number of samples; arrays of a group may
        be written in separate calls but each one strictly in sample order.
        """
        if self._closed:
            raise EntryWriteError(f"zarr writer for {self.path} is closed")
        group = group.strip("/")
        if group not in self.num_samples:
            raise EntryWriteError(
                f"unknown group {group!r} in zarr entry {self.path}; groups are {self.groups}"
                + _did_you_mean(group, self.groups)
            )
        if not batch:
            raise EntryWriteError(f"empty batch written to group {group!r} of {self.path}")
        prepared: dict[str, np.ndarray] = {}
        for leaf, data in batch.items():
            name = f"{group}/{leaf}" if group else leaf
            prepared[name] = self._check_batch(name, group, data)
        lengths = {name: len(arr) for name, arr in prepared.items()}
        if len(set(lengths.values())) > 1:
            raise EntryWriteError(f"batch for group {group!r} of {self.path} mixes sample counts: {lengths}")
        for name, data in prepared.items():
            self._append(name, data)

    def _check_batch(self, name: str, group: str, data: np.ndarray) -> np.ndarray:
        if name not in self.specs:
            leaves = [split_name(n)[1] for n in self.specs if split_name(n)[0] == group]
            raise EntryWriteError(
                f"array {split_name(name)[1]!r} is not declared in group {group!r} of {self.path}; "
                f"declared: {leaves}" + _did_you_mean(split_name(name)[1], leaves)
            )
        spec = self.specs[name]
        arr = np.asarray(data)
        if arr.ndim == 0 or arr.shape[1:] != spec.sample_shape:
            raise EntryWriteError(
                f"array {name!r} in {self.path}: expected a batch of samples of shape {spec.sample_shape} "
                f"(array shape (n, *{spec.sample_shape})), got {arr.shape}"
            )
        if arr.dtype != np.dtype(spec.dtype) and not np.can_cast(arr.dtype, spec.dtype, casting="safe"):
            raise EntryWriteError(
                f"array {name!r} in {self.path}: expected dtype {spec.dtype} (or one that casts safely), "
                f"got {arr.dtype}"
            )
        expected = self.num_samples[split_name(name)[0]]
        if self.received(name) + len(arr) > expected:
            raise EntryWriteError(
                f"array {name!r} in {self.path}: expected {expected} samples in total, got at least "
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
                self._flush(name, buf)
        while len(data) - pos >= c:  # whole chunks straight from the caller's batch, no copy
            self._store(name, np.asarray(data[pos : pos + c], dtype=self.specs[name].dtype))
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

    def _flush(self, name: str, buf: np.ndarray) -> None:
        self._store(name, buf[: self._filled[name]])
        self._filled[name] = 0

    def _store(self, name: str, data: np.ndarray) -> None:
        start = self._written[name]
        self._arrays[name][start : start + len(data)] = data
        self._written[name] = start + len(data)

    def close(self) -> None:
        """Flush the last (possibly short) chunks; raise if any array's sample count is off."""
        if self._closed:
            return
        wrong = {
            name: (self.num_samples[split_name(name)[0]], self.received(name))
            for name in self.specs
            if self.received(name) != self.num_samples[split_name(name)[0]]
        }
        self._closed = True
        if wrong:
            detail = "; ".join(
                f"array {n!r}: expected {e} samples, got {g}" for n, (e, g) in sorted(wrong.items())
            )
            raise EntryWriteError(f"zarr entry {self.path} is incomplete: {detail}")
        for name in self.specs:
            if self._filled[name]:
                self._flush(name, self._buffers[name])
        self._buffers.clear()

    def __enter__(self) -> ZarrWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True  # abandoned: the catalog's staging cleanup removes the files
            self._buffers.clear()


def _check_name(name: str) -> str:
    try:
        validate_key(name)
    except InvalidKeyError as exc:
        raise EntryWriteError(f"invalid array name: {exc}") from None
    for part in name.split("/"):
        if part in _RESERVED or part.startswith("."):
            raise EntryWriteError(f"array name {name!r} uses the reserved component {part!r}")
    return name


def _sample_counts(num_samples: int | Mapping[str, int], groups: list[str], path: Path) -> dict[str, int]:
    counts = {g: num_samples for g in groups} if isinstance(num_samples, int) else dict(num_samples)
    counts = {str(k).strip("/"): v for k, v in counts.items()}
    if set(counts) != set(groups):
        raise EntryWriteError(
            f"num_samples for {path} must have one count per group {groups} ('' = top level), "
            f"got keys {sorted(counts)}"
        )
    for g, n in counts.items():
        if not isinstance(n, int | np.integer) or n < 0:
            raise EntryWriteError(f"num_samples[{g!r}] for {path} must be an int >= 0, got {n!r}")
    return {g: int(n) for g, n in counts.items()}


class ZarrReader:
    """Read a sample-chunked entry with stock zarr; turns decode failures into CorruptChunkError."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise StoreNotFoundError(f"zarr entry directory {self.path} does not exist")
        try:
            self._root = zarr.open_group(self.path, mode="r", zarr_format=3)
        except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
            raise EntryReadError(f"{self.path} is not a readable zarr v3 group: {exc}") from None
        self._arrays: dict[str, Any] = {
            name: node for name, node in self._root.members(max_depth=None) if isinstance(node, zarr.Array)
        }
        self._chunk: dict[str, int] = {}
        self._count: dict[str, int] = {}
        for name, arr in sorted(self._arrays.items()):
            self._check_layout(name, arr)

    def _check_layout(self, name: str, arr: Any) -> None:
        group = split_name(name)[0]
        if arr.ndim == 0 or tuple(arr.chunks[1:]) != tuple(arr.shape[1:]):
            raise EntryReadError(
                f"array {name!r} in {self.path} is not chunked along samples only: "
                f"shape {arr.shape}, chunks {arr.chunks}"
            )
        n, c = int(arr.shape[0]), int(arr.chunks[0])
        if self._chunk.setdefault(group, c) != c or self._count.setdefault(group, n) != n:
            raise EntryReadError(
                f"arrays of group {group!r} in {self.path} disagree: {name!r} has {n} samples "
                f"in chunks of {c}, others {self._count[group]} in chunks of {self._chunk[group]}"
            )

    @property
    def arrays(self) -> dict[str, ArraySpec]:
        """Full array name -> per-sample spec."""
        return {n: ArraySpec(tuple(a.shape[1:]), str(a.dtype)) for n, a in sorted(self._arrays.items())}

    @property
    def groups(self) -> list[str]:
        return sorted(self._chunk)

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self._root.attrs)

    def _group(self, group: str) -> str:
        group = group.strip("/")
        if group not in self._chunk:
            raise EntryReadError(
                f"no group {group!r} in zarr entry {self.path}; groups are {self.groups}"
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

    def read_chunk(self, group: str, index: int) -> dict[str, np.ndarray]:
        """All arrays of ``group`` for the samples of chunk ``index`` (leaf name -> array)."""
        group = self._group(group)
        total = self.num_chunks(group)
        if not isinstance(index, int | np.integer) or not 0 <= index < total:
            raise EntryReadError(
                f"chunk index {index!r} out of range for group {group!r} ({total} chunks) in {self.path}"
            )
        c = self._chunk[group]
        lo, hi = index * c, min((index + 1) * c, self._count[group])
        return {
            split_name(name)[1]: self._read_in_chunk(name, int(index), lo, hi)
            for name in sorted(self._arrays)
            if split_name(name)[0] == group
        }

    def read(self, group: str, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Samples ``[start, stop)`` of array ``name`` (leaf name within ``group``)."""
        group = self._group(group)
        full = f"{group}/{name}" if group else name
        if full not in self._arrays:
            leaves = [split_name(n)[1] for n in self._arrays if split_name(n)[0] == group]
            raise EntryReadError(
                f"no array {name!r} in group {group!r} of {self.path}; arrays: {leaves}"
                + _did_you_mean(name, leaves)
            )
        n, c = self._count[group], self._chunk[group]
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise EntryReadError(
                f"sample range [{start}, {stop}) is outside [0, {n}] for {full!r} in {self.path}"
            )
        spec = self.arrays[full]
        out = np.empty((stop - start, *spec.sample_shape), dtype=spec.dtype)
        # Chunk by chunk so a decode failure names the exact chunk.
        for index in range(start // c, -(-stop // c)):
            lo, hi = max(start, index * c), min(stop, (index + 1) * c)
            out[lo - start : hi - start] = self._read_in_chunk(full, index, lo, hi)
        return out

    def _read_in_chunk(self, name: str, index: int, lo: int, hi: int) -> np.ndarray:
        arr = self._arrays[name]
        key = arr.metadata.encode_chunk_key((index,) + (0,) * (arr.ndim - 1))
        if not (self.path / name / key).is_file():
            raise CorruptChunkError(str(self.path), name, index, f"chunk file {name}/{key} is missing")
        try:
            return arr[lo:hi]
        except (ValueError, RuntimeError, TypeError, OSError) as exc:
            # crc32c mismatch raises ValueError; a damaged zstd/blosc frame raises RuntimeError.
            raise CorruptChunkError(str(self.path), name, index, f"{type(exc).__name__}: {exc}") from exc
