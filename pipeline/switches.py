"""The toolkit's process-wide settings: on/off switches read from environment variables (``=1`` or
``=0``), and the one place that applies them to the process.

Each switch is on unless set to 0. Any other value is an error that names the variable and what
each value means; the CLI checks every switch before any work (:func:`check_switches`), so a typo
stops a run at once (exit 2). Kept free of heavy imports: ``validate`` runs without torch.

:func:`apply_process_settings` is called once per process that does the work: by the CLI before
its command, and by each Dask worker with the client's choices (a worker on another machine does
not share the client's environment). Nothing else changes process-wide state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from . import heap

KEEP_HEAP = heap.ENV
NATIVE = "ONDEVICE_TL_NATIVE"

# name -> (what 1 means, what 0 means). Why each exists: pipeline/heap.py and pipeline/codec/native.py.
SWITCHES = {
    KEEP_HEAP: ("keep freed memory", "glibc's defaults"),
    NATIVE: ("use the compiled codec kernels (quantize, dequantize)", "torch ops only"),
}


def switch(name: str) -> bool:
    """True unless ``$name`` is 0; ValueError naming the variable for any value but 0 or 1."""
    on, off = SWITCHES[name]
    value = os.environ.get(name, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 1 ({on}, the default) or 0 ({off}), got {value!r}")
    return value == "1"


def check_switches() -> None:
    """Read every switch once: the first bad value raises its ValueError."""
    for name in SWITCHES:
        switch(name)


def process_settings() -> dict[str, bool]:
    """The process-wide settings this environment asks for (what a Dask client sends its workers)."""
    return {KEEP_HEAP: switch(KEEP_HEAP)}


def apply_process_settings(settings: Mapping[str, bool] | None = None) -> dict[str, bool]:
    """Apply every process-wide setting (``settings``, else this environment's); returns which took effect.

    Call it before the first large allocation. Applying again is harmless: each setting is
    idempotent, so a Dask worker may apply the client's choices on every task it runs.
    """
    wanted = process_settings() if settings is None else dict(settings)
    return {KEEP_HEAP: bool(wanted.get(KEEP_HEAP)) and heap.keep_freed_heap()}
