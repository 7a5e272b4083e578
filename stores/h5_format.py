"""The HDF5 form of a sample-chunked entry: file name, root attributes, and what a read error looks like.

Shared by :mod:`stores.h5_entry` (writing) and :mod:`stores.h5_reader` (reading); see
:mod:`stores.h5_entry` for the layout and why it is so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

Compressor = Literal["gzip", "lzf", "none"]
COMPRESSORS = ("gzip", "lzf", "none")
ENTRY_FILENAME = "entry.h5"
# /2 records the crc32 of every stored chunk (stores.h5_chunks); /1 files (written before that)
# are still read, and verify says they have no per-chunk checksums.
FORMAT = "ondevice-tl-h5-entry/2"
FORMAT_V1 = "ondevice-tl-h5-entry/1"
READABLE_FORMATS = (FORMAT, FORMAT_V1)
ATTR_FORMAT = "ondevice_tl_format"
ATTR_JSON = "ondevice_tl_attrs"
ATTR_COMPLETE = "ondevice_tl_complete"
# h5py/HDF5 report a failed fletcher32 check or an undecodable gzip/lzf stream as OSError;
# numpy/h5py conversion problems surface as ValueError/RuntimeError/TypeError.
DECODE_ERRORS = (OSError, ValueError, RuntimeError, TypeError)


def entry_file(path: str | os.PathLike[str]) -> Path:
    """The HDF5 file of an entry: ``path`` itself, or ``path/entry.h5`` if ``path`` is a directory."""
    path = Path(path)
    return path / ENTRY_FILENAME if path.is_dir() else path
