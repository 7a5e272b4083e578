"""The cache operator's reader and writer on real entries: two-stage read-ahead, HDF5 throttle and resume.

No mocks: entries are written with ``write_stream`` into temporary directories and read
back with ``StoredStream``; corruption is a flipped byte in a real chunk file.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from pipeline.ops.batching import Batch
from pipeline.ops.cache import H5_FILE, ZARR_DIR, StoredStream, write_stream
from pipeline.ops.prefetch import prefetch
from pipeline.spec import STREAM, FieldSpec, Spec, SplitSpec
from pipeline.stream import Stream, StreamStats
from stores.errors import CorruptChunkError, EntryWriteError
from stores.throttle import ThrottledFile, ThrottleProfile
from stores.zarr_entry import ZarrReader

SHAPE = (3, 5)
PER_SAMPLE = 3 * 5 * 2 + 8 + 8


class Numbers(Stream):
    """Deterministic samples; ``fail_after`` batches raises, like a build interrupted mid-way."""

    def __init__(self, counts: dict[str, int], fail_after: int | None = None) -> None:
        fields = {"x": FieldSpec(SHAPE, "float16"), "y": FieldSpec((), "int64"), "id": FieldSpec((), "int64")}
        self.spec = Spec(STREAM, 10, {s: SplitSpec(n, fields) for s, n in counts.items()}, {})
        self.stats = StreamStats()
        self.counts = counts
        self.fail_after = fail_after
        self.opened_at: list[int] = []

    def open(
        self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0, start: int = 0
    ) -> Iterator[Batch]:
        self.opened_at.append(start)
        for lo in range(start, self.counts[split], 7):
            if self.fail_after is not None:
                if self.fail_after == 0:
                    raise KeyboardInterrupt("simulated Ctrl-C")
                self.fail_after -= 1
            ids = torch.arange(lo, min(lo + 7, self.counts[split]))
            x = torch.sin(ids[:, None, None] * 0.1 + torch.arange(15).reshape(SHAPE)).to(torch.float16)
            yield {"x": x, "y": ids % 10, "id": ids}


COUNTS = {"train": 230, "val": 41}


def build(entry: Path, fmt: str = "zarr", stream: Stream | None = None, batch_period: int = 1) -> dict:
    codec = ("zstd", 3) if fmt == "zarr" else ("gzip", 4)
    return write_stream(
        stream or Numbers(COUNTS),
        entry,
        chunk_bytes=16 * PER_SAMPLE,
        compressor=codec[0],
        level=codec[1],
        attrs={"test": True},
        fmt=fmt,
        batch_period=batch_period,
    )


def read_all(stream: StoredStream, split: str = "train", **kw: object) -> dict[str, torch.Tensor]:
    batches = list(stream.open(split, **kw))  # type: ignore[arg-type]
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


@pytest.fixture(scope="module")
def zarr_entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    entry = tmp_path_factory.mktemp("zarr")
    build(entry)
    return entry


@pytest.fixture(scope="module")
def h5_entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    entry = tmp_path_factory.mktemp("h5")
    build(entry, "hdf5")
    return entry


# ------------------------------------------------------------------------- two-stage read-ahead


def test_fetch_then_decode_equals_a_stock_read(zarr_entry: Path) -> None:
    reader = ZarrReader(zarr_entry / ZARR_DIR)
    for index in (0, reader.num_chunks("train") - 1):  # a full chunk and the short tail
        raw = reader.fetch_chunk("train", index)
        assert raw.nbytes > 0 and set(raw.data) == {"train/id", "train/x", "train/y"}
        got = reader.decode_chunk(raw)
        lo, hi = raw.lo, raw.hi
        for leaf in ("x", "y", "id"):
            np.testing.assert_array_equal(got[leaf], reader.read("train", leaf, lo, hi))
            assert got[leaf].flags.writeable


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 6])
def test_every_depth_reads_the_same_samples(zarr_entry: Path, depth: int) -> None:
    reference = read_all(StoredStream(zarr_entry, prefetch_depth=0))
    stream = StoredStream(zarr_entry, prefetch_depth=depth)
    fetched, decoded = stream.stage_depths("train")
    assert fetched + decoded == depth and (fetched > 0) == (depth >= 2)
    got = read_all(stream)
    assert all(torch.equal(got[k], reference[k]) for k in reference)
    shuffled = read_all(stream, shuffle=True, seed=3, epoch=1)
    assert sorted(shuffled["id"].tolist()) == list(range(COUNTS["train"]))
    assert torch.equal(shuffled["x"][torch.argsort(shuffled["id"])], reference["x"])


def test_prefetch_max_bytes_caps_both_stages_together(zarr_entry: Path) -> None:
    stream = StoredStream(zarr_entry, prefetch_depth=8, prefetch_max_bytes=3 * 16 * PER_SAMPLE)
    assert stream.read_ahead("train") == 3 and stream.stage_depths("train") == (1, 2)
    # queued (3) + in flight: fetch 1 + decode 2 + consumer 1, plus the window
    chunk = stream.chunk_bytes("train")
    assert stream.memory_bound("train", shuffle=False) >= 7 * chunk
    assert stream.memory_bound("train") == stream.memory_bound("train", shuffle=False) + 4 * chunk


def test_corrupt_chunk_in_a_prefetched_training_read_names_it(tmp_path: Path) -> None:
    build(tmp_path)
    victim = ZarrReader(tmp_path / ZARR_DIR).chunk_key("train/x", 5)
    path = tmp_path / ZARR_DIR / victim
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    stream = StoredStream(tmp_path, prefetch_depth=4)
    with pytest.raises(CorruptChunkError, match=r"corrupt chunk 5 of array 'train/x'") as info:
        read_all(stream, shuffle=True, seed=1)
    assert info.value.chunk == 5 and info.value.array == "train/x"
    path.unlink()  # a lost chunk file is named the same way, by the fetch stage
    with pytest.raises(CorruptChunkError, match="chunk 5 of array 'train/x'.*missing"):
        read_all(stream)


def test_abandoning_a_read_stops_both_threads(zarr_entry: Path) -> None:
    stream = StoredStream(zarr_entry, prefetch_depth=4, throttle="ssd")
    it = stream.open("train", shuffle=True)
    next(it)
    it.close()
    deadline = time.monotonic() + 5
    while any(t.name.startswith(("fetch-", "decode-")) for t in threading.enumerate()):
        assert time.monotonic() < deadline, " ".join(t.name for t in threading.enumerate())
        time.sleep(0.01)


def reader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("fetch-", "decode-"))]


def wait_until(condition: object, what: str) -> None:
    deadline = time.monotonic() + 5
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def recording_fetches(stream: StoredStream) -> list[int]:
    """Chunk indices of ``stream``'s train split in the order its reader fetches them."""
    fetched: list[int] = []
    real = stream.reader.fetch_chunk

    def fetch_chunk(split: str, index: int) -> object:
        if split == "train":
            fetched.append(index)
        return real(split, index)

    stream.reader.fetch_chunk = fetch_chunk
    return fetched


