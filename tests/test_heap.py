"""keep_freed_heap(): freed large buffers are reused from the heap instead of re-mapped (page faults)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run the CLI (which keeps the heap unless ONDEVICE_TL_KEEP_HEAP=0), then allocate and free a
# 64 MiB buffer (above glibc's largest mmap threshold) five times after a warm-up one; print the
# minor page faults of the five.
SCRIPT = """
import contextlib, io, resource
import numpy as np
from pipeline.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["stages"]) == 0
np.ones(64 << 20, np.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    buffer = np.ones(64 << 20, np.uint8)
    del buffer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(keep: str | None) -> int:
    env = {
        k: v for k, v in os.environ.items() if k != "ONDEVICE_TL_KEEP_HEAP" and not k.startswith("MALLOC_")
    }
    if keep is not None:
        env["ONDEVICE_TL_KEEP_HEAP"] = keep
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_the_cli_keeps_freed_buffers_in_the_heap_unless_told_not_to() -> None:
    default, off, kept = faults(None), faults("0"), faults("1")
    assert off > 0  # opted out: every buffer is mapped and faulted in anew
    assert max(default, kept) * 10 < off, (default, kept, off)


def test_a_bad_setting_is_named_before_any_work() -> None:
    env = {**os.environ, "ONDEVICE_TL_KEEP_HEAP": "yes"}
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "stages"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert out.returncode == 2
    assert "ONDEVICE_TL_KEEP_HEAP must be 1" in out.stderr and "'yes'" in out.stderr
    assert "Traceback" not in out.stderr


# A Dask worker applies the client's settings, whatever its own environment says.
WORKER_SCRIPT = """
from pipeline.heap import heap_kept
from pipeline.switches import KEEP_HEAP, apply_process_settings
print(apply_process_settings({KEEP_HEAP: False})[KEEP_HEAP], heap_kept())
print(apply_process_settings({KEEP_HEAP: True})[KEEP_HEAP], heap_kept())
print(apply_process_settings({KEEP_HEAP: True})[KEEP_HEAP], heap_kept())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_explicit_settings_override_the_environment_and_applying_twice_is_harmless() -> None:
    env = {**os.environ, "ONDEVICE_TL_KEEP_HEAP": "1"}
    out = subprocess.run(
        [sys.executable, "-c", WORKER_SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    assert out.stdout.split("\n")[:3] == ["False False", "True True", "True True"]
