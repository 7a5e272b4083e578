"""Lazy, indexable sets of labelled images with a content identity.

A ``SampleSet`` is what every source returns and what splits and decoders consume.
It holds only what planning needs up front (labels, class names, size) and reads
pixels on demand through ``load(idx)``, so indexing a large dataset is cheap and a
cached downstream result can be reused without decoding a single image. Loading has
two halves a caller may schedule apart: ``read`` (storage: file bytes) and ``decode``
(CPU: pixels), ``load(idx) == decode(read(idx))``.

Images come back as uint8 HWC (C = 1 or 3): one ``(N, H, W, C)`` array when the
requested samples share a shape (the fast, batched path), else a list of arrays.

Identity is content: it combines the identity of the pixels (in order) with the
labels and class names, so a relabelled subset or a different few-shot draw has a
different identity while a moved copy of the same files has the same one.

Each sample also has a content key of its own (:meth:`SampleSet.sample_keys`): a digest of that
sample's bytes alone, whatever else the set holds, so that what is decided per sample (its split)
does not change when other samples come or go.
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import DataError
from .identity import hash_array, hash_json

#: A batch of images: (N, H, W, C) uint8 when all share a shape, else a list of (H, W, C) uint8 arrays.
# What ``read`` returns: encoded bytes per sample, indices to generate, or the stored pixels.
Raw = Sequence[Any] | np.ndarray
Images = np.ndarray | list[np.ndarray]
#: A sample's content key: 16 bytes of a digest of its content (numpy dtype ``S16``).
KEY_DTYPE = np.dtype("S16")


def content_key(data: bytes) -> bytes:
    """The 16-byte content key of one sample's bytes."""
    return hashlib.blake2b(data, digest_size=16).digest()


def keys_array(keys: Sequence[bytes]) -> np.ndarray:
    out = np.array(list(keys), dtype=KEY_DTYPE) if len(keys) else np.zeros(0, KEY_DTYPE)
    out.setflags(write=False)
    return out


def as_hwc(image: np.ndarray, where: str) -> np.ndarray:
    """One image as uint8 (H, W, C) with C in {1, 3}; grayscale (H, W) gains a channel axis."""
    image = np.asarray(image)
    if image.ndim == 2:
        image = image[:, :, None]
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in (1, 3):
        raise DataError(f"{where}: expected a uint8 image of shape (H, W), (H, W, 1) or (H, W, 3), "
                        f"got dtype {image.dtype} shape {image.shape}")
    return image


def as_batch(images: Sequence[np.ndarray]) -> Images:
    """Stack images into one (N, H, W, C) array when they share a shape, else keep a list."""
    if len(images) > 0 and all(im.shape == images[0].shape for im in images):
        return np.stack(images)
    if len(images) == 0:
        return np.zeros((0, 1, 1, 1), np.uint8)
    return list(images)


def concat_images(parts: Sequence[Images]) -> Images:
    """Batches of images joined in order: one array when every image shares a shape, else a list."""
    arrays = [p for p in parts if isinstance(p, np.ndarray) and len(p)]
    if arrays and len(arrays) == sum(1 for p in parts if len(p)) and all(
        p.shape[1:] == arrays[0].shape[1:] for p in arrays
    ):
        return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    return as_batch([image for p in parts for image in p])


