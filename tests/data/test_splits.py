"""make_splits: disjoint, stratified, capped, relabelled, deterministic, stable as data arrives, and clear
about bad classes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data.sampleset import ArraySampleSet, SampleSet
from pipeline.data.splits import make_splits
from pipeline.errors import DataError


def dataset(counts: list[int], with_test: int = 0, offset: int = 0) -> dict[str, SampleSet]:
    """Each image's two pixels store its own index in the train set (plus ``offset``: samples of another
    draw), so samples are told apart by content, as splits tell them."""
    labels = np.repeat(np.arange(len(counts)), counts)
    n = len(labels)
    ids = np.arange(n) + offset
    images = np.stack([ids // 256, ids % 256], axis=1).astype(np.uint8).reshape(n, 1, 2)
    names = [f"c{i}" for i in range(len(counts))]
    sets: dict[str, SampleSet] = {"train": ArraySampleSet(images, labels, names, name="toy/train")}
    if with_test:
        test_labels = np.arange(with_test) % len(counts)
        sets["test"] = ArraySampleSet(np.zeros((with_test, 1, 1), np.uint8), test_labels, names,
                                      name="toy/test")
    return sets


def parent_indices(s: SampleSet) -> np.ndarray:
    return np.asarray(s.indices)  # type: ignore[attr-defined]


def split(sets: dict[str, SampleSet], **kw: object) -> dict[str, SampleSet]:
    args: dict[str, object] = {"classes": None, "per_class": None, "val_fraction": 0.2, "test_fraction": 0.2,
                               "seed": 0, "use_official_test": True}
    args.update(kw)
    return make_splits(sets, **args)  # type: ignore[arg-type]


def test_disjoint_and_complete_without_cap() -> None:
    out = split(dataset([50, 30, 20]))
    assert set(out) == {"train", "val", "test"}
    idx = [parent_indices(s) for s in out.values()]
    joined = np.concatenate(idx)
    assert len(joined) == len(np.unique(joined)) == 100  # no sample twice, none lost
    for s in out.values():  # labels still match the samples they describe
        assert (s.labels == dataset([50, 30, 20])["train"].labels[parent_indices(s)]).all()


def test_stratified_fractions() -> None:
    # A fraction is a probability per sample: counts are binomial around it (4 standard deviations here).
    counts = [5000, 3000, 2000]
    out = split(dataset(counts), val_fraction=0.2, test_fraction=0.1)
    for name, fraction in (("val", 0.2), ("test", 0.1), ("train", 0.7)):
        got = np.bincount(out[name].labels)
        for n, k in zip(counts, got, strict=True):
            assert abs(k - fraction * n) <= 4 * np.sqrt(n * fraction * (1 - fraction)), (name, n, k)


def test_per_class_caps_train_only_and_nests() -> None:
    sets = dataset([50, 30, 20])
    five = split(sets, per_class=5)
    assert np.bincount(five["train"].labels).tolist() == [5, 5, 5]
    uncapped = split(sets)
    np.testing.assert_array_equal(parent_indices(five["val"]), parent_indices(uncapped["val"]))  # not capped
    ten = split(sets, per_class=10)
    assert set(parent_indices(five["train"])) <= set(parent_indices(ten["train"]))
    np.testing.assert_array_equal(parent_indices(five["test"]), parent_indices(ten["test"]))
    assert len(split(sets, per_class=100)["train"]) == len(uncapped["train"])


def test_class_selection_relabels_in_given_order() -> None:
    sets = dataset([10, 20, 30, 40], with_test=8)
    out = split(sets, classes=[3, 1])
    for s in out.values():
        assert s.class_names == ["c3", "c1"]
        assert set(s.labels.tolist()) == {0, 1}
        original = s.parent.labels[parent_indices(s)]  # type: ignore[attr-defined]
        assert ((original == 3) == (s.labels == 0)).all() and ((original == 1) == (s.labels == 1)).all()
    assert len(out["test"]) == 4  # official test: only the selected classes, 2 each
    # A class's split does not depend on which other classes were selected.
    alone = split(sets, classes=[1])
    np.testing.assert_array_equal(parent_indices(alone["val"]),
                                  parent_indices(out["val"])[out["val"].labels == 1])


def test_official_test_is_used_or_ignored() -> None:
    sets = dataset([20, 20], with_test=10)
    official = split(sets, use_official_test=True)
    assert len(official["test"]) == 10 and len(official["train"]) + len(official["val"]) == 40
    carved = split(sets, use_official_test=False)
    assert 0 < len(carved["test"]) < 20
    assert len(carved["train"]) + len(carved["val"]) + len(carved["test"]) == 40
    none = split(dataset([20, 20]), test_fraction=0.0, val_fraction=0.0)
    assert set(none) == {"train"} and len(none["train"]) == 40


def test_deterministic_per_seed() -> None:
    sets = dataset([40, 40])
    a, b, c = split(sets, seed=1), split(sets, seed=1), split(sets, seed=2)
    for name in a:
        np.testing.assert_array_equal(parent_indices(a[name]), parent_indices(b[name]))
        assert a[name].identity() == b[name].identity()
    assert not np.array_equal(parent_indices(a["val"]), parent_indices(c["val"]))
    assert a["val"].identity() != c["val"].identity()


def test_subset_identity_reflects_selection() -> None:
    sets = dataset([40, 40])
    ids = {split(sets, per_class=k)["train"].identity() for k in (3, 4, 5)}
    assert len(ids) == 3
    assert split(sets)["train"].identity() != sets["train"].identity()


def test_bad_arguments_are_named() -> None:
    sets = dataset([5, 5, 5])
    with pytest.raises(DataError, match=r"classes \[3, -1\] out of range.*3 classes.*0\.\.2"):
        split(sets, classes=[0, 3, -1])
    with pytest.raises(DataError, match="more than once"):
        split(sets, classes=[1, 1])
    with pytest.raises(DataError, match="classes is empty"):
        split(sets, classes=[])
    with pytest.raises(DataError, match="sum to less than 1"):
        split(sets, val_fraction=0.6, test_fraction=0.5)
    with pytest.raises(DataError, match="no 'train' split"):
        make_splits({"test": sets["train"]}, classes=None, per_class=None, val_fraction=0.1,
                    test_fraction=0.1, seed=0, use_official_test=True)


def test_tiny_classes_keep_a_train_sample() -> None:
    out = split(dataset([1, 2, 3]), val_fraction=0.4, test_fraction=0.4)
    assert np.bincount(out["train"].labels, minlength=3).min() >= 1


def test_loading_through_splits_returns_the_right_pixels() -> None:
    out = split(dataset([30, 30]), per_class=4)
    s = out["train"]
    pixels = s.load(np.arange(len(s)))[:, 0, 1, 0]
    np.testing.assert_array_equal(pixels, parent_indices(s) % 256)


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 30), min_size=1, max_size=6),
       val=st.floats(0.0, 0.45), test=st.floats(0.0, 0.45),
       per_class=st.one_of(st.none(), st.integers(1, 10)),
       seed=st.integers(0, 2**31 - 1))
def test_never_a_sample_in_two_splits(counts: list[int], val: float, test: float, per_class: int | None,
                                      seed: int) -> None:
    sets = dataset(counts)
    out = split(sets, val_fraction=val, test_fraction=test, per_class=per_class, seed=seed)
    joined = np.concatenate([parent_indices(s) for s in out.values()])
    assert len(joined) == len(np.unique(joined))
    for s in out.values():
        assert (s.labels == sets["train"].labels[parent_indices(s)]).all()
    if per_class is not None:
        assert np.bincount(out["train"].labels, minlength=len(counts)).max(initial=0) <= per_class


def test_splits_are_stored_in_a_seeded_random_order() -> None:
    sets = dataset([50, 30, 20])  # class-sorted, as an image_folder source lists its files
    shuffled, kept = split(sets), split(sets, shuffle_train=False)
    order, source = parent_indices(shuffled["train"]), parent_indices(kept["train"])
    assert (np.diff(source) > 0).all()  # shuffle_train=False: train in the source's order
    assert sorted(order) == source.tolist()  # same samples, no sample twice
    assert not (np.diff(order) > 0).all()
    # mixed classes: the first 20 stored samples are not all of one class
    assert len(set(shuffled["train"].labels[:20].tolist())) == 3
    assert (shuffled["train"].labels == sets["train"].labels[order]).all()
    assert parent_indices(split(sets)["train"]).tolist() == order.tolist()  # deterministic
    assert parent_indices(split(sets, seed=1)["train"]).tolist() != order.tolist()


def membership(out: dict[str, SampleSet]) -> dict[bytes, str]:
    return {bytes(k): name for name, s in out.items() for k in s.sample_keys()}


@pytest.mark.parametrize("per_class", [None, 8])
def test_samples_that_arrive_or_leave_move_no_other_sample(per_class: int | None) -> None:
    old = dataset([40, 30, 20])
    more = dataset([40, 30, 20])["train"]
    arrived = dataset([15, 10, 5], offset=1000)["train"]
    grown = {"train": ArraySampleSet(np.concatenate([more.load(np.arange(len(more))),
                                                     arrived.load(np.arange(len(arrived)))]),
                                     np.concatenate([more.labels, arrived.labels]), more.class_names,
                                     name="grown")}
    before, after = membership(split(old, per_class=per_class)), membership(split(grown, per_class=per_class))
    moved = {k: (v, after[k]) for k, v in before.items() if k in after and after[k] != v}
    assert not moved  # a kept sample keeps its split
    if per_class is None:
        assert set(before) <= set(after)  # nothing dropped either
        shrunk = membership(split({"train": old["train"].subset(np.arange(0, 90, 2))}))
        assert shrunk and all(before[k] == v for k, v in shrunk.items())  # leaving moves no one either
    # the stored order of the old samples is kept too: a new one only slots in between
    old_order = [bytes(k) for k in split(old)["val"].sample_keys()]
    new_order = [bytes(k) for k in split(grown)["val"].sample_keys() if bytes(k) in set(old_order)]
    assert new_order == old_order