def test_a_training_pass_read_to_its_end_reads_on_into_the_next_epoch(zarr_entry: Path) -> None:
    stream = StoredStream(zarr_entry, prefetch_depth=2)
    fetched = recording_fetches(stream)
    n = stream.reader.num_chunks("train")
    order = {e: stream._shuffled_order("train", 3, e).tolist() for e in (1, 2)}
    first = read_all(stream, shuffle=True, seed=3, epoch=1)
    # Before epoch 2 is asked for, its first chunks are being read already.
    wait_until(lambda: len(fetched) > n, "epoch 2's first chunk was not read ahead")
    second = read_all(stream, shuffle=True, seed=3, epoch=2)
    assert fetched[: 2 * n] == order[1] + order[2]  # each chunk once, epoch 2's taken over as read
    fresh = StoredStream(zarr_entry, prefetch_depth=2)
    for epoch, got in ((1, first), (2, second)):
        want = read_all(fresh, shuffle=True, seed=3, epoch=epoch)
        assert all(torch.equal(got[k], want[k]) for k in want)
    stream.close()
    fresh.close()
    wait_until(lambda: not reader_threads(), f"reader threads left: {reader_threads()}")


def test_a_read_on_nobody_takes_over_is_stopped(zarr_entry: Path) -> None:
    stream = StoredStream(zarr_entry, prefetch_depth=2)
    reference = StoredStream(zarr_entry, prefetch_depth=0)  # no reader threads, no read-on
    read_all(stream, shuffle=True, seed=3, epoch=1)
    # Another epoch than the one read ahead: read afresh, the stale read-on stopped.
    got = read_all(stream, shuffle=True, seed=3, epoch=5)
    want = read_all(reference, shuffle=True, seed=3, epoch=5)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert stream._read_on["train"][:2] == (3, 6)
    # So does another seed, or an unshuffled pass of the split.
    read_all(stream, shuffle=True, seed=4, epoch=6)
    assert stream._read_on["train"][:2] == (4, 7)
    read_all(stream)
    assert "train" not in stream._read_on
    # Abandoning a pass midway reads nothing on; dropping the stream stops the read-on it had.
    it = stream.open("train", shuffle=True, seed=4, epoch=0)
    next(it)
    it.close()
    assert "train" not in stream._read_on
    read_all(stream, shuffle=True, seed=4, epoch=0)
    assert "train" in stream._read_on
    del stream
    wait_until(lambda: not reader_threads(), f"reader threads left: {reader_threads()}")
    # Unshuffled passes (evaluation) never read on.
    evaluation = StoredStream(zarr_entry, prefetch_depth=2)
    read_all(evaluation, "val")
    assert not evaluation._read_on


