"""Throttle tests assert LOWER bounds only (simulated device time, and wall time >= simulated time):
upper bounds on wall-clock time would make the suite flaky on a loaded CI machine."""

from __future__ import annotations

import asyncio
import inspect
import pickle
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.abc.store import RangeByteRequest
from zarr.core.buffer import default_buffer_prototype

from stores.local import LocalStore
from stores.testing import StoreTests
from stores.throttle import (
    PROFILES,
    ThrottleConfigError,
    ThrottleDevice,
    ThrottledStore,
    ThrottledZarrStore,
    ThrottleProfile,
    get_profile,
    sleep_until,
)
from stores.zarr_entry import ArraySpec, ZarrReader, ZarrWriter

# Slow enough that the bounds below are meaningful, fast enough to keep the file well under 5 s.
SLOW = ThrottleProfile(
    read_bytes_per_s=1_000_000,
    write_bytes_per_s=2_000_000,
    read_latency_s=0.001,
    write_latency_s=0.002,
    name="slow",
)
FAST = ThrottleProfile(1e12, 1e12, 0.0, 0.0, name="fast")
# Device times are differences of monotonic timestamps, so allow float rounding (not slack).
EPS = 1e-9


class TestThrottledStore(StoreTests):
    """The wrapper is itself a conforming Store."""

    def make_store(self, tmp_path: Path) -> ThrottledStore:
        return ThrottledStore(LocalStore(tmp_path / "s"), FAST)

    def reopen_read_only(self, store: ThrottledStore, tmp_path: Path) -> ThrottledStore:  # type: ignore[override]
        return ThrottledStore(LocalStore(tmp_path / "s", read_only=True), store.device)


def test_profiles_are_documented_numbers() -> None:
    sd, emmc, ssd = PROFILES["sdcard"], PROFILES["emmc"], PROFILES["ssd"]
    assert (sd.read_bytes_per_s, sd.write_bytes_per_s, sd.read_latency_s) == (20e6, 10e6, 0.0015)
    assert (emmc.read_bytes_per_s, emmc.read_latency_s) == (150e6, 0.0003)
    assert (ssd.read_bytes_per_s, ssd.read_latency_s) == (500e6, 0.00005)
    assert sd.read_seconds(20_000_000) == pytest.approx(1.0015)
    assert get_profile("emmc") is emmc and get_profile(SLOW) is SLOW


def test_bad_profiles_are_explained() -> None:
    with pytest.raises(ThrottleConfigError, match="unknown throttle profile 'sdcrad'.*did you mean 'sdcard'"):
        get_profile("sdcrad")
    with pytest.raises(ValueError, match="read_bytes_per_s must be a number > 0"):
        ThrottleProfile(0, 1)
    with pytest.raises(ValueError, match="write_latency_s must be a finite number >= 0"):
        ThrottleProfile(1, 1, 0, -0.1)


def test_sleep_until_is_never_early() -> None:
    for delay in [0.0, 0.0001, 0.0004, 0.0007, 0.002, 0.0]:
        deadline = time.monotonic() + delay
        sleep_until(deadline)
        assert time.monotonic() >= deadline


def test_reading_takes_at_least_bytes_over_bandwidth(tmp_path: Path) -> None:
    store = ThrottledStore(LocalStore(tmp_path / "s"), SLOW)
    value = bytes(10_000)
    for i in range(10):
        store.set(f"k/{i}", value)
    written = store.device.reset_stats()
    assert written.writes == 10 and written.bytes_written == 100_000
    assert written.write_busy_s >= 100_000 / SLOW.write_bytes_per_s + 10 * SLOW.write_latency_s - EPS

    t0 = time.monotonic()
    for i in range(10):
        assert store.get(f"k/{i}") == value
    elapsed = time.monotonic() - t0
    stats = store.stats()
    expected = 100_000 / SLOW.read_bytes_per_s + 10 * SLOW.read_latency_s  # 0.11 s
    assert stats.reads == 10 and stats.bytes_read == 100_000 and stats.writes == 0
    assert stats.read_busy_s == pytest.approx(expected)
    assert stats.span_s >= expected - EPS and elapsed >= expected and stats.waited_s >= expected - EPS
    assert stats.read_bytes_per_s == pytest.approx(100_000 / expected)


def test_concurrent_readers_share_one_serial_device(tmp_path: Path) -> None:
    """Four prefetch threads must not get four times the bandwidth."""
    store = ThrottledStore(LocalStore(tmp_path / "s"), SLOW)
    for i in range(20):
        store.set(f"k/{i}", bytes(10_000))
    store.device.reset_stats()

    def reader(first: int) -> None:
        for i in range(first, 20, 4):
            store.get(f"k/{i}")

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    stats = store.stats()
    serial = 200_000 / SLOW.read_bytes_per_s + 20 * SLOW.read_latency_s  # 0.22 s
    assert stats.reads == 20 and stats.bytes_read == 200_000
    assert elapsed >= serial and stats.span_s >= serial - EPS
    assert stats.waited_s >= stats.busy_s - EPS  # every caller waited at least for its own command


