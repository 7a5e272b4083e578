"""A stored cache entry as a torch ``IterableDataset``: a user's own training loop over the cached features.

The runner's trainers read an entry through :class:`pipeline.ops.cache_read.StoredStream`, which
yields whole chunks to one consumer. A ``DataLoader`` with workers, or several distributed ranks,
each iterating that stream would each read the whole split. Here every sample goes to exactly one
(rank, worker) per epoch:

- The split is laid out as a sequence of samples: its chunks in order (shuffled per epoch when
  ``shuffle``) and each chunk's samples in order (permuted per chunk and epoch when ``shuffle``).
  The permutations are pure functions of (seed, epoch, chunk), so every process lays the
  sequence out alike without talking to the others.
- Rank ``r`` of ``W`` takes the ``r``-th of ``W`` contiguous, equal (to one sample) slices of that
  sequence, and its ``DataLoader`` worker ``w`` of ``K`` takes the ``w``-th of ``K`` slices of
  the rank's. A slice is read chunk by chunk (whole chunks: large sequential reads, as the
  trainers do) and, when shuffling, mixed within a window of chunks.

Samples are dequantized exactly as the recipe's ``dequantize`` stage does, and augmented (crop and
flip of the feature maps) exactly as a ``feature_aug`` stage does, drawn per sample from (seed,
epoch, sample id): the same sample gets the same move whichever rank, worker or batch it lands in.

The entry is held for reading (the catalog's shared lease, as the runner holds entries) from the
dataset's creation until :meth:`CacheDataset.close`, and by each worker while it iterates, so
eviction, ``cache rm`` and budget enforcement leave it alone while it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from stores.catalog import Catalog, Entry
from stores.errors import CorruptChunkError, EntryReadError, StoreError
from stores.manifest import FINGERPRINT, payload_files

from ..codec.features import DequantizedStream, decoded_spec
from ..errors import PipelineError, did_you_mean
from ..ops.batching import Batch, rechunk
from ..ops.cache_read import StoredStream
from ..ops.prefetch import prefetch
from ..ops.shuffle import window_shuffle
from .entry_ref import CacheEntryError, find_entry

if TYPE_CHECKING:
    from stores.leases import EntryUse

    from ..codec.moves import CropFlip
    from ..spec import Spec

__all__ = [
    "CacheDataset",
    "CacheEntryError",
    "CropDrawer",
    "DamagedEntryError",
    "Piece",
    "find_entry",
    "shard_pieces",
    "shard_range",
]

# Samples dequantized at a time when single samples are yielded (memory: this many feature maps).
_DECODE_BLOCK = 256


class DamagedEntryError(PipelineError, OSError):
    """A stored entry's files or chunks are not what its manifest and checksums say."""


class CropDrawer(Protocol):
    """What augmenting takes from a ``feature_aug`` stage: how to draw each batch's moves, and where."""

    @property
    def splits(self) -> tuple[str, ...]: ...

    def crop_drawer(self, h: int, w: int, prefix: int = 0) -> Callable[[Batch, int, int], CropFlip]: ...


# ------------------------------------------------------------------------------- finding an entry
def _fix_hint(fingerprint: str) -> str:
    short = fingerprint[:12]
    return (
        f"`python -m pipeline cache verify {short}` lists every problem; `python -m pipeline cache repair "
        f"{short}` recomputes the damaged chunks, or `cache rm {short}` and a rerun of the recipe rebuilds it"
    )


def _check_files(entry: Entry) -> None:
    """The manifest's files are all there, with their recorded sizes (a stat per file, no reading)."""
    try:
        actual = dict(payload_files(entry.path))
    except (StoreError, OSError) as exc:
        raise DamagedEntryError(f"cache entry {entry.fingerprint[:12]} at {entry.path}: {exc}") from None
    problems = []
    for rel, size in sorted(entry.files.items()):
        if rel not in actual:
            problems.append(f"file {rel} is missing")
        elif actual[rel] != size:
            problems.append(f"file {rel} has {actual[rel]} bytes, the manifest recorded {size}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise DamagedEntryError(
            f"cache entry {entry.fingerprint[:12]} at {entry.path} is damaged: {shown}. "
            + _fix_hint(entry.fingerprint)
        )