# ---------------------------------------------------------------------------- splits held in memory


@pytest.mark.parametrize("fmt", ["zarr", "hdf5"])
def test_a_split_kept_in_memory_is_read_once_and_gives_the_same_epochs(
    zarr_entry: Path, h5_entry: Path, fmt: str
) -> None:
    entry = zarr_entry if fmt == "zarr" else h5_entry
    disk = StoredStream(entry, prefetch_depth=0)  # the reference: no reader threads of its own
    held = StoredStream(entry, prefetch_depth=2, keep_in_memory_bytes=1 << 30)
    fetched = recording_fetches(held)
    n = held.reader.num_chunks("train")
    unheld = StoredStream(entry, prefetch_depth=2).memory_bound("train")
    assert held.memory_bound("train") == unheld + held.held_bytes()
    assert held.held_bytes() == sum(held.split_bytes(s) for s in COUNTS)
    for epoch in range(3):
        got = read_all(held, shuffle=True, seed=3, epoch=epoch)
        want = read_all(disk, shuffle=True, seed=3, epoch=epoch)
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert held.in_memory("train")
        assert not reader_threads() or epoch == 0, reader_threads()  # held: no thread, no read-on
    assert sorted(fetched) == list(range(n))  # every chunk read once, in epoch 0
    got, want = read_all(held), read_all(disk)  # an unshuffled pass of the held split
    assert all(torch.equal(got[k], want[k]) for k in want) and len(fetched) == n
    assert held.stats.samples == 4 * COUNTS["train"]  # counted like read samples


def test_an_abandoned_first_pass_keeps_what_it_read_and_the_next_reads_the_rest(zarr_entry: Path) -> None:
    held = StoredStream(zarr_entry, prefetch_depth=0, keep_in_memory_bytes=1 << 30)
    fetched = recording_fetches(held)
    it = held.open("train")
    next(it)
    it.close()
    assert 0 < len(held._held["train"]) < held.reader.num_chunks("train") and not held.in_memory("train")
    got = read_all(held, shuffle=True, seed=1, epoch=4)
    want = read_all(StoredStream(zarr_entry, prefetch_depth=0), shuffle=True, seed=1, epoch=4)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(fetched) == list(range(held.reader.num_chunks("train")))  # none read twice


def test_splits_are_kept_train_first_within_the_budget(zarr_entry: Path) -> None:
    probe = StoredStream(zarr_entry, prefetch_depth=0)
    train, val = probe.split_bytes("train"), probe.split_bytes("val")
    assert StoredStream(zarr_entry, keep_in_memory_bytes=0)._splits_kept() == []
    assert StoredStream(zarr_entry, keep_in_memory_bytes=train)._splits_kept() == ["train"]
    assert StoredStream(zarr_entry, keep_in_memory_bytes=train - 1)._splits_kept() == ["val"]
    assert StoredStream(zarr_entry, keep_in_memory_bytes=train + val)._splits_kept() == ["train", "val"]
    # A split not kept is read from storage on every pass.
    slow = StoredStream(zarr_entry, prefetch_depth=0, throttle="sdcard", keep_in_memory_bytes=train)
    read_all(slow, "val")
    read_all(slow, "train")
    slow.throttle_device.reset_stats()
    read_all(slow, "val")
    read_all(slow, "train")
    assert slow.throttle_device.stats().reads == 3 * slow.reader.num_chunks("val")


def test_chained_prefetch_forwards_errors_from_the_inner_stage() -> None:
    def source() -> Iterator[int]:
        yield 1
        raise OSError("card removed")

    with pytest.raises(OSError, match="card removed"):
        list(prefetch((v * 2 for v in prefetch(source(), 2)), 2))


