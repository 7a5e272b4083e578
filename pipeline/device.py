"""``run.device``: which torch device a run computes on, checked and resolved in one place.

A recipe names ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when this machine has it, else the
CPU). :func:`check_device_name` checks the spelling without importing torch, so ``validate`` can
reject ``gpu0`` on a machine with no torch at all; :func:`resolve_device` turns the name into the
``torch.device`` the run uses, once, when the run's context is made, and refuses a CUDA device this
machine does not have before any work starts.

The device never enters a fingerprint: where a cache entry is computed does not change what it
means (GPU and CPU builds agree within the bounds ``tests/test_cuda_data.py`` states), so an entry
built on a GPU is reused by a CPU run and the other way round. :func:`device_description` is what
an entry's manifest records about where it was built.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import DeviceMemoryError, RecipeError
from .lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

VALID_DEVICES = ("cpu", "cuda", "cuda:N", "auto")
_DEVICE = re.compile(r"^(cpu|cuda|cuda:(0|[1-9][0-9]*)|auto)$")


def check_device_name(value: Any) -> str:
    """``value`` if it spells a device this toolkit runs on, else a ValueError naming the valid ones."""
    if isinstance(value, str) and _DEVICE.match(value.strip()):
        return value.strip()
    raise ValueError(f"expected one of {', '.join(VALID_DEVICES)} (N: a CUDA device index, e.g. cuda:1)")


def resolve_device(name: str) -> torch.device:
    """The torch device ``run.device: name`` means on this machine.

    ``auto`` is CUDA device 0 when CUDA is available, else the CPU. ``cuda`` is the current CUDA
    device (0 unless ``CUDA_VISIBLE_DEVICES`` remaps it). A CUDA device that is not there is a
    RecipeError (exit 2) saying what was found, raised here, before any stage runs.
    """
    name = check_device_name(name)
    if name == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if name == "auto":
        return torch.device("cuda", 0) if available else torch.device("cpu")
    count = torch.cuda.device_count() if available else 0
    if count == 0:
        built = torch.version.cuda
        why = (f"this torch ({torch.__version__}) is built with CUDA {built} but finds no usable GPU"
               if built else f"this torch ({torch.__version__}) is built without CUDA")
        raise RecipeError(f"run.device: {name} asked for, but torch.cuda.device_count() is 0 ({why}); "
                          "set run.device: cpu, or auto to use a GPU only when there is one")
    index = 0 if name == "cuda" else int(name.split(":")[1])
    if index >= count:
        raise RecipeError(f"run.device: {name} asked for, but torch.cuda.device_count() is {count} "
                          f"(valid: cuda:0 .. cuda:{count - 1})")
    return torch.device("cuda", index)


def device_description(device: torch.device) -> dict[str, Any]:
    """Where something was computed, for an entry's manifest: the device, and the GPU's name on CUDA."""
    out: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        out["name"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
    out["torch"] = torch.__version__
    return out


# CPU flags of native bfloat16 arithmetic (/proc/cpuinfo): x86's AVX-512 BF16 and AMX, Arm's BF16.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU computes bfloat16 natively (None where ``cpuinfo`` cannot be read: not Linux).

    Without it, torch's CPU autocast to bf16 converts in software around float32 kernels: slower
    than float32, with bf16's rounding, so ``train.precision: bf16`` then costs twice.
    """
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return bool(flags & BF16_CPU_FLAGS)


def pin(x: torch.Tensor) -> torch.Tensor:
    """``x`` in page-locked host memory, so a ``non_blocking`` copy to a GPU is asynchronous. As it is
    when it is already pinned or not on the host, or when no GPU is usable (pinning needs a CUDA
    driver: without one, GPU-bound code paths still run, and are tested, on any machine)."""
    if x.device.type != "cpu" or not torch.cuda.is_available() or x.is_pinned():
        return x
    return x.pin_memory()


def out_of_memory(exc: BaseException, *, stage: str, batch_size: int | None, setting: str | None,
                  device: torch.device | str, during: str, resumes: str) -> DeviceMemoryError:
    """The error a user sees when ``during`` (e.g. "training, epoch 2") ran out of memory on ``device``:
    the stage, the batch size, the setting to lower and a smaller value, and how the work resumes."""
    device = torch.device(device)
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    at = f" at batch size {batch_size}" if batch_size else ""
    smaller = max(1, batch_size // 2) if batch_size else None
    fix = (f"set {setting} to a smaller value" + (f" (e.g. {smaller})" if smaller else "")) if setting \
        else "use a smaller batch size"
    if device.type == "cuda":
        fix += ", or free the GPU of other processes (nvidia-smi)"
    return DeviceMemoryError(f"stage {stage!r} ran out of memory on {device}{at} during {during}: {detail}; "
                             f"{fix}. {resumes}")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device allocator's out-of-memory error (``torch.OutOfMemoryError``, its CUDA alias)."""
    kind = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return kind is not None and isinstance(exc, kind)


@contextmanager
def ieee_fp32(device: torch.device) -> Iterator[None]:
    """Convolutions in true float32 on ``device`` while inside (no TF32 on CUDA).

    cuDNN convolutions default to TF32 on Ampere and later GPUs (10-bit mantissa products), which
    is not the ``precision: fp32`` a recipe asks for, and would widen the gap between a GPU and a CPU
    build of one cache entry from float32 rounding to about 1e-3 relative. Scoped, and restored on
    exit, so a trainer that chose TF32 for itself keeps it.
    """
    if device.type != "cuda":
        yield
        return
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        before = conv.fp32_precision
        conv.fp32_precision = "ieee"
        try:
            yield
        finally:
            conv.fp32_precision = before
        return
    before_flag = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = before_flag
