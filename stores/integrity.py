"""What verifying and repairing an entry's chunks report, shared by the entry contract and its backends.

Kept apart from :mod:`stores.entry` (which re-exports all of it) so that the backends
(:mod:`stores.zarr_reader`, :mod:`stores.h5_reader`, their rewriters) can use these types
without importing the module that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# What a chunk is checked against when verified: zarr's crc32c codec inside each chunk file, or
# the crc32 of each HDF5 chunk's stored bytes recorded in the file when it was written.
ChunkChecksum = Literal["crc32c", "crc32"]
# A file beside an HDF5 container while a repair rebuilds it; left only by an interrupted repair
# (the container itself is intact then), removed by the next one.
REPAIR_SUFFIX = ".repairing"


@dataclass(frozen=True)
class ChunkProblem:
    """One chunk that failed :meth:`EntryReader.verify`: array (full name), chunk index, why.

    ``file`` is the file holding the chunk (a zarr chunk file, or the HDF5 container) and
    ``where`` where in it, when the file holds more than the chunk (e.g. "bytes 4096..5119").
    """

    array: str
    chunk: int
    reason: str
    file: Path | None = None
    where: str | None = None

    def describe(self) -> str:
        at = f" ({self.where} of {self.file.name})" if self.where and self.file else ""
        return f"chunk {self.chunk} of array {self.array!r}{at}: {self.reason}"


@dataclass(frozen=True)
class Rewrite:
    """What :meth:`ChunkRewriter.rewrite_chunks` did.

    ``rewritten``: array -> chunk indices replaced; ``files``: the files written anew (a
    zarr chunk file each, or the whole HDF5 container); ``identical``: whether every
    replaced chunk's stored bytes equal the ones recorded when the entry was built (True:
    the entry is byte-identical to its build again; False: the recomputation differed in
    some bit; None: nothing recorded to compare with, as for zarr, whose crc32c lives
    inside the damaged chunk itself).
    """

    rewritten: dict[str, list[int]]
    files: tuple[Path, ...]
    identical: bool | None
