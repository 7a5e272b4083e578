"""Simulate slow storage (SD card, eMMC, SSD) so cache/prefetch behaviour can be tested on a fast laptop.

A developer's NVMe disk with a warm page cache is orders of magnitude faster than the SD card a
Raspberry Pi reads its cache from, so a pipeline that "keeps up" on the laptop can starve its trainer on the
device. The throttle makes storage cost what it would on the target:

    time of one command = latency + bytes / bandwidth

and the device is **serial**: every command (from any thread, any wrapped store sharing the
same :class:`ThrottleDevice`) is booked on one device timeline, like commands queued on a real
card. Without that, N prefetch threads would each get the full bandwidth and the simulation
would reward parallelism the hardware cannot deliver.

How the clock works: a command first does the real I/O (on the local disk, normally fast),
then books ``cost`` seconds on the device timeline starting at ``max(requested_at, busy_until)``
and sleeps until that booking ends. So

- total wall-clock time of a run is >= the sum of command costs (never optimistic), and
- a consumer's compute between commands counts as device idle time, exactly as on real
  hardware; overlap happens only where the pipeline really overlaps (prefetch threads).

The sleep is precise: ``time.sleep`` until shortly before the deadline, then yield the GIL in a
short ``sleep(0)`` loop, so a sleep ends just after its deadline instead of after plain
``time.sleep``'s timer-slack overshoot, and never before it. Residual overshoot is counted as
device idle time, so the simulation can only err on the slow side. :class:`ThrottleStats`
(``device.stats()``) reports commands, bytes, and booked device time so a benchmark can report
achieved bandwidth.

Profiles (decimal MB = 1e6 bytes, as storage vendors quote them)
----------------------------------------------------------------
``sdcard``  20 MB/s read, 10 MB/s write, 1.5 ms read / 2.0 ms write latency per command.
            A decent UHS-I U1/A1 card in a Raspberry Pi 3/4: the Pi's SDIO bus caps sequential
            reads around 40-45 MB/s in the best case, typical sustained reads of a mid-range
            card are ~20 MB/s; sustained writes of ~10 MB/s are the "Class 10/U1" guarantee.
            The A1 class promises >= 1500 random-read IOPS (0.67 ms) and >= 500 random-write IOPS
            (2 ms); real cards at queue depth 1 behind the Linux block layer measure 1-2 ms per
            small random read, hence 1.5 ms.
``emmc``    150 MB/s read, 60 MB/s write, 0.3 ms / 0.5 ms. An eMMC 5.x module (Jetson Nano,
            Raspberry Pi CM4): HS200 reads measure 150-250 MB/s, writes 50-100 MB/s, with
            sub-millisecond command latency. The low ends are used so results stay conservative.
``ssd``     500 MB/s read, 400 MB/s write, 0.05 ms / 0.08 ms. A SATA SSD or a good USB 3 SSD
            (the SATA link caps at ~550 MB/s); 50-100 us per small command. NVMe would be faster
            still, but edge boards rarely have it.

Custom devices: ``ThrottleProfile(read_bytes_per_s, write_bytes_per_s, read_latency_s,
write_latency_s)``.

Zarr entries are throttled by their reader (``ZarrReader(path, throttle=...)`` books every
chunk and metadata file it reads); HDF5 entries read through :class:`ThrottledFile`, a
read-only binary file object that ``h5py.File(ThrottledFile(path, "sdcard"), "r")`` accepts:
each ``read``/``readinto`` HDF5 issues (superblock, object headers, B-tree nodes, one whole
chunk) is one read command.

What is and is not modelled: data transfers (chunk and metadata file reads, HDF5 reads) are
throttled. Metadata-only operations (``exists``, listing, ``stat``) are not: the kernel caches
directory entries, so on a real card they rarely wait on the device. Throttling is per process:
a device pickled into another process (spawn, dask workers) starts a fresh, independent clock
there, so multi-process readers are optimistic.
Read-ahead, caching and flash garbage collection are not simulated.

Running on a REAL SD card instead
---------------------------------
The simulator is for quick, reproducible comparisons; confirm conclusions on hardware:

1. Mount the card (e.g. ``/media/sd``) and point the cache there: ``--store /media/sd/cache``
   (or ``Catalog("/media/sd/cache")``). ext4 mounted with ``noatime`` avoids a metadata write on
   every read (``sudo mount -o remount,noatime /media/sd``); exFAT/vfat cards work but have no
   journal, so prefer ext4 for a cache that must survive power loss. Do not use ``sync`` as a mount
   option: it makes every write synchronous and is far slower than the explicit fsyncs the stores do.
2. Drop the page cache between epochs to measure cold reads, otherwise the second epoch is
   served from RAM: ``sync; echo 3 | sudo tee /proc/sys/vm/drop_caches`` (as root:
   ``sync; echo 3 > /proc/sys/vm/drop_caches``).
3. Check the card's raw numbers first: ``fio --name=seq --filename=/media/sd/t --rw=read --bs=1M
   --size=256M --direct=1`` and ``--rw=randread --bs=4k`` for latency, and compare with the
   profile above (or build a custom :class:`ThrottleProfile` from them).
"""

