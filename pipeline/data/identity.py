"""Content identity of data: canonical JSON, arrays and files, never paths or mtimes.

A dataset's identity feeds the stage fingerprint, which decides whether cached
features, weights and results can be reused. It must therefore change whenever the
samples change and stay put when they do not: moving or copying a folder, touching
a file, or running on another machine must keep it. That rules out absolute paths
and modification times; only bytes (or, for large files, their size plus a sample
of their bytes) enter the hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError

#: Bytes read from each end of a large file for its content sample.
SAMPLE_BYTES = 64 * 1024
#: Files up to this size are hashed completely; larger ones are sampled at both ends.
FULL_HASH_LIMIT = 1024 * 1024
_CHUNK = 1024 * 1024


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal values always give equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def hash_json(obj: Any) -> str:
    """sha256 hex of the canonical JSON of ``obj`` (dict key order never matters)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def hash_array(array: np.ndarray) -> str:
    """sha256 hex of an array's dtype, shape and bytes (a reshape or a cast changes it)."""
    array = np.ascontiguousarray(array)
    h = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    h.update(array.data)
    return h.hexdigest()


def file_identity(path: str | Path, *, full_hash_limit: int = FULL_HASH_LIMIT,
                  sample_bytes: int = SAMPLE_BYTES) -> str:
    """``"<size>:<sha256>"`` of a file's content, independent of its name, location and mtime.

    Files up to ``full_hash_limit`` bytes are hashed completely. Larger files are
    identified by their size plus the hash of their first and last ``sample_bytes``:
    reading every byte of a multi-gigabyte dataset on every run would cost more than
    the cache saves. Compressed containers (gzip, zip, JPEG/PNG trailers) keep their
    checksum or end marker in the last bytes, so most edits still show up there.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        h = hashlib.sha256()
        with path.open("rb") as f:
            if size <= full_hash_limit:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                kind = "full"
            else:
                h.update(f.read(sample_bytes))
                f.seek(max(size - sample_bytes, 0))
                h.update(f.read(sample_bytes))
                kind = "sampled"
    except OSError as exc:
        raise DataError(f"{path}: cannot read file to establish its content identity: {exc}") from exc
    return f"{size}:{kind}:{h.hexdigest()}"


def files_identity(paths: Iterable[str | Path]) -> str:
    """Identity of an ordered list of files: their content identities, not their names."""
    return hash_json([file_identity(p) for p in paths])
