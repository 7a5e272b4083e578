"""release_idle_workers(): torch's idle OpenMP workers are released between steps, and come back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline.openmp as openmp

ROOT = Path(__file__).resolve().parents[1]
GNU_OPENMP = sys.platform.startswith("linux") and openmp.torch_uses_openmp()

# Run one parallel op, release the workers, and print the process's thread count before and after
# the release and after the next parallel op (Linux: /proc/self/status), then whether it released.
SCRIPT = """
import torch
from pipeline.openmp import release_idle_workers
torch.set_num_threads(2)
def threads():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("Threads:"))
x = torch.randn(256, 64, 64)
(x * 2).sum()
busy = threads()
released = release_idle_workers()
idle = threads()
again = (x * 2).sum()
print(busy, idle, threads(), released, bool(again == (x * 2).sum()))
"""


def run_script(env_value: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ONDEVICE_TL_OMP_PAUSE", "OMP_NUM_THREADS")}
    if env_value is not None:
        env["ONDEVICE_TL_OMP_PAUSE"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    return out.stdout.split()


@pytest.mark.skipif(not GNU_OPENMP, reason="needs torch on an OpenMP runtime (Linux)")
def test_idle_workers_exit_and_the_next_parallel_op_starts_them_again() -> None:
    busy, idle, again, released, same = run_script(None)
    assert released == "True" and same == "True"
    assert int(idle) == int(busy) - 1  # the one worker beside the main thread has exited
    assert int(again) == int(busy)  # and the next parallel op has a worker again


@pytest.mark.skipif(not GNU_OPENMP, reason="needs torch on an OpenMP runtime (Linux)")
def test_turned_off_the_workers_stay() -> None:
    busy, idle, _again, released, _same = run_script("0")
    assert released == "False" and idle == busy


def test_the_loaded_runtime_is_found_where_torch_uses_openmp() -> None:
    path = openmp._loaded_runtime()
    if GNU_OPENMP:
        assert path is not None and Path(path).name.startswith(openmp.RUNTIMES)
    assert openmp.release_idle_workers() in (True, False)  # callable anywhere, never raises


def test_a_bad_setting_is_named_before_any_work() -> None:
    env = {**os.environ, "ONDEVICE_TL_OMP_PAUSE": "maybe"}
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "stages"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert out.returncode == 2
    assert "ONDEVICE_TL_OMP_PAUSE must be 1" in out.stderr and "'maybe'" in out.stderr
    assert "Traceback" not in out.stderr
