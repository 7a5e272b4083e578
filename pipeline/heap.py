"""Keep freed memory in the process heap (glibc), so torch's large CPU buffers are reused.

glibc serves every allocation above its mmap threshold (dynamic, at most 32 MiB on 64-bit)
with a fresh ``mmap`` and gives it back with ``munmap`` when freed. A frozen MobileNetV2
forward on 32 images at 224 px allocates activations of 50-150 MiB per layer, so every batch
maps about 2 GB anew and the kernel zero-fills it page by page: about 490k minor page faults
per batch, which on a virtual machine cost as much CPU time as the convolutions (profiled in
issue 2). With mmap'd allocations and heap trimming off, freed blocks stay in the heap and
the next batch reuses them: no faults.

The price is that the heap never shrinks: the resident size stays at its peak (which a
training loop reaches anyway in every batch) and a fragmented heap can hold a little more
(``python -m benchmarks.bench_heap``: frozen forward 3.1x faster, peak RSS 1.21x). The
toolkit exists to make small machines fast, so ``run`` keeps the heap by default; a user
short of RAM opts out with ``ONDEVICE_TL_KEEP_HEAP=0``.
"""

from __future__ import annotations

import ctypes
import sys

from .switches import switch

ENV = "ONDEVICE_TL_KEEP_HEAP"
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_heap_requested() -> bool:
    """True unless ``ONDEVICE_TL_KEEP_HEAP=0``; ValueError naming the variable for any other value."""
    return switch(ENV)


_applied = False


def heap_kept() -> bool:
    """True once :func:`keep_freed_heap` has been applied in this process."""
    return _applied


def keep_freed_heap() -> bool:
    """Turn off mmap'd allocations and heap trimming; True if applied (Linux with glibc only).

    Call it before the first large allocation: blocks mapped earlier are still unmapped on free.
    Calling it again is harmless (the settings are process-wide and stay).
    """
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # trim threshold: the largest int (never trim); mmap max 0: every block comes from the heap
    _applied = bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(M_MMAP_MAX, 0))
    return _applied