def _as_index(idx: np.ndarray | Sequence[int], size: int, where: str) -> np.ndarray:
    """Validate sample indices (integers in [0, size)) and return them as int64."""
    arr = np.asarray(idx)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise DataError(f"{where}: expected a 1-D array of integer sample indices, got dtype {arr.dtype} "
                        f"shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() >= size):
        bad = int(arr[(arr < 0) | (arr >= size)][0])
        raise DataError(f"{where}: sample index {bad} out of range; valid indices are 0..{size - 1}")
    return arr


class SampleSet(ABC):
    """Base of all sample sets: labels and class names in memory, pixels on demand.

    Subclasses implement ``_read`` (one raw item per valid index, sliceable by sample),
    ``_decode`` when the raw items are not pixels yet (plus ``decodes`` = True when that is
    real CPU work), and ``_content_identity`` (identity of the pixels in order); labels,
    class names, validation, subsets and the full identity are handled here once.
    """

    #: True when :meth:`decode` does real CPU work (image decoding, generation), worth spreading.
    decodes: bool = False

    def __init__(self, labels: np.ndarray | Sequence[int], class_names: Sequence[str], *, name: str) -> None:
        self.name = name
        self.class_names: list[str] = [str(c) for c in class_names]
        labels = np.asarray(labels)
        if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
            raise DataError(f"{name}: labels must be a 1-D integer array, got dtype {labels.dtype} "
                            f"shape {labels.shape}")
        labels = labels.astype(np.int64)
        if labels.size and (labels.min() < 0 or labels.max() >= len(self.class_names)):
            bad = int(labels[(labels < 0) | (labels >= len(self.class_names))][0])
            raise DataError(f"{name}: label {bad} out of range for {len(self.class_names)} classes "
                            f"(expected 0..{len(self.class_names) - 1})")
        labels.setflags(write=False)
        self._labels = labels
        self._identity: str | None = None
        self._keys: np.ndarray | None = None

    @property
    def labels(self) -> np.ndarray:
        """int64 class index per sample (read-only)."""
        return self._labels

    def __len__(self) -> int:
        return len(self._labels)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {len(self)} samples, {len(self.class_names)} classes)"

    def load(self, idx: np.ndarray | Sequence[int]) -> Images:
        """Pixels of samples ``idx``, uint8 HWC: one (N, H, W, C) array if they share a shape, else a list."""
        return self.decode(self.read(idx))

    # Loading in two halves, for callers that schedule storage and CPU work apart (the decode
    # stage reads files ahead on a background thread and decodes them on every core between
    # compute steps): ``decode(read(idx))`` is ``load(idx)``.
    def read(self, idx: np.ndarray | Sequence[int]) -> Raw:
        """The storage half of loading samples ``idx``: one raw item per sample, sliceable by sample."""
        return self._read(_as_index(idx, len(self), self.name))

    def decode(self, raw: Raw) -> Images:
        """The CPU half: pixels of the samples in ``raw`` (any slice of what :meth:`read` returned)."""
        return self._decode(raw)

    @abstractmethod
    def _read(self, idx: np.ndarray) -> Raw:
        """Raw items of already-validated int64 indices: pixels, or what ``_decode`` turns into pixels."""

    def _decode(self, raw: Raw) -> Images:
        return raw  # type: ignore[return-value]  # in memory: what _read returned is already pixels

    def identity(self) -> str:
        """Content identity of exactly these samples, in this order, with these labels and class names."""
        if self._identity is None:
            self._identity = hash_json({"content": self._content_identity(),
                                        "labels": hash_array(self._labels), "class_names": self.class_names})
        return self._identity

    def sample_keys(self) -> np.ndarray:
        """Each sample's content key (``KEY_DTYPE``), in order: a digest of that sample's own bytes (its
        file's, or its pixels'), never of its position, its label or the other samples. Equal content
        gives equal keys (duplicates share one)."""
        if self._keys is None:
            keys = self._sample_keys()
            if len(keys) != len(self):
                raise DataError(f"{self.name}: {len(keys)} content keys for {len(self)} samples")
            self._keys = keys
        return self._keys

    @abstractmethod
    def _sample_keys(self) -> np.ndarray:
        """Content keys of all samples, in order (see :meth:`sample_keys`)."""

    def subset(self, indices: np.ndarray | Sequence[int], *, labels: np.ndarray | Sequence[int] | None = None,
               class_names: Sequence[str] | None = None, name: str | None = None) -> SampleSet:
        """The samples at ``indices`` (in that order), optionally relabelled into new ``class_names``.

        Used by splits and class selection; the result loads through this set and its
        identity covers the chosen indices and the new labels.
        """
        indices = _as_index(indices, len(self), self.name)
        new_labels = self._labels[indices] if labels is None else np.asarray(labels)
        if len(new_labels) != len(indices):
            raise DataError(f"{self.name}: subset of {len(indices)} samples given {len(new_labels)} labels")
        names = self.class_names if class_names is None else class_names
        return SubsetSampleSet(self, indices, new_labels, names, name=name or f"{self.name}[subset]")

    @abstractmethod
    def _content_identity(self) -> str:
        """Identity of the pixels of all samples, in order (labels are added by ``identity``)."""


