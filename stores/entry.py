"""The entry contract: what every entry backend writes and reads, and the one place a format is chosen.

A cache entry directory holds its data in one of two containers, plain enough that stock
tools read them: zarr v3 (``data.zarr/``, :mod:`stores.zarr_entry`) or HDF5 (``entry.h5``,
:mod:`stores.h5_entry`). Callers (the cache operator, the Dask executor, repair) describe
what to store with an :class:`EntryLayout`, open a writer with :func:`open_writer` and a
reader with :func:`open_reader`, and use only what the :class:`EntryWriter` and
:class:`EntryReader` protocols declare: no format checks, no backend classes, no private
attributes. Capabilities that differ between backends are declared attributes
(``separate_decode``, ``device``, ``restart_reason``), not probed with ``hasattr``.

Integrity is part of the contract too: :meth:`EntryReader.verify` checks every chunk of
every array against its checksum and decodes it, naming the file (and for HDF5 the bytes)
holding each bad one, and a :class:`ChunkRewriter` (:func:`open_rewriter`) replaces just
those chunks with recomputed samples, crash-safely. ``cache verify`` (:mod:`stores.verify`)
and ``cache repair`` use only these, with the backend picked from the container found
(:func:`find_containers`), so both formats are verified and repaired the same way.

Importing this module imports neither zarr nor h5py; each backend is imported when its
format is opened, so an HDF5 entry is written and read without zarr.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from stores.errors import EntryWriteError
from stores.integrity import REPAIR_SUFFIX, ChunkChecksum, ChunkProblem, Rewrite
from stores.layout import ArraySpec, split_name

if TYPE_CHECKING:
    from stores.throttle import ThrottleDevice, ThrottleProfile

__all__ = [
    "FORMATS",
    "H5_FILE",
    "REPAIR_SUFFIX",
    "ZARR_DIR",
    "ChunkChecksum",
    "ChunkProblem",
    "ChunkRewriter",
    "Container",
    "EntryLayout",
    "EntryReader",
    "EntryWriter",
    "Format",
    "Rewrite",
    "container_format",
    "entry_format",
    "find_containers",
    "group_sample_bytes",
    "open_container",
    "open_reader",
    "open_rewriter",
    "open_writer",
    "plan_chunk_samples",
]

Format = Literal["zarr", "hdf5"]
FORMATS: tuple[Format, ...] = ("zarr", "hdf5")
# Where each format keeps its data inside an entry directory.
ZARR_DIR = "data.zarr"
H5_FILE = "entry.h5"
OnMismatch = Literal["raise", "wipe"]
@dataclass(frozen=True)
class EntryLayout:
    """Everything that fixes an entry's bytes besides the samples themselves.

    ``arrays``: "group/leaf" -> per-sample shape and dtype; ``counts``: group -> samples;
    ``chunk_samples``: group -> samples per chunk (an HDF5 entry needs one length for all
    groups, see :func:`plan_chunk_samples`); ``attrs``: JSON-able attributes stored with it.
    """

    arrays: dict[str, ArraySpec]
    counts: dict[str, int]
    chunk_samples: dict[str, int]
    attrs: dict[str, Any] = field(default_factory=dict)
    compressor: str = "zstd"
    level: int = 3


def plan_chunk_samples(
    fmt: Format, sample_bytes: Mapping[str, int], counts: Mapping[str, int], chunk_bytes: int
) -> dict[str, int]:
    """Samples per chunk of each group, so chunks hold about ``chunk_bytes`` (at least one sample).

    ``sample_bytes``: group -> bytes of one sample over all its arrays. zarr sizes each
    group's chunks for its own samples: a 2-bit train group next to float16 eval groups has
    much smaller samples, and sized by the largest group its chunks would be a fraction of
    ``chunk_bytes``, so an epoch would pay the per-chunk costs (one file per array, a crc32c,
    a decompressor call, a queue hand-over) that many times more often. HDF5 has one chunk
    length for the whole file, sized by the largest sample. Capped by the group's sample count.
    """
    if fmt == "hdf5":
        per_sample = max(sample_bytes.values(), default=0) or 1
        most = max(counts.values(), default=0) or 1
        one = int(max(1, min(most, chunk_bytes // per_sample)))
        return dict.fromkeys(counts, one)
    return {
        group: int(max(1, min(counts[group] or 1, chunk_bytes // (sample_bytes[group] or 1))))
        for group in counts
    }


class EntryWriter(Protocol):
    """Appends samples group by group; ``close()`` checks every array got exactly its sample count.

    A writer opened with ``resume=True`` keeps what an interrupted build durably stored:
    :meth:`resume_samples` says how many leading samples of a group are kept, and
    ``restart_reason`` why nothing could be kept (None if there was nothing to keep, or
    it was kept). Used as a context manager it closes on success and is abandoned on an
    exception (the files stay for a later resume).
    """

    path: Path
    restart_reason: str | None

    def resume_samples(self, group: str = "") -> int: ...

    def write(self, group: str, batch: Mapping[str, np.ndarray]) -> None: ...

    def write_at(self, group: str, start: int, batch: Mapping[str, np.ndarray]) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> EntryWriter: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class EntryReader(Protocol):
    """Reads a finished entry chunk by chunk; a damaged or missing chunk is a CorruptChunkError.

    ``fetch_chunk`` is the I/O half of ``read_chunk`` and ``decode_chunk`` the CPU half;
    ``separate_decode`` says whether splitting them pays (True: the fetch only reads, so a
    prefetcher may run the halves on two threads; False: the fetch already decodes and
    ``decode_chunk`` is the identity). ``device`` is the simulated slow device reads are
    booked on, or None.
    """

    path: Path
    separate_decode: bool
    device: ThrottleDevice | None
    # What verify() checks each chunk against; None when the container records no per-chunk
    # checksum (an HDF5 entry written before they were recorded): verify can then only decode.
    chunk_checksum: ChunkChecksum | None

    @property
    def groups(self) -> list[str]: ...

    @property
    def arrays(self) -> dict[str, ArraySpec]: ...

    @property
    def attrs(self) -> dict[str, Any]: ...

    def num_samples(self, group: str = "") -> int: ...

    def chunk_samples(self, group: str = "") -> int: ...

    def num_chunks(self, group: str = "") -> int: ...

    def read(self, group: str, name: str, start: int = 0, stop: int | None = None) -> np.ndarray: ...

    def read_chunk(self, group: str, index: int) -> dict[str, np.ndarray]: ...

    def fetch_chunk(self, group: str, index: int) -> Any: ...

    def decode_chunk(self, raw: Any) -> dict[str, np.ndarray]: ...

    def verify(self) -> list[ChunkProblem]:
        """Read every chunk of every array once, check it against ``chunk_checksum`` and decode it;
        the chunks that fail, in array then chunk order (memory stays at one chunk)."""
        ...

    def close(self) -> None: ...


class ChunkRewriter(Protocol):
    """Replaces chunks of a finished container with recomputed samples (``cache repair``).

    ``chunks``: array (full name) -> chunk index -> that chunk's samples (``chunk_samples``
    of them, fewer for a group's last chunk). Everything is validated before anything is
    written. A crash at any point leaves every chunk whole, old or new (see each backend);
    chunks not named are kept byte for byte, and one that is itself damaged is refused, not
    copied. The manifest's record of sizes and sha256s is the caller's to update
    (``Catalog.reseal``) when :attr:`Rewrite.identical` is not True.
    """

    path: Path

    def rewrite_chunks(self, chunks: Mapping[str, Mapping[int, np.ndarray]]) -> Rewrite: ...


@dataclass(frozen=True)
class Container:
    """A zarr hierarchy or HDF5 entry file inside an entry directory: ``rel`` is its path relative
    to the directory ('' when the directory itself is the zarr group), ``fmt`` its format."""

    rel: str
    fmt: Format


def find_containers(entry_dir: str | os.PathLike[str]) -> list[Container]:
    """Every container under ``entry_dir``, sorted by path: the outermost zarr hierarchies (nodes
    nested in one belong to it) and every HDF5 entry file (named ``entry.h5``).

    A directory whose zarr.json does not parse is listed too, so verify reports it instead
    of skipping it.
    """
    root = Path(entry_dir)
    found: list[Container] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = Path(dirpath).relative_to(root).as_posix()
        rel = "" if rel == "." else rel
        if "zarr.json" in filenames:
            found.append(Container(rel, "zarr"))
            dirnames.clear()  # nested nodes belong to this hierarchy
            continue
        if H5_FILE in filenames:
            found.append(Container(f"{rel}/{H5_FILE}" if rel else H5_FILE, "hdf5"))
    return sorted(found, key=lambda c: c.rel)


def container_format(path: str | os.PathLike[str]) -> Format:
    """The format of the container at ``path``: a file is an HDF5 entry, a directory a zarr hierarchy."""
    return "hdf5" if Path(path).is_file() else "zarr"


def open_container(
    path: str | os.PathLike[str],
    *,
    throttle: ThrottleProfile | ThrottleDevice | str | None = None,
) -> EntryReader:
    """The reader of the container at ``path`` (a zarr hierarchy's directory, or an HDF5 entry file)."""
    if container_format(path) == "hdf5":
        from stores.h5_reader import H5Reader

        return H5Reader(path, throttle=throttle)
    from stores.zarr_reader import ZarrReader

    return ZarrReader(path, throttle=throttle)


def open_rewriter(path: str | os.PathLike[str]) -> ChunkRewriter:
    """The :class:`ChunkRewriter` of the finished container at ``path`` (zarr directory or HDF5 file)."""
    if container_format(path) == "hdf5":
        from stores.h5_repair import H5ChunkRewriter

        return H5ChunkRewriter(path)
    from stores.zarr_entry import ZarrChunkRewriter

    return ZarrChunkRewriter(path)


def entry_format(entry_dir: str | os.PathLike[str]) -> Format:
    """The format of the entry in ``entry_dir`` (by the container found there)."""
    return "hdf5" if (Path(entry_dir) / H5_FILE).is_file() else "zarr"


def open_writer(
    entry_dir: str | os.PathLike[str],
    fmt: Format,
    layout: EntryLayout,
    *,
    resume: bool = False,
    on_mismatch: OnMismatch = "raise",
) -> EntryWriter:
    """A writer of ``layout`` into entry directory ``entry_dir`` in format ``fmt``.

    ``resume``: continue an interrupted build left in ``entry_dir`` (see each backend).
    ``on_mismatch``: what a zarr resume does when the leftover has another layout ("raise",
    or "wipe" it with a warning and start afresh); an HDF5 resume always starts afresh then,
    saying why in ``restart_reason``.
    """
    entry_dir = Path(entry_dir)
    if fmt == "zarr":
        from stores.zarr_entry import ZarrWriter

        return ZarrWriter(
            entry_dir / ZARR_DIR,
            layout.arrays,
            layout.counts,
            layout.chunk_samples,
            layout.attrs,
            compressor=layout.compressor,  # type: ignore[arg-type]  # ZarrWriter validates it
            level=layout.level,
            resume=resume,
            on_mismatch=on_mismatch,
        )
    if fmt == "hdf5":
        from stores.h5_entry import H5Writer

        lengths = sorted(set(layout.chunk_samples.values()))
        if len(lengths) > 1:
            raise EntryWriteError(
                f"an HDF5 entry has one chunk length for every group; the layout for {entry_dir} has "
                f"{layout.chunk_samples} (plan it with plan_chunk_samples('hdf5', ...))"
            )
        return H5Writer(
            entry_dir / H5_FILE,
            layout.arrays,
            layout.counts,
            lengths[0] if lengths else 1,
            layout.attrs,
            compressor=layout.compressor,  # type: ignore[arg-type]  # H5Writer validates it
            level=layout.level,
            resume=resume,
        )
    raise EntryWriteError(f"entry format must be one of {list(FORMATS)}, got {fmt!r}")


def open_reader(
    entry_dir: str | os.PathLike[str],
    *,
    throttle: ThrottleProfile | ThrottleDevice | str | None = None,
) -> EntryReader:
    """The reader of the finished entry in ``entry_dir``, whichever backend wrote it.

    ``throttle`` names a slow-storage profile (``sdcard``, ``emmc``, ``ssd``) or device to
    read through the simulator (:mod:`stores.throttle`): for benchmarks and tests, never
    for real runs.
    """
    entry_dir = Path(entry_dir)
    if entry_format(entry_dir) == "hdf5":
        return open_container(entry_dir / H5_FILE, throttle=throttle)
    from stores.zarr_reader import ZarrReader

    # Not open_container: a missing data.zarr is a missing zarr entry, not an HDF5 file.
    return ZarrReader(entry_dir / ZARR_DIR, throttle=throttle)


def group_sample_bytes(arrays: Mapping[str, ArraySpec]) -> dict[str, int]:
    """Group -> bytes of one sample over all the group's arrays."""
    out: dict[str, int] = {}
    for name, spec in arrays.items():
        group = split_name(name)[0]
        out[group] = out.get(group, 0) + spec.sample_bytes
    return out
