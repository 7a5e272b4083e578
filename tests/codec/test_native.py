"""The compiled dequantize + crop/flip kernel: bit for bit the torch ops, its build and its fallbacks.

The torch ops (``quantile.dequantize`` with a ``source``, then ``CropFlip.zero_padding``) are the
specification; every comparison is of int32 bit patterns, so a sign of zero or a rounding differing
would fail. Tests that need the kernel are skipped where no C compiler is found.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.codec import native
from pipeline.codec.quantile import QuantizedBatch, dequantize, quantize
from pipeline.stages.feature_aug import CropFlip, sample_uniforms

needs_compiler = pytest.mark.skipif(native._compiler() is None, reason="no C compiler on this machine")
ISAS = (0, 1, 2)  # the baseline build, AVX2, AVX-512 (capped at what the CPU has; one build elsewhere)


def torch_reference(q: QuantizedBatch, crop: CropFlip | None) -> torch.Tensor:
    if crop is None:
        return dequantize(q)
    return crop.zero_padding(dequantize(q, crop.source))


def bits_of(x: torch.Tensor | None) -> torch.Tensor:
    assert x is not None, "the kernel gave no result: it was not built"
    return x.contiguous().view(torch.int32)


@needs_compiler
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 9),
    c=st.integers(1, 5),
    h=st.integers(1, 9),
    w=st.integers(1, 9),
    bits=st.sampled_from([1, 2, 4, 8]),
    padding=st.integers(0, 10),
    hflip=st.sampled_from([0.0, 0.5, 1.0]),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    isa=st.sampled_from(ISAS),
)
def test_kernel_equals_torch_ops(n, c, h, w, bits, padding, hflip, threads, seed, isa) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=gen) * 3
    q = quantize(x, bits)
    crop = CropFlip.draw(n, h, w, padding, hflip, sample_uniforms(torch.arange(n), seed, 0, 3))
    for move in (None, crop):
        got = native.dequantize_moved(q.codes, q.lo, q.scale, bits, (c, h, w),
                                      None if move is None else move.move, threads=threads, isa=isa)
        assert got is not None and got.shape == (n, c, h, w) and got.dtype == torch.float32
        assert torch.equal(bits_of(got), bits_of(torch_reference(q, move)))


@needs_compiler
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_wide_and_odd_maps_every_move(bits: int) -> None:
    """Rows around the 16 bytes one shuffle reverses (15, 16, 17, 31, 32, 33, 56 wide), odd code
    counts, and every shift of a 5-pixel crop with and without a flip, at each vector width."""
    gen = torch.Generator().manual_seed(bits)
    for c, h, w in ((3, 2, 15), (2, 3, 16), (3, 3, 17), (1, 2, 31), (2, 1, 32), (1, 3, 33), (2, 4, 56),
                    (96, 14, 14), (5, 7, 7), (3, 1, 1)):
        shifts = [(dy, dx) for dy in range(-5, 6) for dx in range(-5, 6)]
        n = 2 * len(shifts)
        q = quantize(torch.randn(n, c, h, w, generator=gen), bits)
        dy = np.array([s[0] for s in shifts] * 2, np.int32)
        dx = np.array([s[1] for s in shifts] * 2, np.int32)
        flip = np.repeat([False, True], len(shifts))
        crop = CropFlip(dy, dx, flip, h, w)
        want = bits_of(torch_reference(q, crop))
        for isa in ISAS:
            for threads in (1, 2):
                got = native.dequantize_moved(q.codes, q.lo, q.scale, bits, (c, h, w), crop.move,
                                              threads=threads, isa=isa)
                assert torch.equal(bits_of(got), want), (c, h, w, isa, threads)


@needs_compiler
def test_every_float16_lo_and_scale_converts_exactly() -> None:
    """All 63,488 finite float16 values and both infinities as lo (code 0) and as scale (code 1)."""
    patterns = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    values = patterns[~patterns.isnan()]
    n = len(values)
    zero = torch.zeros(n, 1, dtype=torch.float16)
    for codes, lo, scale in ((torch.zeros(n, 1, dtype=torch.uint8), values[:, None], zero),
                             (torch.ones(n, 1, dtype=torch.uint8), zero, values[:, None])):
        q = QuantizedBatch(codes=codes, lo=lo, scale=scale, bits=8, shape=(1, 1, 1))
        got = native.dequantize_moved(codes, lo, scale, 8, (1, 1, 1))
        assert torch.equal(bits_of(got), bits_of(dequantize(q)))


@needs_compiler
def test_padding_is_positive_zero_next_to_inf_and_nan() -> None:
    q = quantize(torch.rand(4, 3, 5, 5), 2)
    lo = q.lo.clone()
    lo[0, 0], lo[1, 1] = float("inf"), float("nan")
    crop = CropFlip.draw(4, 5, 5, 2, 0.5, np.array([[0.0, 0.0, 0.9]] * 4))  # dy = dx = -2
    got = native.dequantize_moved(q.codes, lo, q.scale, 2, (3, 5, 5), crop.move)
    assert got is not None
    assert torch.equal(bits_of(got[:, :, :2, :]), torch.zeros(4, 3, 2, 5, dtype=torch.int32))
    assert torch.isinf(got[0, 0, 2:, 2:]).all() and torch.isnan(got[1, 1, 2:, 2:]).all()


@needs_compiler
def test_bad_arguments_are_named() -> None:
    q = quantize(torch.rand(3, 2, 4, 4), 2)
    with pytest.raises(ValueError, match=r"codes rows hold 8 bytes; 2-bit codes of \(2, 4, 5\) maps need 10"):
        native.dequantize_moved(q.codes, q.lo, q.scale, 2, (2, 4, 5))
    with pytest.raises(ValueError, match="lo must be float16 of shape \\(3, 2\\)"):
        native.dequantize_moved(q.codes, q.lo.float(), q.scale, 2, (2, 4, 4))
    with pytest.raises(ValueError, match="scale must be float16 of shape \\(3, 2\\)"):
        native.dequantize_moved(q.codes, q.lo, q.scale[:2], 2, (2, 4, 4))
    with pytest.raises(ValueError, match="codes must be uint8"):
        native.dequantize_moved(q.codes.int(), q.lo, q.scale, 2, (2, 4, 4))
    move = (np.zeros(2), np.zeros(3), np.zeros(3))
    with pytest.raises(ValueError, match="move must be three arrays of 3 values"):
        native.dequantize_moved(q.codes, q.lo, q.scale, 2, (2, 4, 4), move)


@needs_compiler
def test_built_once_into_the_cache_folder_and_reused(fresh_kernel, monkeypatch) -> None:
    assert native.kernel() is not None
    built = list(fresh_kernel.glob("codec-*.so"))
    assert len(built) == 1 and not list(fresh_kernel.glob("*.so.tmp*"))
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "_looked_up", False)
    monkeypatch.setattr(native, "build", lambda *a: pytest.fail("rebuilt although the library exists"))
    assert native.kernel() is not None and native.quantize_kernel() is not None
    assert built[0].stat().st_mtime_ns == stamp


def test_turned_off_or_without_compiler_falls_back_to_torch_ops(fresh_kernel, monkeypatch) -> None:
    monkeypatch.setenv(native.ENV, "0")
    assert native.kernel() is None
    q = quantize(torch.rand(2, 3, 4, 4), 4)
    assert native.dequantize_moved(q.codes, q.lo, q.scale, 4, (3, 4, 4)) is None
    monkeypatch.setenv(native.ENV, "1")
    monkeypatch.setattr(native, "_looked_up", False)
    monkeypatch.setenv("CC", os.path.join(str(fresh_kernel), "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="no C compiler found"):
        assert native.kernel() is None


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a shell to play a failing compiler")
def test_a_failing_compiler_is_a_warning_not_an_error(fresh_kernel, monkeypatch) -> None:
    fake = fresh_kernel / "broken-cc"
    fake.write_text("#!/bin/sh\necho 'broken-cc: internal error' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(RuntimeWarning, match="broken-cc: internal error"):
        assert native.kernel() is None
    assert not list(fresh_kernel.glob("*.so"))  # no half-built library left to load next time


def test_bad_switch_value_is_named_before_any_work(monkeypatch) -> None:
    monkeypatch.setenv(native.ENV, "yes")
    with pytest.raises(ValueError, match="ONDEVICE_TL_NATIVE must be 1 .* or 0"):
        native.native_requested()
    out = subprocess.run([sys.executable, "-m", "pipeline", "stages"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, native.ENV: "yes"})
    assert out.returncode == 2 and "ONDEVICE_TL_NATIVE must be 1" in out.stderr and "'yes'" in out.stderr
    assert "Traceback" not in out.stderr


@needs_compiler
@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX file ownership")
def test_a_library_others_can_write_is_not_loaded(fresh_kernel, monkeypatch) -> None:
    assert native.kernel() is not None
    fresh_kernel.chmod(0o777)  # a shared, world-writable cache folder
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "_looked_up", False)
    with pytest.warns(RuntimeWarning, match="not owned by this user alone .* mode 777"):
        assert native.kernel() is None


@needs_compiler
@pytest.mark.skipif(native.torch_openmp_runtime() is None, reason="torch does not run on libgomp.so.1 here")
def test_kernels_run_on_torchs_openmp_pool_not_a_second_one(fresh_kernel) -> None:
    before = native.loaded_libgomp()
    assert native.kernel() is not None and native.threading_kind() == "openmp"
    assert any(p.name.endswith(".so") and "codec-" in p.name for p in fresh_kernel.iterdir())
    x = torch.rand(16, 3, 5, 5).reshape(16, 3, 25).contiguous()
    assert native.quantize(x, 2, threads=2) is not None
    assert before is not None and len(before) == 1 and native.loaded_libgomp() == before


@needs_compiler
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_the_kernels_with_threads(tmp_path) -> None:
    # libgomp's pool does not survive a fork: a child using it would wait for workers that were not
    # copied. The kernels notice the fork and start their own threads there.
    script = tmp_path / "fork.py"
    script.write_text(
        "import os, sys, torch\n"
        "from pipeline.codec import native\n"
        "x = torch.rand(16, 3, 25)\n"
        "parent = native.quantize(x, 2, threads=2)\n"
        "q = native.dequantize_moved(parent.codes, parent.lo16, parent.scale16, 2, (3, 5, 5), threads=2)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    child = native.quantize(x, 2, threads=2)\n"
        "    again = native.dequantize_moved(child.codes, child.lo16, child.scale16, 2, (3, 5, 5),\n"
        "                                    threads=2)\n"
        "    os._exit(0 if torch.equal(child.codes, parent.codes) and torch.equal(again, q) else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]


@needs_compiler
@pytest.mark.skipif(native.torch_openmp_runtime() is None, reason="torch does not run on libgomp.so.1 here")
@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a shell to play a compiler without OpenMP")
def test_a_compiler_without_openmp_gives_threads_per_call_and_the_same_bytes(fresh_kernel,
                                                                             monkeypatch) -> None:
    x = (torch.randn(12, 4, 36) * 2).clamp(0, 6)
    want = native.quantize(x, 4, threads=2)  # the process's kernels, whichever build
    assert want is not None
    fake = fresh_kernel / "cc-without-openmp"
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -fopenmp ] && "
                    "{ echo 'cc: unsupported option -fopenmp' >&2; exit 1; }; done\n"
                    f"exec {native._compiler()} \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "_quantize", None)
    monkeypatch.setattr(native, "_looked_up", False)
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(RuntimeWarning, match="with -fopenmp .*unsupported option -fopenmp.*per call"):
        assert native.threading_kind() == "threads"
    got = native.quantize(x, 4, threads=2)
    assert got is not None and torch.equal(got.codes, want.codes) and torch.equal(got.lo16, want.lo16)
