"""Throttle tests assert LOWER bounds only (simulated device time, and wall time >= simulated time):
upper bounds on wall-clock time would make the suite flaky on a loaded CI machine."""

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from stores.throttle import (
    PROFILES,
    ThrottleConfigError,
    ThrottleDevice,
    ThrottledFile,
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


def _blob(tmp_path: Path, name: str, size: int) -> Path:
    path = tmp_path / name
    path.write_bytes(bytes(size))
    return path


def test_reading_takes_at_least_bytes_over_bandwidth(tmp_path: Path) -> None:
    path = _blob(tmp_path, "f", 100_000)
    t0 = time.monotonic()
    with ThrottledFile(path, SLOW) as f:
        for _ in range(10):
            assert len(f.read(10_000)) == 10_000
        stats = f.stats()
    elapsed = time.monotonic() - t0
    expected = 100_000 / SLOW.read_bytes_per_s + 10 * SLOW.read_latency_s
    assert stats.reads == 10 and stats.bytes_read == 100_000 and stats.writes == 0
    assert stats.read_busy_s == pytest.approx(expected)
    assert stats.span_s >= expected - EPS and elapsed >= expected and stats.waited_s >= expected - EPS
    assert stats.read_bytes_per_s == pytest.approx(100_000 / expected)


def test_concurrent_readers_share_one_serial_device(tmp_path: Path) -> None:
    """Four prefetch threads must not get four times the bandwidth."""
    device = ThrottleDevice(SLOW)
    paths = [_blob(tmp_path, f"f{i}", 50_000) for i in range(4)]

    def reader(path: Path) -> None:
        with ThrottledFile(path, device) as f:
            while f.read(10_000):
                pass

    threads = [threading.Thread(target=reader, args=(p,)) for p in paths]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    stats = device.stats()
    serial = 200_000 / SLOW.read_bytes_per_s + 20 * SLOW.read_latency_s
    assert stats.reads == 20 and stats.bytes_read == 200_000
    assert elapsed >= serial and stats.span_s >= serial - EPS
    assert stats.waited_s >= stats.busy_s - EPS  # every caller waited at least for its own command


def test_seeking_and_end_of_file_are_free(tmp_path: Path) -> None:
    with ThrottledFile(_blob(tmp_path, "f", 100), SLOW) as f:
        f.seek(100)
        assert f.tell() == 100 and f.read(10) == b""
        stats = f.stats()
    assert (stats.reads, stats.writes, stats.busy_s) == (0, 0, 0.0)


def test_read_many_books_commands_back_to_back() -> None:
    device = ThrottleDevice(SLOW)
    t0 = time.monotonic()
    device.read_many([1000, 2000, 0])
    elapsed = time.monotonic() - t0
    stats = device.stats()
    expected = 3000 / SLOW.read_bytes_per_s + 3 * SLOW.read_latency_s
    assert stats.reads == 3 and stats.bytes_read == 3000
    assert stats.read_busy_s == pytest.approx(expected) and elapsed >= expected


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


def _write_zarr(path: Path) -> np.ndarray:
    data = np.arange(40 * 100, dtype=np.int32).reshape(40, 100)
    with ZarrWriter(path, {"train/x": ArraySpec((100,), "int32")}, 40, 8, compressor="none") as writer:
        writer.write("train", {"x": data})
    return data


def _chunk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "train" / "x" / "c").rglob("*") if p.is_file())


def test_zarr_reader_reads_through_the_device(tmp_path: Path) -> None:
    data = _write_zarr(tmp_path / "e")
    t0 = time.monotonic()
    reader = ZarrReader(tmp_path / "e", throttle=SLOW)
    np.testing.assert_array_equal(reader.read("train", "x"), data)
    chunks_read = [reader.read_chunk("train", i)["x"] for i in range(5)]
    np.testing.assert_array_equal(np.concatenate(chunks_read), data)
    elapsed = time.monotonic() - t0
    assert reader.device is not None
    stats = reader.device.stats()
    chunks = _chunk_bytes(tmp_path / "e")
    assert chunks > 16_000  # 40 x 100 int32, uncompressed, plus checksums
    assert stats.bytes_read >= 2 * chunks and stats.reads >= 10  # both passes, plus metadata documents
    assert stats.read_busy_s >= 2 * (chunks / SLOW.read_bytes_per_s + 5 * SLOW.read_latency_s) - EPS
    assert elapsed >= stats.read_busy_s - EPS
    assert stats.writes == 0


def test_unthrottled_zarr_reader_has_no_device(tmp_path: Path) -> None:
    _write_zarr(tmp_path / "e")
    assert ZarrReader(tmp_path / "e").device is None
