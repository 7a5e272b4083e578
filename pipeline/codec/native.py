"""The compiled codec kernels: quantize (compression) and dequantize + crop/flip (decompression).

Decompression runs on the trainer's critical path every epoch, and where the trained top is short
(one block) the torch ops that turn cached codes into augmented float maps (unpack, gather, convert,
scale, shift, zero the padding: several passes over the data) are a visible share of the step.
``dequantize_moved.c`` does it in one pass, bit for bit the same. Compression runs once per entry, on
the build's critical path beside the frozen forward; torch spends most of its time there in
separate elementwise passes and small-tensor ops on the (N, C) grid, which ``quantize.c`` does per
channel while the channel is in cache, byte for byte the same (``quantile.quantize`` uses it when
it is built, and its torch ops otherwise).

Kept because they pay where the two-stage bar is tight, and more on a busy device: the dequantize
kernel beats the fused torch ops at every cut, by a few percent of a one-block epoch on a quiet
machine (the cut whose two-stage time was over its bar with torch ops, README's Cache & Reuse notes)
and by far more when other work shares the cores, which slows torch's OpenMP ops much more than the
kernel's own threads (``python -m benchmarks.bench_dequantize_kernel``; numbers in
benchmarks/README.md, ``dequantize_kernel``); both directions: ``python -m benchmarks.bench_codec``.

It is plain C (no Python or torch headers), compiled on first use with the machine's C
compiler (``$CC``, else ``cc``/``gcc``/``clang``) into a per-user cache folder, keyed by a hash
of the sources, the flags and the machine, and loaded with ctypes: nothing to build at install
time, and a device compiles it for itself. Where torch runs on libgomp (Linux wheels), the kernels
are built with OpenMP and so run their threads on torch's own pool (``shares.h`` says why); a
compiler without OpenMP gives a build that starts its threads per call, the same bytes (one
warning). Without a compiler, on a failed build, or with ``ONDEVICE_TL_NATIVE=0``, :func:`kernel`
and :func:`quantize_kernel` return None and callers use the torch ops (one warning says why).
``ONDEVICE_TL_NATIVE_CACHE`` sets the cache folder.
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
from typing import TYPE_CHECKING, Any, NamedTuple

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
# Compiled together into one library (each file is self-contained but for the header they share).
SOURCES = (Path(__file__).with_name("dequantize_moved.c"), Path(__file__).with_name("quantize.c"))
HEADERS = (Path(__file__).with_name("shares.h"),)
# -ffp-contract=off: a fused multiply-add would round differently from torch's separate mul and add.
FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off")
OPENMP = "-fopenmp"  # added where torch's runtime is libgomp.so.1 (see torch_openmp_runtime)
SYMBOL = "otl_dequantize_moved"
QUANTIZE_SYMBOL = "otl_quantize"
# otl_quantize's reports (quantize.c): the range torch would give is not certain from the values alone
# (both signs of zero at a channel's minimum); a value is NaN, inf or beyond float16; a scale overflows.
AMBIGUOUS_ZERO, OUT_OF_RANGE, SCALE_OVERFLOW = 1, 2, 3

# (dy, dx, flip) per sample: a crop's offsets and whether it mirrors (see dequantize_moved).
Move = tuple[np.ndarray, np.ndarray, np.ndarray]

_lock = threading.Lock()
_kernel: Any = None
_quantize: Any = None
_looked_up = False
_threading: str | None = None


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


def torch_openmp_runtime() -> str | None:
    """The path of the libgomp torch runs its threads on, where a ``-fopenmp`` build shares it, else None.

    A library built with ``-fopenmp`` asks the loader for ``libgomp.so.1``; a loaded file of that name
    is reused, so the kernels then run on torch's pool. Where torch bundles a renamed copy (some
    wheels do), runs another runtime (LLVM's, Intel's) or the platform has no ``/proc/self/maps``,
    None: a build with OpenMP would load a second pool beside torch's, worse than threads per call.
    """
    torch.get_num_threads()  # torch (and its runtime) loaded first, so the loader finds its libgomp
    loaded = loaded_libgomp()
    if loaded is None or len(loaded) != 1:
        return None
    (path,) = loaded
    return path if Path(path).name == "libgomp.so.1" else None


def loaded_libgomp() -> set[str] | None:
    """The files of every libgomp loaded in this process, or None where ``/proc/self/maps`` cannot say."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return {line.split()[-1] for line in maps.splitlines()
            if "libgomp" in line and line.rstrip().endswith(".so.1")}


