"""The decode stream: loading runs on a background thread, resize/normalize on the consumer's.

Where the work runs must not change what comes out: every batch equals decoding the
same samples directly, in the same order, with labels and ids aligned, for any
prefetch depth; an abandoned stream stops its loader thread at once.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from pipeline.data.decode import Decoder, InputAugment
from pipeline.data.sources import synthetic
from pipeline.stages.decode import DatasetStream, Decode
from pipeline.stages.sources import DatasetValue

RES = 16


def make_stream(depth: int, *, augment: InputAugment | None = None, batch: int = 5) -> DatasetStream:
    sets = synthetic(23, 4, 12, seed=3)
    data = DatasetValue(sets, list(sets["train"].class_names))
    spec = Decode(input="data", resolution=RES).resolve({"input": data.spec}, None)
    decoder = Decoder(RES, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    return DatasetStream(data, spec, decoder, augment, ("train",), batch, depth)


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_equal_direct_decoding(depth: int, shuffle: bool) -> None:
    stream = make_stream(depth)
    samples = stream.data.splits["train"]
    batches = list(stream.open("train", epoch=2, shuffle=shuffle, seed=7))
    ids = torch.cat([b["id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(23)) and [len(b["id"]) for b in batches] == [5, 5, 5, 5, 3]
    if not shuffle:
        assert ids.tolist() == list(range(23))
    for b in batches:
        idx = b["id"].numpy()
        assert torch.equal(b["x"], stream.decoder(samples.load(idx)))
        assert torch.equal(b["y"], torch.from_numpy(samples.labels[idx]))


def test_same_output_for_every_prefetch_depth_with_augmentation() -> None:
    aug = InputAugment(crop_padding=2, hflip=0.5)
    runs = [list(make_stream(d, augment=aug).open("train", epoch=1, shuffle=True, seed=4)) for d in (0, 2)]
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("x", "y", "id"))
    plain = list(make_stream(0).open("train", epoch=1, shuffle=True, seed=4))
    assert any(not torch.equal(a["x"], p["x"]) for a, p in zip(runs[0], plain, strict=True))


def test_start_skips_samples_already_done() -> None:
    batches = list(make_stream(2).open("train", start=11))
    assert torch.cat([b["id"] for b in batches]).tolist() == list(range(11, 23))


def test_abandoned_stream_stops_its_loader_thread() -> None:
    it = make_stream(2, batch=1).open("train")
    next(it)
    assert any(t.name == "decode-train" for t in threading.enumerate())
    it.close()
    assert not any(t.name == "decode-train" and t.is_alive() for t in threading.enumerate())


def test_loader_errors_reach_the_consumer() -> None:
    stream = make_stream(2)

    def broken(idx: np.ndarray) -> np.ndarray:
        raise OSError("card removed")

    stream.data.splits["train"].load = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="card removed"):
        list(stream.open("train"))
