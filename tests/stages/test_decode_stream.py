"""The decode stream: files are read on a background thread, resize/normalize run on the consumer's.

Decoding and augmentation run on the background thread or between the consumer's steps
on a pool of threads. Where the work runs must not change what comes out: every batch
equals decoding the same samples directly, in the same order, with labels and ids
aligned, for any prefetch depth, placement and thread count; an abandoned stream stops
its threads at once.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from pipeline.data.decode import Decoder, InputAugment
from pipeline.data.sources import synthetic
from pipeline.stage import StageInputs
from pipeline.stages.decode import DatasetStream, Decode
from pipeline.stages.sources import DatasetValue
from tests.helpers import stage_call

RES = 16


def make_stream(depth: int, *, augment: InputAugment | None = None, batch: int = 5,
                cpu_work: str = "background", threads: int = 1, pin_memory: bool = False) -> DatasetStream:
    sets = synthetic(23, 4, 12, seed=3)
    data = DatasetValue(sets, list(sets["train"].class_names))
    spec = Decode(input="data", resolution=RES).resolve(StageInputs({"input": data.spec}), None)
    decoder = Decoder(RES, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    return DatasetStream(data, spec, decoder, augment, ("train",), batch, depth, cpu_work=cpu_work,
                         threads=threads, pin_memory=pin_memory)


PLACEMENTS = [("background", 1), ("between_steps", 1), ("between_steps", 3)]


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("cpu_work", "threads"), PLACEMENTS)
def test_batches_equal_direct_decoding(depth: int, shuffle: bool, cpu_work: str, threads: int) -> None:
    stream = make_stream(depth, cpu_work=cpu_work, threads=threads)
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


def test_same_output_for_every_prefetch_depth_and_placement_with_augmentation() -> None:
    aug = InputAugment(crop_padding=2, hflip=0.5)
    streams = [make_stream(d, augment=aug, cpu_work=w, threads=t) for d in (0, 2) for w, t in PLACEMENTS]
    runs = [list(stream.open("train", epoch=1, shuffle=True, seed=4)) for stream in streams]
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        for a, b in zip(runs[0], other, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in ("x", "y", "id"))
    plain = list(make_stream(0).open("train", epoch=1, shuffle=True, seed=4))
    assert any(not torch.equal(a["x"], p["x"]) for a, p in zip(runs[0], plain, strict=True))


@pytest.mark.parametrize("threads", [1, 3])
def test_a_gpu_consumers_placement_gives_the_same_batches(threads: int) -> None:
    # For a GPU (pin_memory): decoding spread over threads and normalization on the loader thread, the
    # images pinned where a CUDA driver is present. Same batches as any other placement.
    aug = InputAugment(crop_padding=2, hflip=0.5)
    want = list(make_stream(2, augment=aug).open("train", epoch=1, shuffle=True, seed=4))
    stream = make_stream(2, augment=aug, threads=threads, pin_memory=True)
    got = list(stream.open("train", epoch=1, shuffle=True, seed=4))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("x", "y", "id"))
        assert a["x"].is_pinned() == torch.cuda.is_available()


def test_start_skips_samples_already_done() -> None:
    batches = list(make_stream(2).open("train", start=11))
    assert torch.cat([b["id"] for b in batches]).tolist() == list(range(11, 23))


def test_abandoned_stream_stops_its_loader_and_decoder_threads() -> None:
    it = make_stream(2, batch=4, cpu_work="between_steps", threads=2).open("train")
    next(it)
    names = {t.name for t in threading.enumerate()}
    assert "decode-train" in names and any(n.startswith("decode-train_") for n in names)
    it.close()
    # close() joins them (the loader with a timeout, so a wedged read cannot hang the consumer); on a
    # loaded machine the loader may still be finishing the read it was in: wait for it, boundedly.
    decoders = [t for t in threading.enumerate() if t.name.startswith("decode-train")]
    for thread in decoders:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in decoders)


@pytest.mark.parametrize("cpu_work", ["background", "between_steps"])
def test_read_errors_reach_the_consumer(cpu_work: str) -> None:
    stream = make_stream(2, cpu_work=cpu_work, threads=2)

    def broken(idx: np.ndarray) -> np.ndarray:
        raise OSError("card removed")

    stream.data.splits["train"].read = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="card removed"):
        list(stream.open("train"))


@pytest.mark.parametrize("cpu_work", ["background", "between_steps"])
def test_decode_errors_reach_the_consumer(cpu_work: str) -> None:
    stream = make_stream(2, cpu_work=cpu_work, threads=2)
    samples = stream.data.splits["train"]
    decode = samples.decode

    def broken(raw: np.ndarray) -> np.ndarray:
        if 13 in list(raw):
            raise ValueError("sample 13: corrupt")
        return decode(raw)

    samples.decode = broken  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="sample 13: corrupt"):
        list(stream.open("train"))
    # The other parts of that batch were running or queued: none is left behind.
    assert not any(t.name.startswith("decode-train") and t.is_alive() for t in threading.enumerate())


def test_pulled_by_a_prefetch_thread_it_decodes_there_without_a_pool() -> None:
    # NeuroFlux and finetune's read-ahead pull their batches on a prefetch thread: there are no
    # compute steps on it to fit decoding between, so it decodes on its loader thread instead.
    from pipeline.ops.prefetch import prefetch

    stream = make_stream(2, cpu_work="between_steps", threads=3)
    seen: set[str] = set()
    decode = stream.data.splits["train"].decode

    def recording(raw: np.ndarray) -> np.ndarray:
        seen.add(threading.current_thread().name)
        return decode(raw)

    stream.data.splits["train"].decode = recording  # type: ignore[method-assign]
    batches = list(prefetch(stream.open("train", epoch=1, shuffle=True, seed=4), 2, name="consumer"))
    assert seen == {"decode-train"}  # the stream's own loader thread, not a decode-train_N pool thread
    direct = list(make_stream(0).open("train", epoch=1, shuffle=True, seed=4))
    for a, b in zip(batches, direct, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("x", "y", "id"))


def test_unknown_placement_is_rejected() -> None:
    with pytest.raises(ValueError, match="cpu_work must be one of"):
        make_stream(2, cpu_work="gpu")


def test_auto_placement_follows_the_device() -> None:
    from pipeline.context import RunContext

    sets = synthetic(8, 2, 12)
    data = DatasetValue(sets, list(sets["train"].class_names))
    ctx = RunContext(catalog=None, device="cpu")  # type: ignore[arg-type]  # decode never stores
    stage = Decode(input="data", resolution=RES)
    stream = stage.run(ctx, {"input": data}, stage_call(stage, "images", input=data.spec))
    assert stream.cpu_work == "between_steps" and stream.threads == torch.get_num_threads()
    forced = Decode(input="data", resolution=RES, cpu_work="background", decode_threads=3)
    stream = forced.run(ctx, {"input": data}, stage_call(forced, "images", input=data.spec))
    assert (stream.cpu_work, stream.threads) == ("background", 3)
    # Placement is scheduling, not content: it never changes the stage's fingerprint.
    assert forced.fingerprint_config() == stage.fingerprint_config()
