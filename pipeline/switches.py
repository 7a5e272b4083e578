"""The toolkit's process-wide on/off switches, read from environment variables (``=1`` or ``=0``).

Each is on unless set to 0. Any other value is an error that names the variable and what each
value means; the CLI checks every switch before any work (:func:`check_switches`), so a typo
stops a run at once (exit 2). Kept free of heavy imports: ``validate`` runs without torch.
"""

from __future__ import annotations

import os

# name -> (what 1 means, what 0 means). Why each exists: pipeline/heap.py, pipeline/openmp.py and
# pipeline/codec/native.py, in this order.
SWITCHES = {
    "ONDEVICE_TL_KEEP_HEAP": ("keep freed memory", "glibc's defaults"),
    "ONDEVICE_TL_OMP_PAUSE": ("release idle OpenMP workers between steps", "leave them spinning"),
    "ONDEVICE_TL_NATIVE": ("use the compiled dequantize kernel", "torch ops only"),
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
