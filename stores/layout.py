"""The layout of a sample-chunked entry, shared by the zarr and HDF5 backends.

An entry holds arrays named ``group/leaf`` (or just ``leaf`` for the top level ``''``
group), each described per sample by an :class:`ArraySpec`, chunked along the sample
axis only; every array of a group has the group's sample count and chunk size. The
helpers here validate a writer's declaration of such a layout, and :class:`ChunkedReader`
checks and answers questions about the layout a reader finds, the same way for
:mod:`stores.zarr_entry` and :mod:`stores.h5_entry`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stores.errors import EntryReadError, EntryWriteError, InvalidKeyError
from stores.keys import validate_key

# Array name components an entry directory uses for itself.
_RESERVED = {"zarr.json", "manifest.json"}
# numpy kinds with a fixed-size, endian-portable byte layout zarr's BytesCodec can store.
_NUMERIC_KINDS = set("biuf")


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or '' if none is close."""
    hit = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {hit[0]!r}?)" if hit else ""


def known_group(group: str, groups: list[str], unknown: str, where: str, error: type[Exception]) -> str:
    """``group`` without surrounding '/' if it is one of ``groups``, else ``error`` naming the choices.

    The message reads "{unknown} 'x' in {where}; groups are [...]" plus a did-you-mean.
    """
    group = group.strip("/")
    if group not in groups:
        raise error(f"{unknown} {group!r} in {where}; groups are {groups}" + did_you_mean(group, groups))
    return group


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


def check_array_name(name: str) -> str:
    """``name`` unchanged if it is a valid key without reserved components, else EntryWriteError."""
    try:
        validate_key(name)
    except InvalidKeyError as exc:
        raise EntryWriteError(f"invalid array name: {exc}") from None
    for part in name.split("/"):
        if part in _RESERVED or part.startswith("."):
            raise EntryWriteError(f"array name {name!r} uses the reserved component {part!r}")
    return name


def sample_counts(num_samples: int | Mapping[str, int], groups: list[str], path: Path) -> dict[str, int]:
    """Group -> sample count, from one count for every group or a mapping with one per group."""
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


def check_chunk_samples(
    where: Path,
    array: str,
    index: object,
    data: object,
    num_samples: int,
    chunk_samples: int,
    sample_shape: tuple[int, ...],
    dtype: object,
) -> tuple[int, int]:
    """Samples ``[lo, hi)`` that chunk ``index`` of ``array`` holds, after checking that ``data`` is
    exactly those samples (shape, and a dtype that casts safely); else :class:`EntryWriteError`.

    What a repair's recomputed chunk must pass before anything is written (both backends).
    """
    total = -(-num_samples // chunk_samples)
    if isinstance(index, bool) or not isinstance(index, int | np.integer) or not 0 <= index < total:
        raise EntryWriteError(
            f"chunk index {index!r} out of range for array {array!r} ({total} chunks) in {where}"
        )
    lo, hi = int(index) * chunk_samples, min((int(index) + 1) * chunk_samples, num_samples)
    values = np.asarray(data)
    want = (hi - lo, *sample_shape)
    if values.shape != want:
        raise EntryWriteError(
            f"chunk {index} of array {array!r} in {where}: expected shape {want} "
            f"(samples {lo}..{hi - 1}), got {values.shape}"
        )
    target = np.dtype(dtype)  # type: ignore[call-overload]  # a numpy dtype or its name
    if values.dtype != target and not np.can_cast(values.dtype, target, casting="safe"):
        raise EntryWriteError(
            f"chunk {index} of array {array!r} in {where}: expected dtype {target}, got {values.dtype}"
        )
    return lo, hi


class ChunkedReader:
    """Base of :class:`~stores.zarr_entry.ZarrReader` and :class:`~stores.h5_entry.H5Reader`.

    Records each group's sample count and chunk size while a subclass walks its arrays
    (:meth:`_add_array`) and answers the questions about them; :meth:`read` stitches a
    sample range together from the subclass's ``_read_in_chunk``.
    """

    KIND = ""  # the container's name in messages: "no group 'x' in zarr entry ..."

    def _start_layout(self, where: Path) -> None:
        """``where`` names the entry in every message of this reader."""
        self._where = where
        self._chunk: dict[str, int] = {}
        self._count: dict[str, int] = {}

    def _add_array(self, name: str, shape: tuple[int, ...], chunks: tuple[int, ...] | None) -> None:
        """Check that array ``name`` is chunked along samples only, consistently with its group."""
        group = split_name(name)[0]
        if not shape or chunks is None or tuple(chunks[1:]) != tuple(shape[1:]):
            raise EntryReadError(
                f"array {name!r} in {self._where} is not chunked along samples only: "
                f"shape {shape}, chunks {chunks}"
            )
        n, c = int(shape[0]), int(chunks[0])
        if self._chunk.setdefault(group, c) != c or self._count.setdefault(group, n) != n:
            raise EntryReadError(
                f"arrays of group {group!r} in {self._where} disagree: {name!r} has {n} samples "
                f"in chunks of {c}, others {self._count[group]} in chunks of {self._chunk[group]}"
            )

    @property
    def arrays(self) -> dict[str, ArraySpec]:
        """Full array name -> per-sample spec."""
        raise NotImplementedError

    @property
    def _names(self) -> Mapping[str, object]:
        """The entry's arrays by full name (in the order messages list them)."""
        raise NotImplementedError

    def _read_in_chunk(self, name: str, index: int, lo: int, hi: int) -> np.ndarray:
        """Samples ``[lo, hi)`` of array ``name``, all within chunk ``index``."""
        raise NotImplementedError

    @property
    def groups(self) -> list[str]:
        return sorted(self._chunk)

    def _group(self, group: str) -> str:
        return known_group(group, self.groups, "no group", f"{self.KIND} entry {self._where}", EntryReadError)

    def num_samples(self, group: str = "") -> int:
        return self._count[self._group(group)]

    def chunk_samples(self, group: str = "") -> int:
        return self._chunk[self._group(group)]

    def num_chunks(self, group: str = "") -> int:
        group = self._group(group)
        return -(-self._count[group] // self._chunk[group])

    def read(self, group: str, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Samples ``[start, stop)`` of array ``name`` (leaf name within ``group``)."""
        group = self._group(group)
        full = f"{group}/{name}" if group else name
        if full not in self._names:
            leaves = [split_name(n)[1] for n in self._names if split_name(n)[0] == group]
            raise EntryReadError(
                f"no array {name!r} in group {group!r} of {self._where}; arrays: {leaves}"
                + did_you_mean(name, leaves)
            )
        n, c = self._count[group], self._chunk[group]
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise EntryReadError(
                f"sample range [{start}, {stop}) is outside [0, {n}] for {full!r} in {self._where}"
            )
        spec = self.arrays[full]
        out = np.empty((stop - start, *spec.sample_shape), dtype=spec.dtype)
        # Chunk by chunk so a decode failure names the exact chunk.
        for index in range(start // c, -(-stop // c)):
            lo, hi = max(start, index * c), min(stop, (index + 1) * c)
            out[lo - start : hi - start] = self._read_in_chunk(full, index, lo, hi)
        return out
