"""Class selection, stratified train/val/test carving and few-shot caps, stable as data arrives.

Every choice about a sample is drawn from ``(seed, the sample's content key)`` alone
(:meth:`~pipeline.data.sampleset.SampleSet.sample_keys`), never from its position or from the other
samples, so a dataset that grows or shrinks never moves a sample it kept from one split to another
(on a device the data keeps arriving: a stored cache of the old samples stays valid for them). From
the same rule: the same seed gives the same split; selecting a different set of classes leaves each
shared class's split unchanged; the test samples do not move when ``val_fraction`` changes; and a
smaller ``per_class`` is a subset of a larger one (few-shot curves compare like with like).

The price of stability: a fraction is a probability per sample, not an exact count per class (a
class of 100 samples at ``val_fraction: 0.2`` gets about 20). Samples with equal content (one image
copied into two files) share a key and so a split.

Each carved split is in an order drawn the same way (``shuffle_train`` for train): a source that
lists samples class by class (``image_folder`` walks one folder per class) would otherwise reach a
cache class-sorted, and the cache reader, which shuffles chunks and samples within a window of chunks
(large sequential reads for slow storage), would then feed batches of one or two classes. An order by
key also places a new sample among the old ones without reordering them. Official splits (a
dataset's own test or val set) keep their source's order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..errors import DataError
from .sampleset import SampleSet

# What each per-sample draw decides: independent numbers from one key, one stream each.
_SPLIT, _CAP, _ORDER = "split", "cap", "order"


def draws(keys: np.ndarray, seed: int, stream: str) -> np.ndarray:
    """A number in [0, 1) per content key, a function of ``(seed, stream, key)`` alone."""
    salt = f"{seed}/{stream}".encode()
    out = np.empty(len(keys), np.float64)
    for i, key in enumerate(keys):
        digest = hashlib.blake2b(bytes(key), digest_size=8, key=salt[:64]).digest()
        out[i] = int.from_bytes(digest, "little") / 2.0**64
    return out


def in_key_order(indices: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``indices`` sorted by their draw in ``order`` (ties, i.e. equal content: by index)."""
    return indices[np.lexsort((indices, order[indices]))]


def _relabel_map(num_classes: int, classes: Sequence[int]) -> np.ndarray:
    """old label -> new label (position in ``classes``), -1 for classes not selected."""
    remap = np.full(num_classes, -1, np.int64)
    remap[np.asarray(classes, np.int64)] = np.arange(len(classes))
    return remap


def select_classes(sample_set: SampleSet, classes: Sequence[int]) -> SampleSet:
    """Samples of ``classes`` only, relabelled 0..k-1 in the order given (assumed validated)."""
    remap = _relabel_map(len(sample_set.class_names), classes)
    keep = np.flatnonzero(remap[sample_set.labels] >= 0)
    names = [sample_set.class_names[c] for c in classes]
    return sample_set.subset(keep, labels=remap[sample_set.labels[keep]], class_names=names,
                             name=f"{sample_set.name}[classes]")


def _check_args(sets: dict[str, SampleSet], classes: list[int] | None, per_class: int | None,
                val_fraction: float, test_fraction: float) -> list[int]:
    if "train" not in sets:
        raise DataError(f"dataset has no 'train' split to split (found {sorted(sets)})")
    names = sets["train"].class_names
    for split, s in sets.items():
        if s.class_names != names:
            raise DataError(f"split {split!r} has class names {s.class_names[:5]}... but 'train' has "
                            f"{names[:5]}...; all splits of a dataset must share class names")
    if not (0.0 <= val_fraction < 1.0 and 0.0 <= test_fraction < 1.0 and val_fraction + test_fraction < 1.0):
        raise DataError(f"val_fraction ({val_fraction}) and test_fraction ({test_fraction}) must each be in "
                        f"[0, 1) and sum to less than 1")
    if per_class is not None and per_class < 1:
        raise DataError(f"per_class must be >= 1 (or null for no cap), got {per_class}")
    n = len(names)
    if classes is None:
        return list(range(n))
    if len(classes) == 0:
        raise DataError(f"classes is empty; list class indices in 0..{n - 1} or omit it for all classes")
    bad = [c for c in classes if not 0 <= int(c) < n]
    if bad:
        raise DataError(f"classes {bad} out of range: this dataset has {n} classes, "
                        f"valid indices are 0..{n - 1}")
    dupes = sorted({int(c) for c in classes if list(classes).count(c) > 1})
    if dupes:
        raise DataError(f"classes lists {dupes} more than once; each class may appear once")
    return [int(c) for c in classes]


def make_splits(sets: dict[str, SampleSet], *, classes: list[int] | None, per_class: int | None,
                val_fraction: float, test_fraction: float, seed: int,
                use_official_test: bool, shuffle_train: bool = True) -> dict[str, SampleSet]:
    """Select classes, carve stratified val/test from ``train``, cap train per class.

    - ``classes`` (None = all) are relabelled 0..k-1 in the given order.
    - ``test``: the official test split if present and ``use_official_test``, else each
      sample of train with probability ``test_fraction`` (no test if that is 0).
    - ``val``: each sample with probability ``val_fraction`` (an official ``val`` split is
      used instead when present and ``use_official_test``); omitted if the fraction is 0.
    - ``train``: the rest, capped at ``per_class`` samples per class; val/test are not capped.
      In an order drawn from ``seed`` if ``shuffle_train``, else in the source's order.
    Every draw is per sample, from ``seed`` and its content key (the module's docstring). Each
    class keeps at least one train sample when it has any. No sample is in two splits.
    """
    order = _check_args(sets, classes, per_class, val_fraction, test_fraction)
    train = sets["train"]
    official_test = use_official_test and "test" in sets
    official_val = use_official_test and "val" in sets and val_fraction > 0
    carve_test = 0.0 if official_test else test_fraction
    carve_val = 0.0 if official_val else val_fraction

    keys = train.sample_keys()
    u, cap, placed = draws(keys, seed, _SPLIT), draws(keys, seed, _CAP), draws(keys, seed, _ORDER)
    picked: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for c in order:
        members = np.flatnonzero(train.labels == c)
        uc = u[members]
        test = uc < carve_test
        val = (uc >= carve_test) & (uc < carve_test + carve_val)
        rest = ~(test | val)
        if len(members) and not rest.any():  # keep one train sample: the one drawn nearest to train
            last = int(np.argmax(uc))
            test[last] = val[last] = False
            rest[last] = True
        picked["test"].append(members[test])
        picked["val"].append(members[val])
        kept = members[rest]
        if per_class is not None:  # the cap keeps the samples with the lowest draws: a subset as it grows
            kept = kept[np.lexsort((kept, cap[kept]))][:per_class]
        picked["train"].append(kept)

    remap = _relabel_map(len(train.class_names), order)
    names = [train.class_names[c] for c in order]
    out: dict[str, SampleSet] = {}
    wanted = {"train": True, "val": val_fraction > 0 and not official_val, "test": carve_test > 0}
    for split, parts in picked.items():
        if wanted[split]:
            idx = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
            if split != "train" or shuffle_train:
                idx = in_key_order(idx, placed)
            out[split] = train.subset(idx, labels=remap[train.labels[idx]], class_names=names,
                                      name=f"{train.name}[{split}]")
    if official_val:
        out["val"] = select_classes(sets["val"], order)
    if official_test:
        out["test"] = select_classes(sets["test"], order)
    return {name: out[name] for name in ("train", "val", "test") if name in out}
