"""The one compiled kernel: dequantize + crop/flip of cached feature maps in a single pass.

Training from the cache runs on the trainer's critical path every epoch, and where the trained top
is short (one block) the torch ops that turn cached codes into augmented float maps (unpack,
gather, convert, scale, shift, zero the padding: several passes over the data) are a visible share
of the step. ``dequantize_moved.c`` does it in one pass, bit for bit the same.

Kept because it pays where the two-stage bar is tight, and more on a busy device: it beats the fused
torch ops at every cut, by a few percent of a one-block epoch on a quiet machine (the cut whose
two-stage time was over its bar with torch ops, README's Cache & Reuse notes) and by far more when
other work shares the cores, which slows torch's OpenMP ops much more than the kernel's own threads
(``python -m benchmarks.bench_dequantize_kernel``; numbers in benchmarks/README.md, ``dequantize_kernel``).

It is plain C (no Python or torch headers), compiled on first use with the machine's C
compiler (``$CC``, else ``cc``/``gcc``/``clang``) into a per-user cache folder, keyed by a hash
of the source, the flags and the machine, and loaded with ctypes: nothing to build at install
time, and a device compiles it for itself. Without a compiler, on a failed build, or with
``ONDEVICE_TL_NATIVE=0``, :func:`kernel` returns None and callers use the torch ops (one
warning says why). ``ONDEVICE_TL_NATIVE_CACHE`` sets the cache folder.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..lazy import lazy_module
from ..storepath import user_cache_dir
from ..switches import switch

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

ENV = "ONDEVICE_TL_NATIVE"
CACHE_ENV = "ONDEVICE_TL_NATIVE_CACHE"
SOURCE = Path(__file__).with_name("dequantize_moved.c")
# -ffp-contract=off: a fused multiply-add would round differently from torch's separate mul and add.
FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off")
SYMBOL = "otl_dequantize_moved"

# (dy, dx, flip) per sample: a crop's offsets and whether it mirrors (see dequantize_moved).
Move = tuple[np.ndarray, np.ndarray, np.ndarray]

_lock = threading.Lock()
_kernel: Any = None
_looked_up = False


def native_requested() -> bool:
    """True unless ``ONDEVICE_TL_NATIVE=0``; ValueError naming the variable for any other value."""
    return switch(ENV)


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    return user_cache_dir() / "native"


def _compiler() -> str | None:
    explicit = os.environ.get("CC")
    if explicit:
        return shutil.which(explicit.split()[0]) and explicit
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def library_path(compiler: str) -> Path:
    """Where the build of the current source with ``compiler`` lives (a new source: a new file)."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
                 platform.machine().encode(), sys.platform.encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"dequantize_moved-{key.hexdigest()[:16]}.so"


