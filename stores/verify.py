"""Integrity checks of committed catalog entries: the manifest's files, and every chunk of every container.

Why a separate pass: reading already refuses a corrupt chunk (zarr's crc32c, HDF5's fletcher32),
but only when training reaches it, possibly hours into a run. A week of data on an SD card
deserves a check that can run on its own (``cache verify``) and report *everything* wrong at
once, precisely enough for a repair step to rewrite just the bad chunks: each :class:`Problem`
names the entry, the file, and for chunks the container, array and chunk index.

The chunks are checked through the entry contract (:meth:`stores.entry.EntryReader.verify`),
whichever backend wrote them: each zarr chunk against its crc32c, each HDF5 chunk against the
crc32 recorded when it was written, and every chunk decoded. Every other payload file
(weights, results, zarr metadata, the HDF5 file as a whole) is checked against the sha256 its
manifest recorded at commit. :func:`damaged_files` is the quick form a catalog runs each time
an entry is used: the checksummed files a stage reads whole, so a flipped byte in a stored
model is never trained from (the bulk HDF5 file is left to ``cache verify``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from stores.entry import REPAIR_SUFFIX, Container, find_containers, open_container
from stores.errors import StoreError
from stores.manifest import BULK_FILES, file_sha256

ProblemKind = Literal["missing_file", "size_mismatch", "checksum_mismatch", "unexpected_file",
                      "unreadable_zarr", "unreadable_hdf5", "corrupt_chunk", "interrupted_repair"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an entry. ``file`` is relative to the entry directory.

    For ``corrupt_chunk`` problems ``container`` is the zarr hierarchy's directory or the HDF5
    file, relative to the entry ('' when the entry directory itself is the zarr group),
    ``array`` the full array name in it, ``chunk`` the chunk index along the sample axis and
    ``where`` where in ``file`` the chunk lies when the file holds more than it (HDF5).
    """

    entry: str
    kind: ProblemKind
    file: str
    message: str
    container: str | None = None
    array: str | None = None
    chunk: int | None = None
    where: str | None = None

    def describe(self) -> str:
        return f"entry {self.entry[:12]}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """The result of :meth:`stores.catalog.Catalog.verify`; ``ok`` when ``problems`` is empty.

    ``notes`` say what could not be checked as thoroughly as it should be (an HDF5 entry
    written before per-chunk checksums were recorded), or what a problem already explains;
    they do not make the entry damaged.
    """

    fingerprint: str
    path: Path
    problems: tuple[Problem, ...] = ()
    files_checked: int = 0
    chunks_checked: int = 0
    containers: tuple[str, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems

    def corrupt_chunks(self) -> dict[tuple[str, str], list[int]]:
        """(container, array) -> sorted bad chunk indices: the input a repair step needs."""
        out: dict[tuple[str, str], list[int]] = {}
        for p in self.problems:
            if p.kind == "corrupt_chunk" and p.container is not None and p.array is not None:
                out.setdefault((p.container, p.array), []).append(int(p.chunk or 0))
        return {k: sorted(v) for k, v in sorted(out.items())}

    def describe(self) -> str:
        head = (
            f"entry {self.fingerprint[:12]} at {self.path}: {self.files_checked} files, "
            f"{self.chunks_checked} chunks checked"
        )
        notes = "".join(f"\n  note: {n}" for n in self.notes)
        if self.ok:
            return head + ", no problems" + notes
        return (
            head
            + f", {len(self.problems)} problem(s):\n"
            + "\n".join(f"  - {p.message}" for p in self.problems)
            + notes
        )


def damaged_files(path: Path, files: dict[str, int], checksums: dict[str, str],
                  skip: frozenset[str] = BULK_FILES) -> list[str]:
    """The checksummed files of the entry at ``path`` (but ``skip``) that are missing, have another size
    than recorded, or no longer match their sha256: what must never be read as the entry's data."""
    bad = []
    for rel, digest in sorted(checksums.items()):
        if rel in skip:
            continue
        try:
            if (path / rel).stat().st_size != files.get(rel) or file_sha256(path / rel) != digest:
                bad.append(rel)
        except OSError:
            bad.append(rel)
    return bad


def verify_entry(
    fingerprint: str, path: Path, manifest_files: dict[str, int], payload: Iterable[tuple[str, int]],
    checksums: dict[str, str] | None = None,
) -> VerifyReport:
    """Check every chunk of every container in the entry at ``path`` (through the entry contract), then
    compare ``payload`` (the files actually there) with the manifest and its ``checksums``."""
    actual = dict(payload)
    checksums = checksums or {}
    chunks = _ChunkPass(fingerprint, path)
    containers = find_containers(path)
    for container in containers:
        chunks.check(container, checksums)
    problems: list[Problem] = []  # the files first, then the chunks
    notes = list(chunks.notes)
    for rel, size in sorted(manifest_files.items()):
        if rel not in actual:
            problems.append(
                Problem(fingerprint, "missing_file", rel, f"file {rel} is missing (manifest: {size} bytes)")
            )
        elif actual[rel] != size:
            problems.append(
                Problem(
                    fingerprint,
                    "size_mismatch",
                    rel,
                    f"file {rel} has {actual[rel]} bytes, the manifest recorded {size}",
                )
            )
    for rel, digest in sorted(checksums.items()):
        if actual.get(rel) != manifest_files.get(rel):
            continue  # missing or resized: said above
        try:
            found = file_sha256(path / rel)
        except OSError as exc:
            found = f"unreadable ({exc.strerror or exc})"
        if found == digest:
            continue
        mismatch = (
            f"file {rel} is damaged: its sha256 is {found[:16]}..., the manifest recorded {digest[:16]}..."
        )
        if rel in chunks.damaged_files:
            # The damaged chunks inside it explain this; a repair rewrites the file and checks it again.
            notes.append(mismatch + ", as expected with the damaged chunks it holds")
            continue
        message = mismatch + chunks.whole_file_hint(rel)
        problems.append(Problem(fingerprint, "checksum_mismatch", rel, message))
    for rel in sorted(set(actual) - set(manifest_files)):
        if REPAIR_SUFFIX in rel:
            message = (f"file {rel} is left by an interrupted `cache repair` (the entry's own files are "
                       "intact); running the repair again removes it")
            problems.append(Problem(fingerprint, "interrupted_repair", rel, message))
            continue
        message = f"file {rel} ({actual[rel]} bytes) is not in the manifest"
        problems.append(Problem(fingerprint, "unexpected_file", rel, message))
    problems.extend(chunks.problems)
    return VerifyReport(
        fingerprint, path, tuple(problems), len(actual), chunks.checked, tuple(c.rel for c in containers),
        tuple(notes),
    )


