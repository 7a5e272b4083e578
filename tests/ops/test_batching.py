"""Re-chunk, prefetch and shuffle invariants: every sample exactly once, order changed only by shuffles."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ops import EpochPrefetch, concat, prefetch, rechunk, window_shuffle


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


# ------------------------------------------------------------------------- epochs read ahead


class Epochs:
    """``open_epoch`` for EpochPrefetch that records which epochs were opened and closed."""

    def __init__(self, sizes: list[int], fail_at: tuple[int, int] | None = None) -> None:
        self.sizes = sizes
        self.fail_at = fail_at
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.produced = 0

    def __call__(self, epoch: int) -> Iterator[tuple[int, int]]:
        self.opened.append(epoch)
        try:
            for i in range(self.sizes[epoch]):
                if (epoch, i) == self.fail_at:
                    raise OSError(f"chunk of epoch {epoch} unreadable")
                self.produced += 1
                yield epoch, i
        finally:
            self.closed.append(epoch)


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def epoch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "epochs" and t.is_alive()]


@settings(deadline=None, max_examples=25)
@given(sizes=st.lists(st.integers(0, 7), min_size=1, max_size=5), depth=st.integers(0, 3))
def test_epoch_prefetch_gives_each_epoch_its_items_in_order(sizes: list[int], depth: int) -> None:
    epochs = Epochs(sizes)
    ahead = EpochPrefetch(epochs, len(sizes), depth)
    for e, n in enumerate(sizes):
        assert list(ahead.epoch(e)) == [(e, i) for i in range(n)]
    ahead.close()
    assert epochs.opened == epochs.closed == list(range(len(sizes)))
    wait_for(lambda: not epoch_threads())


def test_epoch_prefetch_opens_the_next_epoch_before_it_is_asked_for() -> None:
    epochs = Epochs([5, 5, 5])
    ahead = EpochPrefetch(epochs, 3, depth=2)
    assert len(list(ahead.epoch(0))) == 5
    # the trainer now evaluates; meanwhile epoch 1 is opened and its first batches prepared
    wait_for(lambda: epochs.produced == 5 + 3)  # ``depth`` batches queued, one more waiting to be
    assert epochs.opened == [0, 1] and epochs.closed == [0]
    time.sleep(0.05)
    assert epochs.produced == 5 + 3  # and no further: the bound holds across the boundary too
    assert list(ahead.epoch(1)) == [(1, i) for i in range(5)]
    ahead.close()
    assert epochs.closed == epochs.opened  # the epoch read ahead is closed too
    wait_for(lambda: not epoch_threads())


def test_epoch_prefetch_with_depth_zero_opens_epochs_when_asked() -> None:
    epochs = Epochs([3, 3])
    ahead = EpochPrefetch(epochs, 2, depth=0)
    assert list(ahead.epoch(0)) == [(0, 0), (0, 1), (0, 2)]
    assert epochs.opened == [0] and not epoch_threads()


def test_leaving_an_epoch_early_stops_the_thread_and_closes_the_epoch() -> None:
    epochs = Epochs([50, 50])
    ahead = EpochPrefetch(epochs, 2, depth=2)
    batches = ahead.epoch(0)
    assert next(batches) == (0, 0)
    batches.close()  # e.g. an exception in the training step
    wait_for(lambda: not epoch_threads())
    assert epochs.closed == [0] and epochs.produced <= 1 + 2 + 1
    with pytest.raises(ValueError, match="epoch 1 asked for after the prefetch was closed"):
        ahead.epoch(1)


def test_epoch_prefetch_reraises_a_failing_epoch_in_the_consumer() -> None:
    ahead = EpochPrefetch(Epochs([4, 4], fail_at=(1, 2)), 2, depth=3)
    assert len(list(ahead.epoch(0))) == 4
    batches = ahead.epoch(1)
    assert [next(batches), next(batches)] == [(1, 0), (1, 1)]
    with pytest.raises(OSError, match="chunk of epoch 1 unreadable"):
        next(batches)
    wait_for(lambda: not epoch_threads())


def test_epoch_prefetch_rejects_epochs_out_of_order() -> None:
    ahead = EpochPrefetch(Epochs([1, 1]), 2, depth=1)
    with pytest.raises(ValueError, match="asked for epoch 1, next is 0"):
        ahead.epoch(1)
    list(ahead.epoch(0))
    list(ahead.epoch(1))
    with pytest.raises(ValueError, match="0 to 1: asked for epoch 2"):
        ahead.epoch(2)
    ahead.close()