def threading_kind() -> str | None:
    """How the loaded kernels run their threads: ``"openmp"`` (torch's pool), ``"threads"`` (started per
    call), or None when the kernels are not loaded (turned off, not buildable)."""
    _look_up()
    return _threading


def library_path(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the build of the sources with ``compiler`` and ``flags`` lives (new sources: a new file)."""
    key = hashlib.sha256()
    for part in (*(source.read_bytes() for source in (*SOURCES, *HEADERS)), " ".join(flags).encode(),
                 compiler.encode(), platform.machine().encode(), sys.platform.encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"codec-{key.hexdigest()[:16]}.so"


def build(compiler: str, target: Path, flags: tuple[str, ...] = FLAGS) -> None:
    """Compile the kernels to ``target``: to a temporary file beside it, then renamed, so a reader
    (another process compiling at the same time) never loads a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        sources = [str(source) for source in SOURCES]
        done = subprocess.run([*compiler.split(), *flags, "-o", tmp, *sources],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed on {', '.join(sources)}: {done.stderr.strip()[-500:]}")
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


def _built(compiler: str) -> tuple[Path, str]:
    """The library for this machine, built if need be: with OpenMP where it shares torch's runtime,
    else (or where that build fails: one warning) with threads started per call."""
    failed = None
    if torch_openmp_runtime() is not None:
        flags = (*FLAGS, OPENMP)
        path = library_path(compiler, flags)
        try:
            if not path.exists():
                build(compiler, path, flags)
            return path, "openmp"
        except (OSError, subprocess.SubprocessError) as exc:
            failed = exc
    path = library_path(compiler)
    if not path.exists():
        build(compiler, path)  # where this fails too, the caller warns with its error
    if failed is not None:
        warnings.warn(f"could not build the codec kernels with {OPENMP} ({failed}); they start their threads "
                      "per call instead: the same bytes, slower beside torch's threads", RuntimeWarning,
                      stacklevel=5)
    return path, "threads"


def _load() -> tuple[Any, Any, str | None]:
    if not native_requested():
        return None, None, None
    compiler = _compiler()
    if compiler is None:
        warnings.warn("no C compiler found (set $CC or install cc/gcc/clang): quantizing and dequantizing "
                      "features with torch ops, which is slower (dequantizing: on the training thread)",
                      RuntimeWarning, stacklevel=4)
        return None, None, None
    try:
        path, kind = _built(compiler)
        _check_owner(path)
        library = ctypes.CDLL(str(path))
        dequantize_fn, quantize_fn = getattr(library, SYMBOL), getattr(library, QUANTIZE_SYMBOL)
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        warnings.warn(f"could not build or load the codec kernels ({exc}); using torch ops",
                      RuntimeWarning, stacklevel=4)
        return None, None, None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    dequantize_fn.argtypes = [p, i64, i64, i32, i64, i64, i64, p, p, p, p, p, p, i32, i32]
    dequantize_fn.restype = ctypes.c_int
    quantize_fn.argtypes = [p, i64, i64, i64, i32, p, p, i32, i32, p, p, p, i64, i32, i32, p]
    quantize_fn.restype = ctypes.c_int
    return dequantize_fn, quantize_fn, kind


def _look_up() -> None:
    global _kernel, _quantize, _threading, _looked_up
    with _lock:
        if not _looked_up:
            (_kernel, _quantize, _threading), _looked_up = _load(), True


def kernel() -> Any:
    """The loaded dequantize function, or None when turned off or not buildable here (then warned once)."""
    _look_up()
    return _kernel


def quantize_kernel() -> Any:
    """The loaded quantize function, or None when turned off or not buildable here (then warned once)."""
    _look_up()
    return _quantize


def dequantize_moved(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int,
                     shape: tuple[int, int, int], move: Move | None = None, *,
                     threads: int = 1, isa: int = -1) -> torch.Tensor | None:
    """float32 (N, C, H, W) maps ``lo + code * scale`` from packed ``codes``, or None without the kernel.

    ``codes`` uint8 (N, packed bytes), ``lo`` and ``scale`` float16 (N, C): a stored
    :class:`pipeline.codec.quantile.QuantizedBatch`. ``threads`` > 1 splits the samples between
    that many threads. ``isa`` caps the vector width, as for :func:`quantize`.

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
                *ptrs, out.data_ptr(), max(1, min(64, int(threads))), int(isa))
    if status == -1:
        raise MemoryError("the dequantize kernel could not allocate its per-sample buffers")
    if status != 0:
        raise ValueError(f"the dequantize kernel rejected its arguments (status {status}): "
                         f"{bits} bits, shape {shape}, {n} samples, {threads} threads")
    return out


class Quantized(NamedTuple):
    """What :func:`quantize` made: ``codes`` uint8 (N, packed bytes), ``lo16``/``scale16`` float16 (N, C),
    and ``lo``/``hi`` float32 (N, C), each channel's range. ``status`` 0: all made; else one of
    AMBIGUOUS_ZERO, OUT_OF_RANGE, SCALE_OVERFLOW, and ``where`` = sample * C + channel it was found at
    (one of them, if several: which one may depend on the thread count); the tensors are then incomplete."""

    codes: torch.Tensor
    lo16: torch.Tensor
    scale16: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    status: int
    where: int


def quantize(x: torch.Tensor, bits: int, value_range: tuple[torch.Tensor, torch.Tensor] | None = None, *,
             clip: bool = False, threads: int = 1, isa: int = -1) -> Quantized | None:
    """``x`` float32 (N, C, L), contiguous, on the CPU, as :func:`pipeline.codec.quantile.quantize` codes
    it, or None without the kernel.

    ``value_range`` (lo, hi), float32 (N, C): the clipping range (k > 1: torch.topk's), clipped to
    when ``clip``; None: each channel's min and max. ``threads`` > 1 splits the samples between that
    many threads; no byte depends on it. ``isa`` caps the vector width the kernel picks at run time
    (-1: the widest the CPU has; 0: the build's baseline, 1: AVX2, 2: AVX-512 on x86), for tests, which
    compare them. The caller answers a nonzero ``status`` (see :class:`Quantized`).
    """
    fn = quantize_kernel()
    if fn is None:
        return None
    if x.dtype != torch.float32 or x.dim() != 3 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"x must be contiguous float32 (N, C, L) on the CPU, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    n, c, length = x.shape
    if value_range is None:
        lo, hi = torch.empty(n, c), torch.empty(n, c)
    else:
        lo, hi = (t.contiguous() for t in value_range)
        if any(t.dtype != torch.float32 or tuple(t.shape) != (n, c) for t in (lo, hi)):
            raise ValueError(f"value_range must be two float32 tensors of shape {(n, c)}, got "
                             f"{[(t.dtype, tuple(t.shape)) for t in (lo, hi)]}")
    row_bytes = (c * length * bits + 7) // 8
    codes = torch.empty(n, row_bytes, dtype=torch.uint8)
    lo16, scale16 = torch.empty(n, c, dtype=torch.float16), torch.empty(n, c, dtype=torch.float16)
    where = ctypes.c_int64(-1)
    status = fn(x.data_ptr(), n, c, length, bits, lo.data_ptr(), hi.data_ptr(), int(value_range is not None),
                int(clip), lo16.data_ptr(), scale16.data_ptr(), codes.data_ptr(), row_bytes,
                max(1, min(64, int(threads))), int(isa), ctypes.byref(where))
    if status == -1:
        raise MemoryError("the quantize kernel could not allocate its per-thread buffer")
    if status < 0:
        raise ValueError(f"the quantize kernel rejected its arguments (status {status}): {bits} bits, "
                         f"shape {tuple(x.shape)}, clip={clip}, {threads} threads")
    return Quantized(codes, lo16, scale16, lo, hi, int(status), int(where.value))
