"""Send torch's idle OpenMP workers to sleep before other CPU work runs on the same cores.

After a parallel region ends, GNU OpenMP's workers keep spinning on the CPU for a while
(``GOMP_SPINCOUNT``), so that the next region starts without a wake-up. Between two torch
ops that is right; between two forward batches, when the main thread then decodes JPEGs on
every core, a spinning worker takes a core from a decoder thread: decoding 32 images after a
frozen forward measured 16.2 ms against 12.8 ms with the workers released first, and the next
forward was no slower for having to start them again (368 vs 366 ms, MobileNetV2 cut 4,
2 cores; issue 2).

``omp_pause_resource_all`` (OpenMP 5.0) releases them. It acts on the calling thread's own
team only, and refuses inside a parallel region, so it cannot disturb another thread's torch
ops. The runtime is the one torch loaded (found in ``/proc/self/maps``); without OpenMP, on a
runtime lacking the call, or outside Linux, :func:`release_idle_workers` does nothing.
``ONDEVICE_TL_OMP_PAUSE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

from .switches import switch

ENV = "ONDEVICE_TL_OMP_PAUSE"
OMP_PAUSE_SOFT = 1  # omp_pause_soft: threads exit, the runtime's state stays
RUNTIMES = ("libgomp", "libomp", "libiomp5")

_pause: Callable[[int], int] | None = None
_looked_up = False


def omp_pause_requested() -> bool:
    """True unless ``ONDEVICE_TL_OMP_PAUSE=0``; ValueError naming the variable for any other value."""
    return switch(ENV)


def _loaded_runtime() -> str | None:
    """Path of the OpenMP runtime this process has loaded, if any (Linux: from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                name = os.path.basename(path)
                if path.startswith("/") and name.startswith(RUNTIMES) and ".so" in name:
                    return path
    except OSError:
        return None
    return None


def torch_uses_openmp() -> bool:
    """True when torch's intra-op parallelism (ATen's parallel backend) is OpenMP."""
    import torch

    return "OpenMP" in torch.__config__.parallel_info().rsplit("ATen parallel backend:", 1)[-1]


def _find_pause() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux") or not omp_pause_requested() or not torch_uses_openmp():
        return None
    path = _loaded_runtime()
    if path is None:
        return None
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all  # the already-loaded library: same handle
    except (OSError, AttributeError):  # a runtime older than OpenMP 5.0
        return None
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause


def release_idle_workers() -> bool:
    """Stop the calling thread's idle OpenMP workers spinning; True if they were released.

    Call it between parallel steps, before CPU work that is not torch's (JPEG decoding on a
    thread pool); torch starts its workers again at its next parallel op.
    """
    global _pause, _looked_up
    if not _looked_up:
        _pause, _looked_up = _find_pause(), True
    return _pause is not None and _pause(OMP_PAUSE_SOFT) == 0
