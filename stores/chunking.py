"""Chunk buffering shared by the sample-chunked entry writers (zarr and HDF5).

Both writers accept batches of any size and store every chunk along the sample axis
exactly once and whole: a batch first tops up its array's pending chunk, its whole chunks
then go on straight from the caller's array, and the rest waits in a buffer of one chunk
per array (so memory does not grow with the number of samples). :class:`ChunkedWriter`
holds that bookkeeping, the checks of the declared arrays and of every batch, and the
sample counts; a backend says what happens to a finished chunk (:meth:`ChunkedWriter._emit`)
and everything about its container (files, resume, durability).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import numpy as np

from stores.errors import EntryWriteError
from stores.layout import ArraySpec, check_array_name, did_you_mean, known_group, sample_counts, split_name

_Writer = TypeVar("_Writer", bound="ChunkedWriter")


class ChunkedWriter:
    """Base of :class:`~stores.zarr_entry.ZarrWriter` and :class:`~stores.h5_entry.H5Writer`.

    A subclass calls :meth:`_declare` early in ``__init__`` and :meth:`_start_buffers` once
    :meth:`resume_samples` can answer, and implements :meth:`_emit`, :meth:`resume_samples`,
    ``close`` and :meth:`_abandon`. Used as a context manager, the writer closes on success
    and is abandoned on an exception.
    """

    KIND = ""  # the container's name in messages: "zarr entry ...", "HDF5 writer for ..."

    chunk_samples: int
    group_chunk_samples: dict[str, int]
    specs: dict[str, ArraySpec]
    groups: list[str]
    num_samples: dict[str, int]

    def _declare(
        self,
        where: Path,
        arrays: Mapping[str, ArraySpec],
        num_samples: int | Mapping[str, int],
        chunk_samples: int | Mapping[str, int],
    ) -> None:
        """Validate and record the arrays, their groups, per-group sample counts and chunk lengths.

        ``chunk_samples`` is one chunk length for every group, or a mapping group -> chunk
        length (each group's chunks sized for its own per-sample bytes). ``where`` names the
        entry in every message of this writer.
        """
        self._where = where
        lengths = chunk_samples.values() if isinstance(chunk_samples, Mapping) else [chunk_samples]
        if not lengths or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in lengths):
            raise EntryWriteError(
                f"chunk_samples must be a positive int (or a mapping group -> int), got {chunk_samples!r}"
            )
        if not arrays:
            raise EntryWriteError(f"no arrays declared for {self.KIND} entry {where}")
        self.specs = {check_array_name(name): spec for name, spec in arrays.items()}
        for name in self.specs:
            clash = [other for other in self.specs if other.startswith(name + "/")]
            if clash:
                raise EntryWriteError(f"array {name!r} cannot also be a group holding {clash} in {where}")
        self.groups = sorted({split_name(name)[0] for name in self.specs})
        self.num_samples = sample_counts(num_samples, self.groups, where)
        if isinstance(chunk_samples, Mapping):
            unknown = sorted(set(chunk_samples) - set(self.groups))
            missing = sorted(set(self.groups) - set(chunk_samples))
            if unknown or missing:
                raise EntryWriteError(
                    f"chunk_samples for {where} must give every group a chunk length: "
                    f"missing {missing}, unknown {unknown}"
                )
            self.group_chunk_samples = {g: int(chunk_samples[g]) for g in self.groups}
        else:
            self.group_chunk_samples = dict.fromkeys(self.groups, chunk_samples)
        # The largest chunk length (the only one when all groups share it): messages, memory bounds.
        self.chunk_samples = max(self.group_chunk_samples.values())

    def chunk_samples_of(self, name: str) -> int:
        """Chunk length (samples) of array ``name``'s group."""
        return self.group_chunk_samples[split_name(name)[0]]

    def _start_buffers(self) -> None:
        """Empty chunk buffers; each array continues after the samples :meth:`resume_samples` kept."""
        self._buffers: dict[str, np.ndarray] = {}
        self._filled = dict.fromkeys(self.specs, 0)  # samples in the buffer
        self._written = {  # samples already handed to _emit (or kept by a resume)
            name: self.resume_samples(split_name(name)[0]) for name in self.specs
        }
        self._closed = False

    def resume_samples(self, group: str = "") -> int:
        raise NotImplementedError

    def _emit(self, name: str, chunk: np.ndarray) -> None:
        """Take chunk ``self._written[name] // chunk_samples`` of array ``name`` (whole, or the short
        last one) and advance ``self._written[name]`` by its length. The writer never changes
        ``chunk`` afterwards; it may be a view of the caller's batch, which is the caller's again
        once :meth:`write` returns."""
        raise NotImplementedError

    def _after_batch(self, group: str) -> None:
        """Called after every accepted batch of ``group``."""

    def close(self) -> None:
        raise NotImplementedError

    def _abandon(self) -> None:
        """Stop after an exception in the ``with`` block, without completing the entry."""
        raise NotImplementedError

    def __enter__(self: _Writer) -> _Writer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abandon()

    def _known_group(self, group: str) -> str:
        where = f"{self.KIND} entry {self._where}"
        return known_group(group, self.groups, "unknown group", where, EntryWriteError)

    def received(self, name: str) -> int:
        """Samples accepted so far for array ``name``."""
        return self._written[name] + self._filled[name]

    def write(self, group: str, batch: Mapping[str, np.ndarray]) -> None:
        """Append the next samples of ``group`` ('' for top-level arrays); keys are leaf names.

        Arrays of one batch must have the same number of samples; arrays of a group may
        be written in separate calls but each one strictly in sample order.
        """
        if self._closed:
            raise EntryWriteError(f"{self.KIND} writer for {self._where} is closed")
        group = self._known_group(group)
        if not batch:
            raise EntryWriteError(f"empty batch written to group {group!r} of {self._where}")
        prepared: dict[str, np.ndarray] = {}
        for leaf, data in batch.items():
            name = f"{group}/{leaf}" if group else leaf
            prepared[name] = self._check_batch(name, group, data)
        lengths = {name: len(arr) for name, arr in prepared.items()}
        if len(set(lengths.values())) > 1:
            raise EntryWriteError(
                f"batch for group {group!r} of {self._where} mixes sample counts: {lengths}"
            )
        for name, data in prepared.items():
            self._append(name, data)
        self._after_batch(group)

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
                    f"array {name!r} in {self._where}: batch starts at sample {start} but only {have} "
                    "samples were written; samples must be contiguous"
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

    def _check_batch(self, name: str, group: str, data: np.ndarray) -> np.ndarray:
        where = self._where
        if name not in self.specs:
            leaves = [split_name(n)[1] for n in self.specs if split_name(n)[0] == group]
            raise EntryWriteError(
                f"array {split_name(name)[1]!r} is not declared in group {group!r} of {where}; "
                f"declared: {leaves}" + did_you_mean(split_name(name)[1], leaves)
            )
        spec = self.specs[name]
        arr = np.asarray(data)
        if arr.ndim == 0 or arr.shape[1:] != spec.sample_shape:
            raise EntryWriteError(
                f"array {name!r} in {where}: expected a batch of samples of shape {spec.sample_shape} "
                f"(array shape (n, *{spec.sample_shape})), got {arr.shape}"
            )
        if arr.dtype != np.dtype(spec.dtype) and not np.can_cast(arr.dtype, spec.dtype, casting="safe"):
            raise EntryWriteError(
                f"array {name!r} in {where}: expected dtype {spec.dtype} (or one that casts safely), "
                f"got {arr.dtype}"
            )
        expected = self.num_samples[split_name(name)[0]]
        if self.received(name) + len(arr) > expected:
            raise EntryWriteError(
                f"array {name!r} in {where}: expected {expected} samples in total, got at least "
                f"{self.received(name) + len(arr)} (this batch of {len(arr)} overflows)"
            )
        return arr

    def _append(self, name: str, data: np.ndarray) -> None:
        c = self.chunk_samples_of(name)
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
            self._emit(name, data[pos : pos + c])
            pos += c
        if pos < len(data):
            rest = len(data) - pos
            self._buffer(name)[:rest] = data[pos:]
            self._filled[name] = rest
        # An array's short last chunk waits for nothing once its last sample is in: write it now (a
        # cache build's writer thread does so while later splits compute; HDF5 writes it in its row).
        if self._filled[name] and self.received(name) == self.num_samples[split_name(name)[0]]:
            self._flush(name)

    def _buffer(self, name: str) -> np.ndarray:
        if name not in self._buffers:
            spec = self.specs[name]
            shape = (self.chunk_samples_of(name), *spec.sample_shape)
            self._buffers[name] = np.empty(shape, dtype=spec.dtype)
        return self._buffers[name]

    def _flush(self, name: str) -> None:
        # The buffer leaves with its chunk (a backend may still hold it after _emit returns); the
        # array's next samples go into a new one.
        self._emit(name, self._buffers.pop(name)[: self._filled[name]])
        self._filled[name] = 0

    def _check_complete(self) -> None:
        """Raise :class:`EntryWriteError` naming every array that did not get its group's sample count."""
        wrong = {
            name: (self.num_samples[split_name(name)[0]], self.received(name))
            for name in self.specs
            if self.received(name) != self.num_samples[split_name(name)[0]]
        }
        if wrong:
            detail = "; ".join(
                f"array {n!r}: expected {e} samples, got {g}" for n, (e, g) in sorted(wrong.items())
            )
            raise EntryWriteError(f"{self.KIND} entry {self._where} is incomplete: {detail}")
