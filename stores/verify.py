"""Integrity checks of committed catalog entries: the manifest's files, and every zarr chunk.

Why a separate pass: reading already refuses a corrupt chunk (crc32c, see
:mod:`stores.zarr_entry`), but only when training reaches it, possibly hours into a
run. A week of data on an SD card deserves a check that can run on its own (``cache
verify``) and report *everything* wrong at once, precisely enough for a repair step to
rewrite just the bad chunks: each :class:`Problem` names the entry, the file, and for
chunks the zarr hierarchy, array and chunk index.

Every other payload file (weights, results, zarr metadata, an HDF5 file) is checked against the
sha256 its manifest recorded at commit. :func:`damaged_files` is the quick form a catalog runs
each time an entry is used: the checksummed files a stage reads whole, so a flipped byte in a
stored model is never trained from (the bulk HDF5 file is left to ``cache verify``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from stores.errors import StoreError
from stores.manifest import BULK_FILES, file_sha256

ProblemKind = Literal["missing_file", "size_mismatch", "checksum_mismatch", "unexpected_file",
                      "unreadable_zarr", "corrupt_chunk"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an entry. ``file`` is relative to the entry directory.

    For ``corrupt_chunk`` problems ``hierarchy`` is the zarr group's directory relative to
    the entry ('' when the entry itself is the group), ``array`` the full array name in it
    and ``chunk`` the chunk index along the sample axis.
    """

    entry: str
    kind: ProblemKind
    file: str
    message: str
    hierarchy: str | None = None
    array: str | None = None
    chunk: int | None = None

    def describe(self) -> str:
        return f"entry {self.entry[:12]}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """The result of :meth:`stores.catalog.Catalog.verify`; ``ok`` when ``problems`` is empty."""

    fingerprint: str
    path: Path
    problems: tuple[Problem, ...] = ()
    files_checked: int = 0
    chunks_checked: int = 0
    hierarchies: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems

    def corrupt_chunks(self) -> dict[tuple[str, str], list[int]]:
        """(hierarchy, array) -> sorted bad chunk indices: the input a repair step needs."""
        out: dict[tuple[str, str], list[int]] = {}
        for p in self.problems:
            if p.kind == "corrupt_chunk" and p.hierarchy is not None and p.array is not None:
                out.setdefault((p.hierarchy, p.array), []).append(int(p.chunk or 0))
        return {k: sorted(v) for k, v in sorted(out.items())}

    def describe(self) -> str:
        head = (
            f"entry {self.fingerprint[:12]} at {self.path}: {self.files_checked} files, "
            f"{self.chunks_checked} chunks checked"
        )
        if self.ok:
            return head + ", no problems"
        return (
            head
            + f", {len(self.problems)} problem(s):\n"
            + "\n".join(f"  - {p.message}" for p in self.problems)
        )


def zarr_hierarchies(root: Path) -> list[str]:
    """Relative paths ('' = root) of the outermost zarr nodes under ``root``, sorted.

    Nodes nested in one of them belong to it and are not listed. A node whose zarr.json
    is not a readable group is listed too, so verify reports it instead of skipping it.
    """
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        if "zarr.json" in filenames:
            rel = Path(dirpath).relative_to(root).as_posix()
            found.append("" if rel == "." else rel)
            dirnames.clear()  # nested nodes belong to this hierarchy
    return sorted(found)


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
    """Compare ``payload`` (the files actually there) with the manifest and its ``checksums``, then check
    every zarr chunk."""
    problems: list[Problem] = []
    actual = dict(payload)
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
    for rel, digest in sorted((checksums or {}).items()):
        if actual.get(rel) != manifest_files.get(rel):
            continue  # missing or resized: said above
        try:
            found = file_sha256(path / rel)
        except OSError as exc:
            found = f"unreadable ({exc.strerror or exc})"
        if found != digest:
            problems.append(
                Problem(
                    fingerprint,
                    "checksum_mismatch",
                    rel,
                    f"file {rel} is damaged: its sha256 is {found[:16]}..., the manifest recorded "
                    f"{digest[:16]}...",
                )
            )
    for rel in sorted(set(actual) - set(manifest_files)):
        message = f"file {rel} ({actual[rel]} bytes) is not in the manifest"
        problems.append(Problem(fingerprint, "unexpected_file", rel, message))
    # zarr only when there is a hierarchy to check: the catalog (and recipe
    # validation through it) must import without zarr installed.
    from stores.zarr_entry import ZarrReader

    chunks = 0
    hierarchies = zarr_hierarchies(path)
    for hier in hierarchies:
        where = path / hier if hier else path
        label = hier or "(entry root)"
        try:
            reader = ZarrReader(where)
        except (StoreError, OSError, ValueError) as exc:
            problems.append(
                Problem(
                    fingerprint,
                    "unreadable_zarr",
                    f"{hier}/zarr.json" if hier else "zarr.json",
                    f"zarr hierarchy {label} cannot be opened: {exc}",
                    hierarchy=hier,
                )
            )
            continue
        for name in reader.arrays:
            chunks += reader.num_chunks(name.rpartition("/")[0])
        for bad in reader.verify():
            rel = reader.chunk_key(bad.array, bad.chunk)
            problems.append(
                Problem(
                    fingerprint,
                    "corrupt_chunk",
                    f"{hier}/{rel}" if hier else rel,
                    f"chunk {bad.chunk} of array {bad.array!r} in zarr hierarchy {label}: {bad.reason}",
                    hierarchy=hier,
                    array=bad.array,
                    chunk=bad.chunk,
                )
            )
    return VerifyReport(fingerprint, path, tuple(problems), len(actual), chunks, tuple(hierarchies))
