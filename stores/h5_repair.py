"""Replace damaged chunks of a finished HDF5 entry: the HDF5 :class:`~stores.entry.ChunkRewriter`.

Why the whole file is rewritten, when only a few chunks are recomputed: an HDF5 file has no
journal. Writing a chunk in place changes the file's chunk index (a recomputed chunk may
compress to another size, so HDF5 moves it), and a crash in the middle of that leaves a file
HDF5 may no longer open, losing every chunk, not just the damaged one. So the repair builds
a new file beside the old one (``entry.h5.repairing``): row by row in the order the entry
was built (recorded with its checksums, :mod:`stores.h5_chunks`), each chunk copied as its
stored bytes, after checking them against their recorded crc32, except the damaged ones,
which are encoded from the recomputed samples. That file is then fsynced and renamed over
the old one: a reader, and a crash, sees the old file or the new one, never a mix, and an
interrupted repair leaves only the ``.repairing`` file behind, removed by the next repair.

Only the damaged chunks' samples are recomputed (that is the expensive part: decode,
frozen forward, quantize); the copy is sequential I/O of stored bytes, nothing decoded or
recompressed. It needs the file's size again in free space while it runs. Because the
rows are replayed in their recorded order by the same writer that built the entry, a
repair whose recomputed chunks are bit-identical to the originals gives a file
byte-identical to the one built (``Rewrite.identical``): the manifest's sha256 matches
again. A file written before chunk checksums were recorded (format /1) is rewritten in the
order its chunks lie in the file, and gains the record: its manifest must be resealed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from stores.durable import fsync_dir, fsync_file
from stores.errors import EntryWriteError
from stores.h5_chunks import ChunkDecoder, crc32
from stores.h5_entry import H5Writer
from stores.h5_format import DECODE_ERRORS, Compressor, entry_file
from stores.h5_progress import progress_file
from stores.h5_reader import H5Reader
from stores.integrity import REPAIR_SUFFIX, Rewrite
from stores.layout import check_chunk_samples, did_you_mean, split_name

Row = tuple[str, int]


def repair_file(file: Path) -> Path:
    """Where a repair builds the new file beside ``file`` (``entry.h5`` -> ``entry.h5.repairing``)."""
    return file.with_name(file.name + REPAIR_SUFFIX)


class H5ChunkRewriter:
    """Rewrites an HDF5 entry file with some chunks recomputed (see the module docstring)."""

    KIND = "HDF5"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.file = entry_file(self.path)

    def rewrite_chunks(self, chunks: Mapping[str, Mapping[int, np.ndarray]]) -> Rewrite:
        target = repair_file(self.file)
        for leftover in (target, progress_file(target)):  # an interrupted repair's; the entry is intact
            leftover.unlink(missing_ok=True)
        reader = H5Reader(self.file)
        try:
            samples = self._check(reader, chunks)
            recorded = reader.record.crc32 if reader.record is not None else None
            identical: bool | None = recorded is not None
            writer = self._writer(reader, target)
            try:
                for group, index in self._rows(reader):
                    fresh = samples.get((group, index), {})
                    stored = {
                        name: self._stored(reader, name, index)
                        for name in reader.arrays
                        if split_name(name)[0] == group and name not in fresh
                    }
                    crcs = writer.copy_row(group, stored, fresh)
                    if recorded is not None and any(crcs[n] != int(recorded[n][index]) for n in fresh):
                        identical = False
                writer.close()
            except BaseException:
                writer.abort()
                for leftover in (target, progress_file(target)):
                    leftover.unlink(missing_ok=True)
                raise
        finally:
            reader.close()
        fsync_file(target)  # the writer closed it without fsync: the rename must not outrun its bytes
        os.replace(target, self.file)
        fsync_dir(self.file.parent)
        rewritten: dict[str, list[int]] = {}
        for (_group, index), names in sorted(samples.items()):
            for name in names:
                rewritten.setdefault(name, []).append(index)
        return Rewrite({n: sorted(v) for n, v in sorted(rewritten.items())}, (self.file,), identical)

    # ------------------------------------------------------------------------------ the plan

    def _check(
        self, reader: H5Reader, chunks: Mapping[str, Mapping[int, np.ndarray]]
    ) -> dict[Row, dict[str, np.ndarray]]:
        """Every recomputed chunk checked (array, index, shape, dtype) before anything is written, by row."""
        names = sorted(reader.arrays)
        out: dict[Row, dict[str, np.ndarray]] = {}
        for array, by_index in sorted(chunks.items()):
            if array not in reader.arrays:
                raise EntryWriteError(
                    f"no array {array!r} in HDF5 entry {self.file}; arrays: {names}"
                    + did_you_mean(array, names)
                )
            group, spec = split_name(array)[0], reader.arrays[array]
            n, c = reader.num_samples(group), reader.chunk_samples(group)
            for index, data in sorted(by_index.items()):
                check_chunk_samples(self.file, array, index, data, n, c, spec.sample_shape, spec.dtype)
                out.setdefault((group, int(index)), {})[array] = np.asarray(data)
        return out

    def _rows(self, reader: H5Reader) -> list[Row]:
        """Every row (group, chunk index) once, in the order the entry was built.

        From the record when there is one; a file without (format /1) in the order its
        chunks lie in the file, which is the order HDF5 wrote them (rows it cannot place go
        last, in group and chunk order).
        """
        every = [(g, i) for g in reader.groups for i in range(reader.num_chunks(g))]
        if reader.record is not None and sorted(reader.record.rows) == sorted(every):
            return list(reader.record.rows)
        placed: list[tuple[bool, int, Row]] = []
        for group, index in every:
            offsets = []
            for name in reader.arrays:
                if split_name(name)[0] == group:
                    try:
                        stored = reader.stored_chunk(name, index)
                    except DECODE_ERRORS:
                        stored = None
                    if stored is not None:
                        offsets.append(stored[2])
            placed.append((not offsets, min(offsets, default=0), (group, index)))
        return [row for _missing, _offset, row in sorted(placed)]

    def _stored(self, reader: H5Reader, name: str, index: int) -> tuple[int, bytes]:
        """The stored bytes of a chunk to copy, after checking them: a damaged chunk is never copied."""
        try:
            stored = reader.stored_chunk(name, index)
        except DECODE_ERRORS as exc:
            stored, why = None, f"its stored bytes cannot be read ({type(exc).__name__}: {exc})"
        else:
            why = "it is missing"
        if stored is not None:
            mask, raw = stored[0], stored[1]
            recorded = reader.record.crc32.get(name) if reader.record is not None else None
            if recorded is not None:
                if index < len(recorded) and crc32(raw) == int(recorded[index]):
                    return mask, raw
                why = "its stored bytes do not match the crc32 recorded when it was written"
            else:
                group = split_name(name)[0]
                c = reader.chunk_samples(group)
                count = min(c, reader.num_samples(group) - index * c)
                decode = ChunkDecoder(reader._dataset(name))
                try:
                    decode(raw, mask, count)
                    return mask, raw
                except DECODE_ERRORS as exc:
                    why = f"it does not decode ({type(exc).__name__}: {exc})"
                finally:
                    decode.close()
        raise EntryWriteError(
            f"chunk {index} of array {name!r} in HDF5 entry {self.file} is damaged too ({why}), and no "
            "recomputed samples were given for it; verify the entry and repair every damaged chunk at once"
        )

    def _writer(self, reader: H5Reader, target: Path) -> H5Writer:
        """A writer of ``target`` with the old file's arrays, counts, chunking, filters and attributes."""
        groups = reader.groups
        chunk = reader.chunk_samples(groups[0]) if groups else 1
        first = reader._dataset(sorted(reader.arrays)[0])
        compression = first.compression
        compressor: Compressor
        if compression in ("gzip", "lzf"):
            compressor = compression
        elif compression is None:
            compressor = "none"
        else:
            raise EntryWriteError(
                f"HDF5 entry {self.file} is compressed with {compression!r}, which this version does not "
                "write; remove the entry and rebuild it"
            )
        level = int(first.compression_opts) if compressor == "gzip" else 4
        return H5Writer(
            target,
            reader.arrays,
            {g: reader.num_samples(g) for g in groups},
            chunk,
            reader.attrs,
            compressor=compressor,
            level=level,
            checksum=bool(first.fletcher32),
        )