class _ChunkPass:
    """Every chunk of each container of one entry, checked through its reader's ``verify()``."""

    def __init__(self, fingerprint: str, path: Path) -> None:
        self.fingerprint = fingerprint
        self.path = path
        self.problems: list[Problem] = []
        self.notes: list[str] = []
        self.checked = 0
        self.damaged_files: set[str] = set()  # container files holding a damaged chunk (HDF5)
        self._unchecksummed: set[str] = set()  # containers with no per-chunk checksums
        self._h5_files: set[str] = set()  # HDF5 containers whose chunks were all read

    def check(self, container: Container, checksums: dict[str, str]) -> None:
        rel, fp = container.rel, self.fingerprint
        label = _label(container)
        try:
            reader = open_container(self.path / rel if rel else self.path)
        except (StoreError, OSError, ValueError) as exc:
            self._unreadable(container, f"{label} cannot be opened: {exc}")
            return
        try:
            groups = reader.groups
            self.checked += sum(reader.num_chunks(g) * _arrays_in(reader.arrays, g) for g in groups)
            bad = reader.verify()
            if reader.chunk_checksum is None:
                self._unchecksummed.add(rel)
                self.notes.append(self._unchecksummed_note(container, label, checksums))
        except (StoreError, OSError, ValueError) as exc:  # the structure failed mid-way, not one chunk
            self._unreadable(container, f"{label} cannot be read through: {exc}")
            return
        finally:
            reader.close()
        if container.fmt == "hdf5":
            self._h5_files.add(rel)
        for chunk in bad:
            file = _relative(chunk.file, self.path) if chunk.file is not None else rel
            if container.fmt == "hdf5":
                self.damaged_files.add(file)
            at = f" ({chunk.where})" if chunk.where else ""
            self.problems.append(
                Problem(
                    fp, "corrupt_chunk", file,
                    f"chunk {chunk.chunk} of array {chunk.array!r} in {label}{at}: {chunk.reason}",
                    container=rel, array=chunk.array, chunk=chunk.chunk, where=chunk.where,
                )
            )

    def _unreadable(self, container: Container, message: str) -> None:
        rel, fp = container.rel, self.fingerprint
        if container.fmt == "zarr":
            meta = f"{rel}/zarr.json" if rel else "zarr.json"
            self.problems.append(Problem(fp, "unreadable_zarr", meta, message, container=rel))
        else:
            self.problems.append(Problem(fp, "unreadable_hdf5", rel, message, container=rel))

    def _unchecksummed_note(self, container: Container, label: str, checksums: dict[str, str]) -> str:
        if container.fmt == "hdf5":
            whole = (
                "the file as a whole was checked against the sha256 recorded at commit"
                if container.rel in checksums
                else "and the manifest records no sha256 for the file, so a flipped byte that still decodes "
                "goes unnoticed"
            )
            return (
                f"{label} has no per-chunk checksums (written before they were recorded): its chunks were "
                f"only decoded (HDF5's fletcher32 checks each), {whole}; rebuild the entry "
                "(cache rm, then rerun) to record them"
            )
        return f"{label} has no crc32c codec: its chunks were only decoded, nothing checks their bytes"

    def whole_file_hint(self, rel: str) -> str:
        """What a whole-file checksum mismatch of ``rel`` means, given its chunks passed (or were not its)."""
        if rel not in self._h5_files:
            return ""
        if rel in self._unchecksummed:
            return (
                "; every chunk still decodes, and the file records no per-chunk checksums to say which "
                "holds the damage: remove the entry (cache rm) and rerun to rebuild it"
            )
        return (
            "; every chunk matches the crc32 recorded when it was written, so what differs is the "
            "file's HDF5 structure or attributes (damaged, or rewritten by another h5py/HDF5 version): "
            "remove the entry (cache rm) and rerun to rebuild it"
        )


def _label(container: Container) -> str:
    if container.fmt == "hdf5":
        return f"HDF5 file {container.rel}"
    return f"zarr hierarchy {container.rel or '(entry root)'}"


def _arrays_in(arrays: Iterable[str], group: str) -> int:
    return sum(1 for name in arrays if name.rpartition("/")[0] == group)


def _relative(file: Path, root: Path) -> str:
    try:
        return file.relative_to(root).as_posix()
    except ValueError:
        return file.as_posix()