from __future__ import annotations

import difflib
import io
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from stores.errors import StoreError

__all__ = [
    "PROFILES",
    "ThrottleConfigError",
    "ThrottleDevice",
    "ThrottleProfile",
    "ThrottleStats",
    "ThrottledFile",
    "get_profile",
    "sleep_until",
]

_MB = 1_000_000
# Sleep until this long before a deadline, then yield in a sleep(0) loop: time.sleep overshoots by
# the kernel's timer slack, which would add up over thousands of short commands.
_SPIN_S = 0.0005


class ThrottleConfigError(StoreError, ValueError):
    """A throttle profile is unknown or has impossible numbers (non-positive bandwidth, negative latency)."""


@dataclass(frozen=True)
class ThrottleProfile:
    """Speed of a simulated device; bandwidths in bytes/s (``math.inf`` = unlimited), latencies in s."""

    read_bytes_per_s: float
    write_bytes_per_s: float
    read_latency_s: float = 0.0
    write_latency_s: float = 0.0
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("read_bytes_per_s", "write_bytes_per_s"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or not value > 0:
                raise ThrottleConfigError(
                    f"throttle profile {self.name!r}: {field} must be a number > 0 (bytes per second), "
                    f"got {value!r}"
                )
        for field in ("read_latency_s", "write_latency_s"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or not (0 <= value < math.inf):
                raise ThrottleConfigError(
                    f"throttle profile {self.name!r}: {field} must be a finite number >= 0 (seconds), "
                    f"got {value!r}"
                )

    def read_seconds(self, nbytes: int) -> float:
        """Device time of one read command transferring ``nbytes``."""
        return self.read_latency_s + nbytes / self.read_bytes_per_s

    def write_seconds(self, nbytes: int) -> float:
        """Device time of one write command transferring ``nbytes``."""
        return self.write_latency_s + nbytes / self.write_bytes_per_s


PROFILES: dict[str, ThrottleProfile] = {
    "sdcard": ThrottleProfile(20 * _MB, 10 * _MB, 0.0015, 0.002, name="sdcard"),
    "emmc": ThrottleProfile(150 * _MB, 60 * _MB, 0.0003, 0.0005, name="emmc"),
    "ssd": ThrottleProfile(500 * _MB, 400 * _MB, 0.00005, 0.00008, name="ssd"),
}


def get_profile(profile: ThrottleProfile | str) -> ThrottleProfile:
    """Resolve a profile name ('sdcard', 'emmc', 'ssd') or pass a :class:`ThrottleProfile` through."""
    if isinstance(profile, ThrottleProfile):
        return profile
    if isinstance(profile, str) and profile in PROFILES:
        return PROFILES[profile]
    hint = ""
    if isinstance(profile, str):
        hit = difflib.get_close_matches(profile, list(PROFILES), n=1, cutoff=0.5)
        hint = f" (did you mean {hit[0]!r}?)" if hit else ""
    raise ThrottleConfigError(
        f"unknown throttle profile {profile!r}{hint}; use one of {sorted(PROFILES)} "
        "or a ThrottleProfile(read_bytes_per_s, write_bytes_per_s, read_latency_s, write_latency_s)"
    )


def sleep_until(deadline: float) -> None:
    """Block until ``time.monotonic() >= deadline``, accurate to a few microseconds, never early."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        time.sleep(remaining - _SPIN_S if remaining > _SPIN_S else 0)


@dataclass(frozen=True)
class ThrottleStats:
    """A snapshot of one device's accounting since creation or the last ``reset_stats()``.

    ``*_busy_s`` is booked device time (sum of command costs), ``waited_s`` the total time callers
    spent blocked in the throttle (including queueing behind other threads; it can exceed the busy
    time when threads overlap), ``span_s`` the device timeline from the first command's start to
    the last one's end.
    """

    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_busy_s: float = 0.0
    write_busy_s: float = 0.0
    waited_s: float = 0.0
    span_s: float = 0.0

    @property
    def busy_s(self) -> float:
        return self.read_busy_s + self.write_busy_s

    @property
    def read_bytes_per_s(self) -> float:
        """Achieved read bandwidth over the device time spent reading (latency included)."""
        return self.bytes_read / self.read_busy_s if self.read_busy_s else 0.0

    @property
    def write_bytes_per_s(self) -> float:
        """Achieved write bandwidth over the device time spent writing (latency included)."""
        return self.bytes_written / self.write_busy_s if self.write_busy_s else 0.0

    @property
    def utilisation(self) -> float:
        """Fraction of the timeline the device was busy; low values mean the reader, not storage, limits."""
        return self.busy_s / self.span_s if self.span_s else 0.0


class ThrottleDevice:
    """One simulated serial device: a lock-protected timeline every command is booked on.

    Share one instance between readers (``ZarrReader(path, throttle=device)``,
    ``ThrottledFile(path, device)``) that model the same physical card.
    """

    def __init__(self, profile: ThrottleProfile | str = "sdcard") -> None:
        self.profile = get_profile(profile)
        self._lock = threading.Lock()
        self._busy_until = 0.0
        self._first_start: float | None = None
        self._stats = ThrottleStats()

    def __repr__(self) -> str:
        return f"ThrottleDevice({self.profile!r})"

    def __reduce__(self) -> tuple[type[ThrottleDevice], tuple[ThrottleProfile]]:
        # A lock and a monotonic clock mean nothing in another process: rebuild a fresh device there.
        return (type(self), (self.profile,))

    def book(self, kind: Literal["read", "write"], nbytes: int, requested_at: float | None = None) -> float:
        """Book one command on the timeline and return the monotonic time it completes; does not sleep.

        ``requested_at`` is when the caller issued the command (before doing the real I/O), so
        the real I/O time overlaps the simulated time instead of adding to it.
        """
        if kind not in ("read", "write"):
            raise ThrottleConfigError(f"command kind must be 'read' or 'write', got {kind!r}")
        if nbytes < 0:
            raise ThrottleConfigError(f"a {kind} command cannot transfer {nbytes} bytes")
        now = time.monotonic()
        requested_at = now if requested_at is None else min(requested_at, now)
        p = self.profile
        cost = p.read_seconds(nbytes) if kind == "read" else p.write_seconds(nbytes)
        with self._lock:
            start = max(requested_at, self._busy_until)
            end = start + cost
            self._busy_until = end
            if self._first_start is None:
                self._first_start = start
            s = self._stats
            if kind == "read":
                self._stats = replace(
                    s, reads=s.reads + 1, bytes_read=s.bytes_read + nbytes, read_busy_s=s.read_busy_s + cost
                )
            else:
                self._stats = replace(
                    s,
                    writes=s.writes + 1,
                    bytes_written=s.bytes_written + nbytes,
                    write_busy_s=s.write_busy_s + cost,
                )
        return end

    def _waited(self, requested_at: float) -> None:
        waited = time.monotonic() - requested_at
        with self._lock:
            self._stats = replace(self._stats, waited_s=self._stats.waited_s + waited)

    def read(self, nbytes: int, requested_at: float | None = None) -> None:
        """Account a read of ``nbytes`` and block the calling thread until the device has served it."""
        t0 = time.monotonic() if requested_at is None else requested_at
        sleep_until(self.book("read", nbytes, t0))
        self._waited(t0)

    def write(self, nbytes: int, requested_at: float | None = None) -> None:
        """Account a write of ``nbytes`` and block the calling thread until the device has stored it."""
        t0 = time.monotonic() if requested_at is None else requested_at
        sleep_until(self.book("write", nbytes, t0))
        self._waited(t0)

    def read_many(self, sizes: Iterable[int], requested_at: float | None = None) -> None:
        """Account one read command per size, queued back to back (a chunk's files, a file's
        metadata documents), and block until the device has served the last one."""
        t0 = time.monotonic() if requested_at is None else requested_at
        sleep_until(max((self.book("read", n, t0) for n in sizes), default=t0))
        self._waited(t0)

    @property
    def busy_until(self) -> float:
        """Monotonic time at which the device finishes everything booked so far."""
        with self._lock:
            return self._busy_until

    def stats(self) -> ThrottleStats:
        """A consistent snapshot of the counters (``span_s`` measured up to the last booked command)."""
        with self._lock:
            span = 0.0 if self._first_start is None else self._busy_until - self._first_start
            return replace(self._stats, span_s=span)

    def reset_stats(self) -> ThrottleStats:
        """Zero the counters (e.g. between a warm-up and a measured epoch); returns the old snapshot."""
        old = self.stats()
        with self._lock:
            self._stats = ThrottleStats()
            self._first_start = None
        return old


def as_device(profile: ThrottleProfile | str | ThrottleDevice) -> ThrottleDevice:
    """A device to book commands on: the given one (shared clock) or a new one for a profile."""
    return profile if isinstance(profile, ThrottleDevice) else ThrottleDevice(profile)


class ThrottledFile(io.RawIOBase):
    """A read-only binary file whose reads cost what they would on a slow device.

    For HDF5 (h5py's file-object driver calls ``readinto``/``seek``/``tell``): every read
    is one command of the bytes actually returned, booked on ``profile``'s device timeline
    (share a :class:`ThrottleDevice` to model several files on one card). Seeking is free,
    as the kernel does not touch the card for it.
    """

    def __init__(
        self, path: str | os.PathLike[str], profile: ThrottleProfile | str | ThrottleDevice = "sdcard"
    ):
        super().__init__()
        self.path = Path(path)
        self.device = as_device(profile)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))

    def __repr__(self) -> str:
        return f"ThrottledFile('{self.path}', {self.device.profile.name!r})"

    @property
    def name(self) -> str:
        return str(self.path)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        return os.lseek(self._fd, offset, whence)

    def tell(self) -> int:
        return self.seek(0, io.SEEK_CUR)

    def readinto(self, buffer: Any) -> int:
        self._checkClosed()
        t0 = time.monotonic()
        n = os.readv(self._fd, [buffer])
        if n:
            self.device.read(n, t0)
        return n

    def stats(self) -> ThrottleStats:
        return self.device.stats()

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()