def test_fetch_overlaps_decode_on_a_throttled_read(zarr_entry: Path) -> None:
    """Every chunk file is one device command, read exactly once per pass."""
    slow = StoredStream(zarr_entry, prefetch_depth=4, throttle="sdcard")
    slow.throttle_device.reset_stats()  # opening read the zarr.json documents
    got = read_all(slow)
    stats = slow.throttle_device.stats()
    files = 3 * slow.reader.num_chunks("train")  # x, y and id: one chunk file each
    assert stats.reads == files
    assert torch.equal(got["x"], read_all(StoredStream(zarr_entry, prefetch_depth=0))["x"])


# -------------------------------------------------------------------------------- HDF5 throttle


def test_hdf5_entry_reads_through_the_simulator(h5_entry: Path, zarr_entry: Path) -> None:
    reference = read_all(StoredStream(zarr_entry, prefetch_depth=0))
    slow = StoredStream(h5_entry, prefetch_depth=2, throttle="sdcard")
    # the stored bytes are read under h5py's lock and inflated outside it: two stages, as zarr
    assert slow.stage_depths("train") == (1, 1)
    got = read_all(slow)
    assert all(torch.equal(got[k], reference[k]) for k in reference)
    stats = slow.throttle_device.stats()
    assert stats.reads > 0 and stats.bytes_read >= (h5_entry / H5_FILE).stat().st_size // 2
    assert StoredStream(h5_entry).throttle_device is None


def test_throttled_file_charges_every_read(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 4000)  # 1.024 MB
    profile = ThrottleProfile(10e6, 10e6, 0.002, 0.0, name="slow")
    with ThrottledFile(path, profile) as fh:
        t0 = time.monotonic()
        assert fh.read(500_000)[:3] == b"\x00\x01\x02"
        fh.seek(1_000_000)
        assert len(fh.read()) == 24_000
        elapsed = time.monotonic() - t0
        stats = fh.stats()
    assert stats.bytes_read == 524_000
    assert elapsed >= stats.read_busy_s >= 2 * 0.002 + 524_000 / 10e6


def test_h5py_opens_an_entry_through_a_throttled_file(h5_entry: Path) -> None:
    with ThrottledFile(h5_entry / H5_FILE, "ssd") as fh, h5py.File(fh, "r") as f:
        assert f["train/x"].shape == (COUNTS["train"], *SHAPE)
        assert fh.stats().reads > 0


# ---------------------------------------------------------------------------------- HDF5 resume


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("fail_after", [3, 20, 34])
def test_interrupted_hdf5_write_stream_resumes_bit_identical(
    tmp_path: Path, h5_entry: Path, fail_after: int
) -> None:
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path, "hdf5", Numbers(COUNTS, fail_after=fail_after))
    logged: list[str] = []
    again = Numbers(COUNTS)
    info = write_stream(
        again,
        tmp_path,
        chunk_bytes=16 * PER_SAMPLE,
        compressor="gzip",
        level=4,
        attrs={"test": True},
        fmt="hdf5",
        log=logged.append,
    )
    assert info["resumed_samples"] > 0 and any("resuming" in line for line in logged)
    assert again.opened_at[0] == info["resumed_samples"] or again.opened_at[0] % 16 == 0
    assert sha(tmp_path / H5_FILE) == sha(h5_entry / H5_FILE)
    assert sorted(p.name for p in tmp_path.iterdir()) == [H5_FILE]


def test_unusable_hdf5_leftover_is_logged_and_rebuilt(tmp_path: Path, h5_entry: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path, "hdf5", Numbers(COUNTS, fail_after=20))
    (tmp_path / H5_FILE).write_bytes(b"garbage")
    logged: list[str] = []
    with pytest.warns(UserWarning, match="cannot be opened"):
        info = write_stream(
            Numbers(COUNTS),
            tmp_path,
            chunk_bytes=16 * PER_SAMPLE,
            compressor="gzip",
            level=4,
            attrs={"test": True},
            fmt="hdf5",
            log=logged.append,
        )
    assert info["resumed_samples"] == 0 and any("starting over" in line for line in logged)
    assert sha(tmp_path / H5_FILE) == sha(h5_entry / H5_FILE)


# ------------------------------------------------------------------------- per-split chunk lengths


class PackedTrain(Stream):
    """A 2-bit-cache-like stream: small packed train samples, wide float16 val samples."""

    def __init__(self, counts: dict[str, int]) -> None:
        train = {"codes": FieldSpec((6,), "uint8"), "id": FieldSpec((), "int64")}
        val = {"x": FieldSpec((12, 8), "float16"), "id": FieldSpec((), "int64")}
        self.spec = Spec(
            STREAM, 10, {"train": SplitSpec(counts["train"], train), "val": SplitSpec(counts["val"], val)}, {}
        )
        self.stats = StreamStats()
        self.counts = counts

    def open(
        self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0, start: int = 0
    ) -> Iterator[Batch]:
        for lo in range(start, self.counts[split], 9):
            ids = torch.arange(lo, min(lo + 9, self.counts[split]))
            if split == "train":
                yield {"codes": (ids[:, None] + torch.arange(6)).to(torch.uint8), "id": ids}
            else:
                yield {"x": (ids[:, None, None] * 0.5 + torch.zeros(12, 8)).to(torch.float16), "id": ids}


