"""The one fast path into zarr internals: decoding a chunk's stored bytes without zarr's event loop.

A prefetcher reads a chunk's files on one thread and decodes them on another (see
:meth:`stores.zarr_reader.ZarrReader.decode_chunk`). zarr's public API decodes only as part
of a read (``arr[lo:hi]``, which does the I/O again) or through async codec calls (a trip
to zarr's event loop thread per chunk, on the cores training runs on). This module runs
the array's own codec chain, the one named in its ``zarr.json``, in reverse through each
codec's synchronous ``_decode_sync`` hook, so the crc32c check and the errors are those of
a stock zarr read.

What it depends on (everything else in this package uses public zarr API):

- ``zarr.Array.async_array.codec_pipeline`` exposing ``array_array_codecs``,
  ``array_bytes_codec`` and ``bytes_bytes_codecs`` (public attributes);
- ``async_array.metadata.get_chunk_spec(coords, config, prototype)`` (public);
- each codec's ``_decode_sync(buffer, chunk_spec)`` (private: the reason this module exists).

How it is checked: :func:`decoder` returns None when any hook is missing, and the reader
then falls back to a stock read (slower, same result). tests/stores/test_zarr_fast.py
fails if the fast path is unavailable with the installed zarr, or if it decodes anything
differently from a stock read, so a zarr upgrade that moves these hooks is noticed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype

_STAGES = ("array_array_codecs", "array_bytes_codec", "bytes_bytes_codecs")

Decoder = Callable[[Any, int], np.ndarray]


def decoder(arr: zarr.Array[Any]) -> Decoder | None:
    """``decode(stored_bytes, chunk_index) -> array`` for ``arr``'s chunks, or None if zarr lacks the hooks.

    Decode errors propagate as zarr raises them (crc32c mismatch: ValueError; damaged
    zstd/blosc frame: RuntimeError); the caller turns them into its own error.
    """
    inner = arr.async_array
    pipeline: Any = inner.codec_pipeline  # its three codec stages are attributes of the batched pipeline
    if not all(hasattr(pipeline, stage) for stage in _STAGES):
        return None
    if not hasattr(inner.metadata, "get_chunk_spec"):
        return None
    codecs = [*pipeline.array_array_codecs, pipeline.array_bytes_codec, *pipeline.bytes_bytes_codecs]
    if not all(hasattr(codec, "_decode_sync") for codec in codecs):
        return None
    ndim = arr.ndim

    def decode(buf: Any, index: int) -> np.ndarray:
        coords = (index,) + (0,) * (ndim - 1)
        spec = inner.metadata.get_chunk_spec(coords, inner.config, default_buffer_prototype())
        value: Any = buf
        for codec in reversed(pipeline.bytes_bytes_codecs):
            value = codec._decode_sync(value, spec)
        value = pipeline.array_bytes_codec._decode_sync(value, spec)
        for codec in reversed(pipeline.array_array_codecs):
            value = codec._decode_sync(value, spec)
        return np.asarray(value.as_numpy_array())

    return decode
