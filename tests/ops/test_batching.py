"""Re-chunk, prefetch and shuffle invariants: every sample exactly once, order changed only by shuffles."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ops import concat, prefetch, rechunk, window_shuffle


def make_batches(sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    out, start = [], 0
    for n in sizes:
        ids = torch.arange(start, start + n)
        out.append({"id": ids, "x": ids.float()[:, None].repeat(1, 3)})
        start += n
    return out


sizes_st = st.lists(st.integers(min_value=0, max_value=17), min_size=0, max_size=12)


@given(sizes=sizes_st, size=st.integers(1, 20), drop_last=st.booleans())
def test_rechunk_keeps_every_sample_in_order(sizes: list[int], size: int, drop_last: bool) -> None:
    total = sum(sizes)
    out = list(rechunk(make_batches(sizes), size, drop_last=drop_last))
    ids = torch.cat([b["id"] for b in out]) if out else torch.empty(0, dtype=torch.long)
    expected = total - (total % size if drop_last else 0)
    assert ids.tolist() == list(range(expected))
    assert all(len(b["id"]) == size for b in out[:-1])
    if out:
        assert 1 <= len(out[-1]["id"]) <= size
        assert torch.equal(out[-1]["x"][:, 0], out[-1]["id"].float())  # fields stay aligned


def _storages(batches: list[dict[str, torch.Tensor]]) -> set[int]:
    return {v.untyped_storage().data_ptr() for b in batches for v in b.values()}


def make_labelled(sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    """Batches with three fields (features, label, id) that must stay aligned sample by sample."""
    out, start = [], 0
    for n in sizes:
        ids = torch.arange(start, start + n)
        out.append({"x": ids.float()[:, None, None].repeat(1, 2, 3), "y": ids % 7, "id": ids})
        start += n
    return out


@given(
    batch=st.integers(1, 8),
    multiples=st.lists(st.integers(0, 4), max_size=8),
    aligned=st.booleans(),
    extra=st.lists(st.integers(1, 11), max_size=8),
)
def test_rechunk_aligns_all_fields_and_copies_only_straddling_batches(
    batch: int, multiples: list[int], aligned: bool, extra: list[int]
) -> None:
    sizes = [m * batch for m in multiples]
    if not aligned:
        sizes = [m * batch + e for m, e in zip(multiples, extra, strict=False)]
    inputs = make_labelled(sizes)
    out = list(rechunk(inputs, batch))
    ids = torch.cat([b["id"] for b in out]).tolist() if out else []
    assert ids == list(range(sum(sizes)))  # every sample once, in order
    for b in out:
        assert torch.equal(b["x"][:, 0, 0], b["id"].float()) and torch.equal(b["y"], b["id"] % 7)
    assert all(len(b["id"]) == batch for b in out[:-1])
    sources = _storages(inputs)
    copied = [b for b in out if b["x"].untyped_storage().data_ptr() not in sources]
    if aligned:
        assert not copied  # sizes that are multiples of the batch: slice views only, no torch.cat
    else:
        assert len(copied) <= len([n for n in sizes if n])  # at most one copied output per input batch


def test_rechunk_of_one_large_chunk_is_views() -> None:
    chunk = make_labelled([96])[0]
    out = list(rechunk([chunk], 32))
    assert [len(b["id"]) for b in out] == [32, 32, 32]
    assert all(b["x"].untyped_storage().data_ptr() == chunk["x"].untyped_storage().data_ptr() for b in out)


def test_rechunk_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        list(rechunk(make_batches([3]), 0))


def test_rechunk_rejects_misaligned_fields() -> None:
    with pytest.raises(ValueError, match="disagree"):
        list(rechunk([{"a": torch.zeros(3), "b": torch.zeros(2)}], 2))


@given(sizes=sizes_st, window=st.integers(1, 40), out_size=st.integers(1, 9), seed=st.integers(0, 5))
def test_window_shuffle_is_a_permutation(sizes: list[int], window: int, out_size: int, seed: int) -> None:
    out = list(window_shuffle(make_batches(sizes), window, seed=seed, out_size=out_size))
    ids = torch.cat([b["id"] for b in out]).tolist() if out else []
    assert sorted(ids) == list(range(sum(sizes)))
    for b in out:
        assert torch.equal(b["x"][:, 0], b["id"].float())


def test_window_shuffle_changes_order_and_is_seeded() -> None:
    a = concat(list(window_shuffle(make_batches([50, 50]), 100, seed=1, out_size=10)))["id"]
    b = concat(list(window_shuffle(make_batches([50, 50]), 100, seed=1, out_size=10)))["id"]
    c = concat(list(window_shuffle(make_batches([50, 50]), 100, seed=2, out_size=10)))["id"]
    assert torch.equal(a, b) and not torch.equal(a, c) and a.tolist() != list(range(100))


@settings(deadline=None, max_examples=25)
@given(n=st.integers(0, 30), depth=st.integers(0, 4))
def test_prefetch_preserves_sequence(n: int, depth: int) -> None:
    assert list(prefetch(iter(range(n)), depth)) == list(range(n))


def test_prefetch_reraises_producer_errors() -> None:
    def gen():
        yield 1
        raise OSError("disk went away")

    it = prefetch(gen(), 2)
    assert next(it) == 1
    with pytest.raises(OSError, match="disk went away"):
        next(it)


def test_prefetch_bounded_and_stops_when_abandoned() -> None:
    produced = []

    def gen():
        for i in range(1000):
            produced.append(i)
            yield i

    it = prefetch(gen(), 3)
    assert next(it) == 0
    it.close()  # consumer walks away: the thread must not keep producing or hang
    assert len(produced) <= 3 + 2
    assert not any(t.name == "prefetch" and t.is_alive() for t in threading.enumerate())