def test_each_split_gets_chunks_of_about_chunk_bytes(tmp_path: Path) -> None:
    counts = {"train": 500, "val": 60}
    stream = PackedTrain(counts)
    chunk_bytes = 1000
    write_stream(stream, tmp_path, chunk_bytes=chunk_bytes, compressor="zstd", level=3, attrs={})
    reader = StoredStream(tmp_path).reader
    for split, s in stream.spec.splits.items():  # train: 14 B/sample -> 71; val: 200 B/sample -> 5
        assert reader.chunk_samples(split) == chunk_bytes // s.sample_bytes()
    assert reader.chunk_samples("train") > 10 * reader.chunk_samples("val")
    stored = StoredStream(tmp_path)
    for split, n in counts.items():
        assert read_all(stored, split)["id"].tolist() == list(range(n))
        # resuming mid-chunk: every sample from ``start`` on, exactly once
        assert read_all(stored, split, start=n // 3)["id"].tolist() == list(range(n // 3, n))
        shuffled = read_all(stored, split, shuffle=True, epoch=1)["id"]
        assert sorted(shuffled.tolist()) == list(range(n))


def test_hdf5_keeps_one_chunk_length(tmp_path: Path) -> None:
    write_stream(
        PackedTrain({"train": 100, "val": 20}),
        tmp_path,
        chunk_bytes=1000,
        compressor="gzip",
        level=4,
        attrs={},
        fmt="hdf5",
    )
    reader = StoredStream(tmp_path).reader
    assert reader.chunk_samples("train") == reader.chunk_samples("val") == 5  # sized by the widest split


def test_a_fresh_entrys_writer_errors_surface_though_it_is_created_on_the_writer_thread(
    tmp_path: Path,
) -> None:
    with pytest.raises(EntryWriteError, match=r"zstd level must be in \[-7, 22\], got 99"):
        write_stream(Numbers(COUNTS), tmp_path / "entry", chunk_bytes=1000, compressor="zstd", level=99,
                     attrs={})
    assert not [t for t in threading.enumerate() if t.name == "cache-writer"]



# ------------------------------------------------------------------------- resume on a batch boundary


class BatchShaped(Numbers):
    """Values that depend on where a batch begins, as a forward's last bits can depend on its batch."""

    def open(
        self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0, start: int = 0
    ) -> Iterator[Batch]:
        for batch in super().open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start):
            offset = float(int(batch["id"][0]) % 7)  # 0 for the batches a build from sample 0 forms
            yield {**batch, "x": batch["x"] + torch.tensor(offset, dtype=torch.float16)}


def resumed(entry: Path, batch_period: int) -> tuple[BatchShaped, dict]:
    with pytest.raises(KeyboardInterrupt):
        build(entry, stream=BatchShaped(COUNTS, fail_after=20))
    again = BatchShaped(COUNTS)
    info = build(entry, stream=again, batch_period=batch_period)
    return again, info


def test_a_resumed_build_forms_the_batches_of_an_uninterrupted_one(tmp_path: Path) -> None:
    build(tmp_path / "whole", stream=BatchShaped(COUNTS))
    whole = StoredStream(tmp_path / "whole")
    stream, info = resumed(tmp_path / "aligned", batch_period=7)
    assert info["resumed_samples"] == 128  # 8 whole chunks of 16 written: a chunk edge, not a batch edge
    assert stream.opened_at[0] % 7 == 0 and stream.opened_at[0] < info["resumed_samples"]
    aligned = StoredStream(tmp_path / "aligned")
    for split in COUNTS:
        assert torch.equal(read_all(aligned, split)["x"], read_all(whole, split)["x"])
    # Reopened at the chunk edge instead, the batches begin elsewhere and the stored values differ.
    _, info = resumed(tmp_path / "unaligned", batch_period=1)
    unaligned = read_all(StoredStream(tmp_path / "unaligned"), "train")["x"]
    assert not torch.equal(unaligned, read_all(whole, "train")["x"])
    with pytest.raises(ValueError, match="batch_period must be >= 1"):
        build(tmp_path / "bad", batch_period=0)