def test_metadata_and_absent_keys_are_free(tmp_path: Path) -> None:
    store = ThrottledStore(LocalStore(tmp_path / "s"), SLOW)
    store.set("a", b"x")
    store.device.reset_stats()
    assert store.get("missing") is None
    assert store.exists("a") and list(store.list_prefix("")) == ["a"]
    store.delete("a")
    stats = store.stats()
    assert (stats.reads, stats.writes, stats.busy_s) == (0, 0, 0.0)


def test_many_short_commands_do_not_lose_time(tmp_path: Path) -> None:
    """Latency-dominated traffic (small random reads) must add up, not vanish in sleep granularity."""
    device = ThrottleDevice(ThrottleProfile(1e12, 1e12, read_latency_s=0.0005, write_latency_s=0.0))
    t0 = time.monotonic()
    for _ in range(200):
        device.read(16)
    elapsed = time.monotonic() - t0
    stats = device.stats()
    assert stats.reads == 200 and stats.read_busy_s == pytest.approx(0.1)
    assert elapsed >= 0.1 and stats.span_s >= 0.1 - EPS


def test_device_pickles_as_a_fresh_clock() -> None:
    device = ThrottleDevice("sdcard")
    device.book("read", 1000)
    clone = pickle.loads(pickle.dumps(device))
    assert clone.profile == PROFILES["sdcard"] and clone.stats().reads == 0
    store = pickle.loads(pickle.dumps(ThrottledStore(LocalStore("/tmp"), device)))
    assert store.profile.name == "sdcard"


def _write_zarr(path: Path) -> np.ndarray:
    data = np.arange(40 * 100, dtype=np.int32).reshape(40, 100)
    with ZarrWriter(path, {"train/x": ArraySpec((100,), "int32")}, 40, 8, compressor="none") as writer:
        writer.write("train", {"x": data})
    return data


def _chunk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "train" / "x" / "c").rglob("*") if p.is_file())


def test_throttled_zarr_store_reads_through_the_device(tmp_path: Path) -> None:
    data = _write_zarr(tmp_path / "e")
    store = ThrottledZarrStore(tmp_path / "e", SLOW, read_only=True)
    t0 = time.monotonic()
    array = zarr.open_group(store=store, mode="r")["train/x"]
    assert isinstance(array, zarr.Array)
    np.testing.assert_array_equal(array[:], data)
    elapsed = time.monotonic() - t0
    stats = store.stats()
    chunks = _chunk_bytes(tmp_path / "e")
    assert chunks > 16_000  # 40 x 100 int32, uncompressed, plus checksums
    assert stats.bytes_read >= chunks and stats.reads >= 5  # 5 chunks plus metadata documents
    assert stats.read_busy_s >= chunks / SLOW.read_bytes_per_s + 5 * SLOW.read_latency_s - EPS
    assert elapsed >= stats.read_busy_s - EPS  # serial device, though zarr fetches chunks concurrently
    assert stats.writes == 0


def test_throttled_zarr_store_writes_and_sync_api(tmp_path: Path) -> None:
    store = ThrottledZarrStore(tmp_path / "z", SLOW)
    arr = zarr.create_array(
        store=store, name="a", shape=(1000,), chunks=(250,), dtype="uint8", compressors=None
    )
    arr[:] = np.arange(1000) % 251
    stats = store.stats()
    assert stats.bytes_written >= 1000 and stats.write_busy_s >= 1000 / SLOW.write_bytes_per_s - EPS
    proto = default_buffer_prototype()
    store.set_sync("raw", proto.buffer.from_bytes(b"12345"))
    assert store.get_sync("raw").to_bytes() == b"12345"  # type: ignore[union-attr]
    before = store.stats()
    parts = asyncio.run(
        store.get_partial_values(proto, [("raw", RangeByteRequest(0, 2)), ("raw", RangeByteRequest(3, 5))])
    )
    assert [p.to_bytes() for p in parts if p is not None] == [b"12", b"45"]
    after = store.stats()
    assert after.reads - before.reads == 2 and after.bytes_read - before.bytes_read == 4


def test_read_only_copy_shares_the_device_and_pickles(tmp_path: Path) -> None:
    _write_zarr(tmp_path / "e")
    store = ThrottledZarrStore(tmp_path / "e", "sdcard")
    ro = store.with_read_only(True)
    assert ro.read_only and ro.device is store.device
    clone = pickle.loads(pickle.dumps(ro))
    assert clone.read_only and clone.device.profile == PROFILES["sdcard"] and clone.device is not ro.device
    assert "sdcard" in repr(clone)


@pytest.mark.skipif(
    "zarr_store" not in inspect.signature(ZarrReader).parameters,
    reason="ZarrReader(zarr_store=...) is not available yet",
)
def test_zarr_reader_through_throttled_store(tmp_path: Path) -> None:
    data = _write_zarr(tmp_path / "e")
    store = ThrottledZarrStore(tmp_path / "e", SLOW, read_only=True)
    reader = ZarrReader(tmp_path / "e", zarr_store=store)  # type: ignore[call-arg]
    np.testing.assert_array_equal(reader.read("train", "x"), data)
    assert store.stats().bytes_read >= _chunk_bytes(tmp_path / "e")
