"""The zarr v3 form of a sample-chunked entry: codecs, metadata documents, chunk keys, durable writes.

Shared by :mod:`stores.zarr_entry` (writing) and :mod:`stores.zarr_reader` (reading), and
only public zarr API is used here. Why each choice is what it is: see :mod:`stores.zarr_entry`.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr
from zarr.abc.buffer import Buffer
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec
from zarr.storage import LocalStore as ZarrLocalStore
from zarr.storage import MemoryStore

from stores.durable import atomic_write_bytes
from stores.integrity import ChunkProblem as ChunkProblem  # shared with HDF5; importable here as before
from stores.layout import ArraySpec, split_name

Compressor = Literal["zstd", "blosc", "none"]
LEVELS = {"zstd": range(-7, 23), "blosc": range(0, 10), "none": range(-7, 23)}
META = "zarr.json"
# Errors zarr/numcodecs raise for an undecodable chunk: crc32c mismatch is ValueError,
# a damaged zstd/blosc frame RuntimeError, a truncated buffer TypeError/ValueError.
DECODE_ERRORS = (ValueError, RuntimeError, TypeError, OSError)
OnMismatch = Literal["raise", "wipe"]


def suggest_chunk_samples(specs: Iterable[ArraySpec], target_bytes: int = 1 << 20) -> int:
    """Samples per chunk so the widest array's chunks are about ``target_bytes`` (at least 1)."""
    widest = max((spec.sample_bytes for spec in specs), default=1)
    return max(1, target_bytes // widest)


def codecs(compressor: str, level: int, checksum: bool, itemsize: int) -> list[Any]:
    chain: list[Any] = []
    if compressor == "zstd":
        chain.append(ZstdCodec(level=level, checksum=False))  # crc32c below covers integrity
    elif compressor == "blosc":
        chain.append(BloscCodec(cname="zstd", clevel=level, shuffle="shuffle", typesize=itemsize))
    if checksum:
        chain.append(Crc32cCodec())
    return chain


def durable_put(path: Path, data: bytes | bytearray | memoryview, exclusive: bool = False) -> None:
    """A chunk or metadata file, written durably but without a directory fsync (see
    :func:`stores.durable.atomic_write_bytes`, ``sync_dir``): a chunk whose name did not survive
    a crash is missing and rewritten on resume, and the catalog fsyncs the tree at commit."""
    atomic_write_bytes(path, data, sync_dir=False, exclusive=exclusive, make_parents=True)


class DurableLocalStore(ZarrLocalStore):
    """zarr's LocalStore whose writes are fsynced before they are renamed into place.

    Only writing differs (see :func:`durable_put`); reading, listing and deleting are
    stock. A store wrapper rather than post-write fsyncs because only the writer knows
    the temp file before it becomes visible under its final name. It overrides the
    public ``set``/``set_if_not_exists``/``set_sync`` of zarr's store API only, and
    otherwise behaves as stock ``LocalStore`` does (zarr's own store conformance suite,
    ``zarr.testing.store.StoreTests``, runs over it in tests/stores/test_durable_store.py):
    a write opens a store not yet opened, and a read-only store refuses it with zarr's
    own error.
    """

    def _before_write(self, value: Buffer) -> None:
        self._check_writable()  # zarr's ValueError ("store was opened in read-only mode ...")
        if not isinstance(value, Buffer):
            raise TypeError(
                f"DurableLocalStore.set(): `value` must be a Buffer instance, got {type(value)} ({self})"
            )

    def set_sync(self, key: str, value: Buffer) -> None:
        self._ensure_open_sync()
        self._before_write(value)
        durable_put(self.root / key, value.as_buffer_like())

    async def set(self, key: str, value: Buffer) -> None:
        if not self._is_open:
            await self._open()
        self._before_write(value)
        await asyncio.to_thread(durable_put, self.root / key, value.as_buffer_like())

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if not self._is_open:
            await self._open()
        self._before_write(value)
        try:
            await asyncio.to_thread(durable_put, self.root / key, value.as_buffer_like(), True)
        except FileExistsError:
            pass


def chunk_key(arr: Any, index: int) -> str:
    """Store key (relative to the array) of chunk ``index`` along the sample axis, e.g. 'c/3/0/0'."""
    return str(arr.metadata.encode_chunk_key((index,) + (0,) * (arr.ndim - 1)))


def chunk_index(arr: Any, rel: str) -> int | None:
    """Inverse of :func:`chunk_key` for this array's chunk grid; None if ``rel`` is not one of its chunks."""
    parts = rel.split("/")
    if len(parts) != arr.ndim + 1 or parts[0] != "c" or any(p != "0" for p in parts[2:]):
        return None
    if not parts[1].isdigit() or (len(parts[1]) > 1 and parts[1].startswith("0")):
        return None
    index = int(parts[1])
    n, c = int(arr.shape[0]), int(arr.chunks[0])
    return index if index < -(-n // c) else None


def metadata_docs(
    attrs: dict[str, Any],
    specs: Mapping[str, ArraySpec],
    num_samples: Mapping[str, int],
    chunk_samples: Mapping[str, int],
    compressor: str,
    level: int,
    checksum: bool,
) -> dict[str, bytes]:
    """The exact zarr.json documents (key -> bytes) of the requested hierarchy, built in memory.

    Generating them with zarr itself (rather than hand-written JSON) keeps them identical
    to what zarr would write, and gives resume a complete description to compare against.
    """
    documents: dict[str, Buffer] = {}
    store = MemoryStore(documents)
    root = zarr.open_group(store=store, mode="w-", zarr_format=3, attributes=attrs)
    for name, spec in sorted(specs.items()):
        root.create_array(
            name,
            shape=(num_samples[split_name(name)[0]], *spec.sample_shape),
            dtype=spec.dtype,
            chunks=(chunk_samples[split_name(name)[0]], *spec.sample_shape),
            serializer=BytesCodec(),
            compressors=codecs(compressor, level, checksum, np.dtype(spec.dtype).itemsize),
            fill_value=0,
            config={"write_empty_chunks": True},
        )
    docs = {key: bytes(value.to_bytes()) for key, value in documents.items()}
    if any(not key.endswith(META) for key in docs):
        raise AssertionError(f"unexpected non-metadata keys from zarr: {sorted(docs)}")
    return docs


def describe_difference(key: str, on_disk: Any, wanted: Any) -> str:
    node = key[: -len(META)].rstrip("/") or "(root group)"
    if isinstance(on_disk, dict) and isinstance(wanted, dict):
        for field in sorted(set(on_disk) | set(wanted)):
            if on_disk.get(field) != wanted.get(field):
                disk_value, wanted_value = on_disk.get(field), wanted.get(field)
                return f"{node!r}: {field} is {disk_value!r} on disk but {wanted_value!r} was requested"
    return f"{node!r}: metadata on disk is {on_disk!r}, requested {wanted!r}"


def array_members(group: Any) -> dict[str, Any]:
    """Full name -> zarr.Array for every array under ``group``."""
    with warnings.catch_warnings():
        # A catalog entry keeps its manifest and bookkeeping files beside the hierarchy.
        warnings.filterwarnings("ignore", message="Object at .* is not recognized as a component")
        members = group.members(max_depth=None)
    return {name: node for name, node in members if isinstance(node, zarr.Array)}


def check_chunk(root: Path, name: str, arr: Any, index: int, n: int, c: int) -> str | None:
    """None if chunk ``index`` of array ``name`` under ``root`` exists and decodes, else the reason."""
    key = chunk_key(arr, index)
    if not (root / name / key).is_file():
        return f"chunk file {name}/{key} is missing"
    try:
        arr[index * c : min((index + 1) * c, n)]
    except DECODE_ERRORS as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
