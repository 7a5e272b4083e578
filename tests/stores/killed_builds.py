"""The fixed entry that the SIGKILL tests build, and the harness that kills a builder subprocess.

Used by test_faults.py (zarr) and test_h5_resume.py (HDF5): each defines a ``build_entry``
for its backend and runs it in a child ``python -c`` process via :func:`run_and_kill`, so no
cleanup handler, ``finally`` or ``__exit__`` runs in the killed build.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np

from stores.zarr_entry import ArraySpec

REPO = Path(__file__).resolve().parents[2]
SPECS = {
    "train/x": ArraySpec((4, 6), "float32"),
    "train/y": ArraySpec((), "int64"),
    "val/x": ArraySpec((4, 6), "float32"),
}
COUNTS = {"train": 120, "val": 37}
CHUNK = 4
BATCH = 3  # not a multiple of CHUNK, so resume points fall inside caller batches
# Progress lines a whole build prints: one per batch, then "commit".
TOTAL_LINES = -(-COUNTS["train"] // BATCH) + -(-COUNTS["val"] // BATCH) + 1


def fp(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def data_for(name: str, counts: dict[str, int] = COUNTS) -> np.ndarray:
    spec = SPECS[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return (rng.random((counts[name.split("/")[0]], *spec.sample_shape)) * 1000).astype(spec.dtype)


def child_script(module: str) -> str:
    """``python -c`` source running ``module.build_entry(root, fingerprint)`` with progress on stdout."""
    return (
        "import sys\n"
        f"from {module} import build_entry\n"
        "build_entry(sys.argv[1], sys.argv[2], progress=lambda line: print(line, flush=True))\n"
        "print('done', flush=True)\n"
    )


def run_and_kill(
    child: str, root: Path, fingerprint: str, after_lines: int, rng: random.Random, max_spin: int
) -> bool:
    """Run ``child`` (see :func:`child_script`), SIGKILL it after ``after_lines`` progress lines.

    Before the kill it spins for a random number (below ``max_spin``) of loop turns, so the
    kill lands mid-chunk as often as between chunks. Returns True if it finished before the
    kill landed.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", child, str(root), fingerprint], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    seen, finished = 0, False
    try:
        for line in proc.stdout:
            seen += 1
            if line.strip() == "done":
                finished = True
                break
            if seen >= after_lines:
                for _ in range(rng.randrange(0, max_spin)):
                    pass
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=60)
        proc.stdout.close()
    return finished or proc.returncode == 0
