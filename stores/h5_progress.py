"""The progress log beside an HDF5 entry being built: which rows are durably written, and their crc32s.

See :mod:`stores.h5_entry`, "Resume": after each row the writer appends one self-checking
line (``json<TAB>crc32(json)``); a resumed build replays the logged rows whose stored bytes
still match. The first line holds a digest of the layout, so a log of another layout is
never replayed.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py

from stores.h5_format import FORMAT
from stores.layout import ArraySpec

PROGRESS_FORMAT = "ondevice-tl-h5-progress/1"


@dataclass(frozen=True)
class Row:
    group: str
    index: int
    crcs: dict[str, int]


def progress_file(file: Path) -> Path:
    """The progress log beside an HDF5 entry file (``entry.h5`` -> ``entry.h5.progress``)."""
    return file.with_name(file.name + ".progress")


def partial_file(file: Path) -> Path:
    return file.with_name(file.name + ".partial")


def layout_id(
    specs: Mapping[str, ArraySpec],
    counts: Mapping[str, int],
    chunk_samples: int,
    compressor: str,
    level: int,
    checksum: bool,
    attrs_json: str,
) -> str:
    """A digest of everything that decides the file's bytes, library versions included."""
    doc = {
        "format": FORMAT,
        "arrays": {n: [list(s.sample_shape), s.dtype] for n, s in sorted(specs.items())},
        "counts": dict(sorted(counts.items())),
        "chunk_samples": chunk_samples,
        "codec": [compressor, level, checksum],
        "attrs": attrs_json,
        "h5py": h5py.version.version,
        "hdf5": h5py.version.hdf5_version,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def append_line(fd: int, record: dict[str, Any]) -> None:
    """Append one self-checking line: ``json<TAB>crc32(json)``; a torn last line fails its check."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    line = f"{text}\t{zlib.crc32(text.encode()):08x}\n".encode()
    view = memoryview(line)
    while view:
        view = view[os.write(fd, view) :]


def read_progress(path: Path) -> tuple[str | None, list[Row]]:
    """(layout id, logged rows) of a progress log; (None, []) if it is missing or its header is bad.

    Reading stops at the first line that is torn or fails its crc32 (what a kill mid-append leaves).
    """
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError:
        return None, []
    records: list[dict[str, Any]] = []
    for line in lines:
        text, _, crc = line.decode("utf-8", "replace").rpartition("\t")
        if not text or crc != f"{zlib.crc32(text.encode()):08x}":
            break
        try:
            records.append(json.loads(text))
        except ValueError:
            break
    if not records or records[0].get("format") != PROGRESS_FORMAT:
        return None, []
    rows = []
    for rec in records[1:]:
        try:
            rows.append(Row(str(rec["g"]), int(rec["i"]), {str(k): int(v) for k, v in rec["crc"].items()}))
        except (KeyError, TypeError, ValueError, AttributeError):
            break
    return str(records[0].get("layout")), rows