def build(compiler: str, target: Path) -> None:
    """Compile the kernel to ``target``: to a temporary file beside it, then renamed, so a reader
    (another process compiling at the same time) never loads a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*compiler.split(), *FLAGS, "-o", tmp, str(SOURCE)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed on {SOURCE}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check_owner(path: Path) -> None:
    """Refuse a library that someone else could have written: loading it runs its code in this process.

    The cache folder may be shared (``ONDEVICE_TL_NATIVE_CACHE`` on a common disk); a library there
    is loaded only if this user owns it and its folder, nobody else can write the library, and the
    folder is not writable by everyone (a group-writable one is the norm with per-user groups).
    """
    if not hasattr(os, "getuid"):  # not POSIX: file ownership means something else there
        return
    for item, others in ((path, 0o022), (path.parent, 0o002)):
        st = item.stat()
        if st.st_uid != os.getuid() or st.st_mode & others:
            raise OSError(f"{item} is not owned by this user alone (owner uid {st.st_uid}, mode "
                          f"{st.st_mode & 0o777:o}); not loading a library from there: set "
                          f"{CACHE_ENV} to a folder of your own")


def _load() -> Any:
    if not native_requested():
        return None
    compiler = _compiler()
    if compiler is None:
        warnings.warn("no C compiler found (set $CC or install cc/gcc/clang): dequantizing cached "
                      "features with torch ops, which is slower on the training thread", RuntimeWarning,
                      stacklevel=3)
        return None
    path = library_path(compiler)
    try:
        if not path.exists():
            build(compiler, path)
        _check_owner(path)
        fn = getattr(ctypes.CDLL(str(path)), SYMBOL)
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        warnings.warn(f"could not build or load the dequantize kernel ({exc}); using torch ops",
                      RuntimeWarning, stacklevel=3)
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    fn.argtypes = [p, i64, i64, i32, i64, i64, i64, p, p, p, p, p, p, i32]
    fn.restype = ctypes.c_int
    return fn


def kernel() -> Any:
    """The loaded C function, or None when it is turned off or cannot be built here (then warned once)."""
    global _kernel, _looked_up
    with _lock:
        if not _looked_up:
            _kernel, _looked_up = _load(), True
        return _kernel


def dequantize_moved(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int,
                     shape: tuple[int, int, int], move: Move | None = None, *,
                     threads: int = 1) -> torch.Tensor | None:
    """float32 (N, C, H, W) maps ``lo + code * scale`` from packed ``codes``, or None without the kernel.

    ``codes`` uint8 (N, packed bytes), ``lo`` and ``scale`` float16 (N, C): a stored
    :class:`pipeline.codec.quantile.QuantizedBatch`. ``threads`` > 1 splits the samples between
    that many threads.

    ``move`` = (dy, dx, flip), one value per sample: output pixel (r, c) of every channel of sample i
    reads stored pixel (r + dy_i, c' + dx_i), c' = c or its mirror when flip_i, and is +0.0 where that
    is outside the map. Equal, bit for bit, to :func:`pipeline.codec.quantile.dequantize` with the
    same move as a ``source`` followed by zeroing the padding (:class:`pipeline.stages.feature_aug.CropFlip`).
    """
    fn = kernel()
    if fn is None:
        return None
    c, h, w = shape
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"codes must be uint8 (N, bytes), got {codes.dtype} {tuple(codes.shape)}")
    n, row_bytes = codes.shape
    if row_bytes != (c * h * w * bits + 7) // 8:
        raise ValueError(f"codes rows hold {row_bytes} bytes; {bits}-bit codes of {shape} maps need "
                         f"{(c * h * w * bits + 7) // 8}")
    for name, t in (("lo", lo), ("scale", scale)):
        if t.dtype != torch.float16 or tuple(t.shape) != (n, c):
            raise ValueError(f"{name} must be float16 of shape {(n, c)} (samples, channels), "
                             f"got {t.dtype} {tuple(t.shape)}")
    codes, lo, scale = codes.contiguous(), lo.contiguous(), scale.contiguous()
    out = torch.empty(n, c, h, w)
    ptrs: list[int | None] = [None, None, None]
    if move is not None:
        dtypes = (np.int32, np.int32, np.uint8)
        arrays = [np.ascontiguousarray(a, dtype=t) for a, t in zip(move, dtypes, strict=True)]
        if any(a.shape != (n,) for a in arrays):
            raise ValueError(f"move must be three arrays of {n} values (dy, dx, flip), "
                             f"got shapes {[a.shape for a in arrays]}")
        ptrs = [a.ctypes.data for a in arrays]  # ``arrays`` keeps them alive through the call
    status = fn(codes.data_ptr(), n, row_bytes, bits, c, h, w, lo.data_ptr(), scale.data_ptr(),
                *ptrs, out.data_ptr(), max(1, int(threads)))
    if status == -1:
        raise MemoryError("the dequantize kernel could not allocate its per-sample buffers")
    if status != 0:
        raise ValueError(f"the dequantize kernel rejected its arguments (status {status}): "
                         f"{bits} bits, shape {shape}, {n} samples, {threads} threads")
    return out
