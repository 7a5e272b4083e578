"""Keep freed memory in the process heap (glibc), so torch's large CPU buffers are reused.

glibc serves every allocation above its mmap threshold (dynamic, at most 32 MiB on 64-bit)
with a fresh ``mmap`` and gives it back with ``munmap`` when freed. A frozen forward's
activations are far above it, so every batch maps its buffers anew and the kernel zero-fills
them page by page: on a virtual machine those minor page faults cost as much CPU time as the
convolutions. With mmap'd allocations and heap trimming off, freed blocks stay in the heap and
the next batch reuses them: no faults.

Kept because it pays: ``python -m benchmarks.bench_heap`` (numbers in benchmarks/README.md,
``heap``) measures the frozen forward several times faster for a modestly larger peak RSS. The
price is that the heap never shrinks: the resident size stays at its peak (which a training
loop reaches anyway in every batch). The toolkit exists to make small machines fast, so ``run``
keeps the heap by default; a user short of RAM opts out with ``ONDEVICE_TL_KEEP_HEAP=0``. The
switch is read and applied in one place, :func:`pipeline.switches.apply_process_settings`.
"""

from __future__ import annotations

import ctypes
import sys

ENV = "ONDEVICE_TL_KEEP_HEAP"
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


_applied = False


def heap_kept() -> bool:
    """True once :func:`keep_freed_heap` has been applied in this process."""
    return _applied


def keep_freed_heap() -> bool:
    """Turn off mmap'd allocations and heap trimming; True if applied (Linux with glibc only).

    Call it before the first large allocation: blocks mapped earlier are still unmapped on free.
    Calling it again is harmless (the settings are process-wide and stay). Through
    :func:`pipeline.switches.apply_process_settings`, which honours the user's switch.
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