# ------------------------------------------------------------------------------------- sharding
def shard_range(num_samples: int, part: int, parts: int) -> tuple[int, int]:
    """``[start, stop)`` of the ``part``-th of ``parts`` contiguous slices of ``num_samples`` (sizes differ by
    at most one)."""
    return part * num_samples // parts, (part + 1) * num_samples // parts


@dataclass(frozen=True)
class Piece:
    """Samples of one chunk that a shard reads: ``positions`` within the chunk, in the order they are used."""

    chunk: int
    positions: np.ndarray


# What each seeded draw is for, first in its key, so no two draws share a stream.
_CHUNK_ORDER, _WITHIN_CHUNK, _WINDOW = 1, 2, 3


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in key])


def shard_pieces(
    num_samples: int, chunk_samples: int, start: int, stop: int, *, shuffle: bool, seed: int, epoch: int
) -> list[Piece]:
    """The chunks, and samples in each, of positions ``[start, stop)`` of the epoch's sample sequence.

    The sequence is the split's chunks (in a seeded per-epoch order when ``shuffle``), each chunk's
    samples (permuted per chunk when ``shuffle``) one after another, so disjoint ranges of it are
    disjoint sets of samples, and ranges covering ``[0, num_samples)`` cover the split.
    """
    n_chunks = -(-num_samples // chunk_samples) if num_samples else 0
    order = _rng(_CHUNK_ORDER, seed, epoch).permutation(n_chunks) if shuffle else np.arange(n_chunks)
    pieces: list[Piece] = []
    offset = 0
    for chunk in order:
        chunk = int(chunk)
        size = min(chunk_samples, num_samples - chunk * chunk_samples)
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi:
            within = _rng(_WITHIN_CHUNK, seed, epoch, chunk).permutation(size) if shuffle else np.arange(size)
            pieces.append(Piece(chunk, within[lo - offset : hi - offset]))
        offset += size
        if offset >= stop:
            break
    return pieces


# -------------------------------------------------------------------------------------- dataset
class CacheDataset(IterableDataset[tuple[torch.Tensor, ...]]):
    """Samples ``(x, y)`` (or batches of them) of one split of a stored cache entry; see the module docstring.

    Usually made by :func:`pipeline.cache_dataset`, which finds the entry from a recipe or a
    fingerprint prefix. ``x`` is float32 (C, H, W) feature maps, ``y`` int64 labels; with
    ``return_ids`` a third item holds each sample's id. With ``batch_size`` each item is a batch
    (its first dimension ``batch_size``; each worker's last batch may be shorter unless
    ``drop_last``): give the ``DataLoader`` ``batch_size=None``.

    ``rank``/``world_size`` default to ``torch.distributed``'s when it is initialised when the
    dataset is made, else a single process. Call :meth:`set_epoch` before each epoch for a new
    shuffle (and new augmentation draws); like ``DistributedSampler``, it reaches workers that
    the ``DataLoader`` starts per epoch (its default), not ``persistent_workers``.
    """

    def __init__(
        self,
        catalog: Catalog,
        fingerprint: str,
        split: str = "train",
        *,
        batch_size: int | None = None,
        augment: CropDrawer | None = None,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        return_ids: bool = False,
        window_chunks: int = 4,
        prefetch_chunks: int = 2,
    ) -> None:
        super().__init__()
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"batch_size: expected None (single samples) or an int >= 1, got {batch_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: expected an int >= 0, got {seed!r}")
        if window_chunks < 1 or prefetch_chunks < 0:
            raise ValueError(
                f"window_chunks must be >= 1 and prefetch_chunks >= 0, got {window_chunks}, {prefetch_chunks}"
            )
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.catalog = catalog
        self.fingerprint = validate_full(fingerprint)
        self.split = split
        self.batch_size = batch_size
        self.augment = augment
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.return_ids = return_ids
        self.window_chunks = window_chunks
        self.prefetch_chunks = prefetch_chunks
        self.epoch = 0
        self._lease: EntryUse | None = None
        self._lease = self._hold()
        try:
            entry = self._lease.entry
            _check_files(entry)
            self.entry_path = Path(entry.path)
            self.lineage: dict[str, Any] = dict(entry.lineage)
            stored = self._open_stored()
            self.spec: Spec = stored.spec
            split_spec = self.spec.splits.get(split)
            if split_spec is None:
                raise CacheEntryError(
                    f"cache entry {self.fingerprint[:12]} has no split {split!r}"
                    f"{did_you_mean(split, self.spec.splits)}; its splits: {', '.join(self.spec.splits)}"
                )
            self.chunk_samples = stored.reader.chunk_samples(split)
            stored.reader.close()  # each iteration opens its own (in its own process)
            self.decoded_spec = decoded_spec(self.spec) if self.spec.quantization is not None else self.spec
            self._check_fields(split_spec.fields)
        except BaseException:
            self.close()
            raise
        self.split_samples = split_spec.num_samples

    # ---------------------------------------------------------------------------- facts
    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch, all of its workers together (``drop_last`` drops up to
        ``batch_size - 1`` of them per worker)."""
        start, stop = shard_range(self.split_samples, self.rank, self.world_size)
        return stop - start

    @property
    def num_classes(self) -> int:
        return self.spec.num_classes

    @property
    def class_names(self) -> list[str] | None:
        return self.spec.class_names

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape of one sample's ``x``: (C, H, W) for feature maps."""
        return tuple(self.decoded_spec.splits[self.split].fields["x"].shape)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration lays out (shuffle order and augmentation draws depend on it)."""
        self.epoch = int(epoch)

    def __repr__(self) -> str:
        shard = f", rank {self.rank}/{self.world_size}" if self.world_size > 1 else ""
        return (
            f"CacheDataset({self.fingerprint[:12]}, split={self.split!r}, {self.split_samples} samples"
            f"{shard}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"augment={self.augment is not None})"
        )

    # --------------------------------------------------------------------------- holding
    def _hold(self) -> EntryUse:
        lease = self.catalog.try_use(self.fingerprint)
        if lease is None:
            raise CacheEntryError(
                f"cache entry {self.fingerprint[:12]} is no longer in store {self.catalog.root} (it was "
                "removed or evicted, or its build never finished); rebuild it by running its recipe"
            )
        return lease

    def close(self) -> None:
        """Let go of the entry (evictable again). Iterating afterwards holds it again while it reads."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    def __enter__(self) -> CacheDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # A worker started by spawn/forkserver holds the entry itself while it reads; the lease
        # (an open directory and its lock) belongs to the process that took it.
        state = dict(self.__dict__)
        state["_lease"] = None
        return state

    # --------------------------------------------------------------------------- reading
    def _open_stored(self) -> StoredStream:
        try:
            stored = StoredStream(self.entry_path, prefetch_depth=0, keep_in_memory_bytes=0)
        except KeyError:
            raise CacheEntryError(
                f"entry {self.fingerprint[:12]} ({self.lineage.get('recipe', '?')}:"
                f"{self.lineage.get('stage', '?')}) is not a cache of a stream: no stream spec in its "
                "attributes (a model or another kind of entry)"
            ) from None
        except (StoreError, OSError, ValueError) as exc:
            raise DamagedEntryError(
                f"cache entry {self.fingerprint[:12]} at {self.entry_path} cannot be opened: {exc}. "
                + _fix_hint(self.fingerprint)
            ) from None
        return stored

    def _check_fields(self, fields: Any) -> None:
        missing = [name for name in ("y",) if name not in fields]
        if "x" not in fields and "codes" not in fields:
            missing.insert(0, "x (or quantized codes)")
        if (self.augment is not None or self.return_ids) and "id" not in fields:
            missing.append("id (needed for augment and return_ids)")
        if missing:
            raise CacheEntryError(
                f"cache entry {self.fingerprint[:12]} split {self.split!r} lacks field(s) "
                f"{', '.join(missing)}; it has {', '.join(sorted(fields))}"
            )
        if self.augment is not None:
            shape = self.decoded_spec.splits[self.split].fields["x"].shape
            if len(shape) != 3:
                raise CacheEntryError(
                    f"augment moves (C, H, W) feature maps; cache entry {self.fingerprint[:12]} split "
                    f"{self.split!r} holds x of shape {tuple(shape)}"
                )

    def _read(self, stored: StoredStream, pieces: list[Piece]) -> Iterator[Batch]:
        """The pieces' samples, chunk by chunk, as stored (still quantized)."""
        for piece in pieces:
            try:
                arrays = stored.reader.read_chunk(self.split, piece.chunk)
            except (CorruptChunkError, EntryReadError, OSError) as exc:
                raise DamagedEntryError(
                    f"cache entry {self.fingerprint[:12]}, split {self.split!r}, chunk {piece.chunk}: {exc}. "
                    + _fix_hint(self.fingerprint)
                ) from None
            index = torch.from_numpy(piece.positions.astype(np.int64))
            yield {
                k: torch.index_select(torch.from_numpy(np.ascontiguousarray(v)), 0, index)
                for k, v in arrays.items()
            }

    def _decoder(self, stored: StoredStream) -> Callable[[Batch], Batch]:
        """Stored batch -> batch with float32 ``x``, moved as the augmentation draws it (if any)."""
        split, epoch, seed = self.split, self.epoch, self.seed
        draw = None
        if self.augment is not None and split in self.augment.splits:
            prefix, h, w = self.spec.feature_grid(self.feature_shape)
            draw = self.augment.crop_drawer(h, w, prefix)
        if self.spec.quantization is not None:
            dequantized = DequantizedStream(stored, self.decoded_spec)

            def decode(batch: Batch) -> Batch:
                crop = draw(batch, epoch, seed) if draw is not None else None
                return dequantized.decode(batch, crop)

            return decode

        def widen(batch: Batch) -> Batch:
            x = batch["x"].float()
            return {**batch, "x": draw(batch, epoch, seed).apply(x) if draw is not None else x}

        return widen

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank_start, rank_stop = shard_range(self.split_samples, self.rank, self.world_size)
        lo, hi = shard_range(rank_stop - rank_start, worker, workers)
        pieces = shard_pieces(
            self.split_samples, self.chunk_samples, rank_start + lo, rank_start + hi,
            shuffle=self.shuffle, seed=self.seed, epoch=self.epoch,
        )
        # Held while this iteration reads: in a worker process the dataset's own lease is the parent's.
        lease = self._hold()
        try:
            stored = self._open_stored()
            read = prefetch(self._read(stored, pieces), self.prefetch_chunks, name=f"cache-dataset-{worker}")
            try:
                yield from self._items(read, stored, worker)
            finally:
                read.close()  # type: ignore[attr-defined]  # stops the read-ahead thread now
                stored.close()
                stored.reader.close()
        finally:
            lease.release()

    def _items(
        self, batches: Iterator[Batch], stored: StoredStream, worker: int
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Stored batches -> shuffled within a window, re-batched, decoded: what the dataset yields."""
        out_size = self.batch_size or _DECODE_BLOCK
        if self.shuffle:
            window_seed = int(_rng(_WINDOW, self.seed, self.epoch, self.rank, worker).integers(2**62))
            batches = window_shuffle(
                batches, self.window_chunks * self.chunk_samples, seed=window_seed, out_size=out_size
            )
        decode = self._decoder(stored)
        for batch in rechunk(batches, out_size, drop_last=self.drop_last and self.batch_size is not None):
            batch = decode(batch)
            fields = (batch["x"], batch["y"], batch["id"]) if self.return_ids else (batch["x"], batch["y"])
            if self.batch_size is not None:
                yield fields
            else:
                yield from zip(*fields, strict=True)

def validate_full(fingerprint: str) -> str:
    if not isinstance(fingerprint, str) or not FINGERPRINT.fullmatch(fingerprint):
        raise CacheEntryError(
            f"expected a full entry fingerprint (see find_entry for prefixes), got {fingerprint!r}"
        )
    return fingerprint


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit rank/world_size, else torch.distributed's when initialised, else (0, 1)."""
    if rank is None and world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError(f"give rank and world_size together, got rank={rank!r}, world_size={world_size!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"expected 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size