class ArraySampleSet(SampleSet):
    """Samples held in one uint8 array (N, H, W[, C]), optionally read only on first use.

    ``images`` may be a callable returning the array, so a source can validate its
    files and report sizes without decompressing them; pass ``content_id`` (e.g. the
    files' identity) so that identity does not force the load either.
    """

    def __init__(self, images: np.ndarray | Callable[[], np.ndarray], labels: np.ndarray | Sequence[int],
                 class_names: Sequence[str], *, name: str, content_id: str | None = None) -> None:
        super().__init__(labels, class_names, name=name)
        self._content_id = content_id
        self._lock = threading.Lock()
        self._loader: Callable[[], np.ndarray] | None = None
        self._array: np.ndarray | None = None
        if callable(images):
            self._loader = images
        else:
            self._array = self._check(images)

    def _check(self, images: np.ndarray) -> np.ndarray:
        images = np.asarray(images)
        if images.ndim == 3:
            images = images[:, :, :, None]
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] not in (1, 3):
            raise DataError(f"{self.name}: expected uint8 images of shape (N, H, W), (N, H, W, 1) or "
                            f"(N, H, W, 3), got dtype {images.dtype} shape {images.shape}")
        if len(images) != len(self.labels):
            raise DataError(f"{self.name}: {len(images)} images but {len(self.labels)} labels")
        return images

    def array(self) -> np.ndarray:
        """All images as (N, H, W, C) uint8, loading them on first call (thread-safe)."""
        if self._array is None:
            with self._lock:
                if self._array is None:
                    assert self._loader is not None
                    self._array = self._check(self._loader())
                    self._loader = None
        return self._array

    def _read(self, idx: np.ndarray) -> Images:
        return self.array()[idx]

    def _content_identity(self) -> str:
        if self._content_id is None:
            self._content_id = hash_array(self.array())
        return self._content_id

    def _sample_keys(self) -> np.ndarray:
        images = self.array()
        shape = f"{images.shape[1:]}".encode()
        return keys_array([content_key(shape + image.tobytes()) for image in images])


class GeneratedSampleSet(SampleSet):
    """Samples computed on demand by ``generate(index)``; identity is whatever defines the generator.

    Used for synthetic data of any size: nothing is held in memory, and the same
    index always yields the same image, whichever batch or thread asks for it.
    """

    def __init__(self, generate: Callable[[int], np.ndarray], labels: np.ndarray | Sequence[int],
                 class_names: Sequence[str], *, name: str, content_id: str) -> None:
        super().__init__(labels, class_names, name=name)
        self._generate = generate
        self._content_id = content_id

    decodes = True

    def _read(self, idx: np.ndarray) -> Raw:
        return idx  # nothing is stored: generation is the CPU half

    def _decode(self, raw: Raw) -> Images:
        return as_batch([as_hwc(self._generate(int(i)), f"{self.name} sample {int(i)}") for i in raw])

    def _content_identity(self) -> str:
        return self._content_id

    def _sample_keys(self) -> np.ndarray:
        # A generated image is a function of the generator and its index: key both, not the pixels.
        return keys_array([content_key(f"{self._content_id}/{i}".encode()) for i in range(len(self))])


class SubsetSampleSet(SampleSet):
    """Some samples of a parent set, in a given order, possibly relabelled.

    Subsets of subsets collapse onto the root set, so loading never walks a chain and
    the identity of a subset does not depend on how it was reached.
    """

    parent: SampleSet
    indices: np.ndarray

    def __init__(self, parent: SampleSet, indices: np.ndarray, labels: np.ndarray | Sequence[int],
                 class_names: Sequence[str], *, name: str) -> None:
        if isinstance(parent, SubsetSampleSet):
            indices = parent.indices[indices]
            parent = parent.parent
        super().__init__(labels, class_names, name=name)
        self.parent = parent
        self.decodes = parent.decodes
        self.indices = np.asarray(indices, np.int64)
        self.indices.setflags(write=False)

    def _read(self, idx: np.ndarray) -> Raw:
        return self.parent._read(self.indices[idx])

    def _decode(self, raw: Raw) -> Images:
        return self.parent._decode(raw)

    def _content_identity(self) -> str:
        return hash_json({"parent": self.parent._content_identity(), "indices": hash_array(self.indices)})

    def _sample_keys(self) -> np.ndarray:
        keys = self.parent.sample_keys()[self.indices]
        keys.setflags(write=False)
        return keys
