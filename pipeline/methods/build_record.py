"""A stored training result's content, and the record of the build that made it, in two files.

One fingerprint must mean one content: a result trained here, killed and resumed, or beside a busy
process holds the same bytes. What a user also wants to see (how long the epochs took, whether the
build resumed, on which device it ran, what the allocator measured) is a fact about one build, not a
function of the inputs, so it goes to ``build.json`` beside the content file. Both are checksummed
in the entry's manifest like every stored file; only the content file is promised identical across
builds (docs/reference.md, "What a stored result promises").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stores.durable import atomic_write_bytes

BUILD_FILE = "build.json"

# Fields that are facts about one build, whatever their value: the device (never part of a
# fingerprint), whether a CUDA graph ran, where an interrupted build resumed.
BUILD_FIELDS = frozenset({"device", "cuda_graph", "resumed_after_epochs", "memory_measured_by"})


def is_build_fact(key: str) -> bool:
    """Whether ``key`` names a measurement of the build (a time, a measured size), not content."""
    return key in BUILD_FIELDS or "seconds" in key or key.endswith("_measured")


def _part(value: Any, build: bool) -> Any:
    """The content (``build=False``) or build (``True``) part of one value; records in lists split too."""
    if isinstance(value, Mapping):
        return {k: _part(v, build) for k, v in value.items()
                if is_build_fact(k) == build or (isinstance(v, (Mapping, list)) and _has_split(v))}
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        return [_part(v, build) for v in value]
    return value


def _has_split(value: Any) -> bool:
    if isinstance(value, Mapping):
        return any(is_build_fact(k) or _has_split(v) for k, v in value.items())
    return isinstance(value, list) and any(isinstance(v, Mapping) and _has_split(v) for v in value)


def split(record: Any) -> tuple[Any, Any]:
    """(content, build facts) of a JSON-able record: dicts by key, lists of dicts record by record."""
    return _part(record, False), _part(record, True)


def merge(content: Any, build: Any) -> Any:
    """The record :func:`split` was given, from its two parts."""
    if isinstance(content, Mapping) and isinstance(build, Mapping):
        out = dict(content)
        for key, value in build.items():
            out[key] = merge(out[key], value) if key in out else value
        return out
    if isinstance(content, list) and isinstance(build, list) and len(content) == len(build):
        return [merge(c, b) for c, b in zip(content, build, strict=True)]
    return content


def write(directory: Path, name: str, record: Any) -> None:
    """``record``'s content to ``directory/name``, its build facts to ``directory/build.json``."""
    content, build = split(record)
    atomic_write_bytes(directory / name, json.dumps(content, default=float).encode())
    atomic_write_bytes(directory / BUILD_FILE, json.dumps(build, default=float).encode())


def read(directory: Path, name: str) -> Any:
    """The record :func:`write` stored (the content alone where an older entry has no build file)."""
    content = json.loads((directory / name).read_text())
    build_file = directory / BUILD_FILE
    return merge(content, json.loads(build_file.read_text())) if build_file.is_file() else content
