"""Shared bookkeeping for benchmark scripts: machine, versions, settings, atomic JSON output.

Every result file says where and how it was measured, so a number in the README can
always be traced to a machine, a set of library versions and the command that made it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PACKAGES = ("torch", "torchvision", "numpy", "zarr", "numcodecs", "dask", "h5py", "albumentations", "pymoo")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), as results and golden digests name the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    """The commit the benchmark's code is, ``+dirty`` when the code differs from it (a copy of a tree made
    elsewhere, such as a GPU machine's, may carry an older .git). ``ONDEVICE_TL_GIT_COMMIT`` names the
    commit where the copy's .git cannot (``benchmarks/gpu_check.sh`` passes it on)."""
    named = os.environ.get("ONDEVICE_TL_GIT_COMMIT")
    if named:
        return named
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=here, timeout=5)
        commit = out.stdout.strip() or None
        if commit is not None:
            code = ["pipeline", "stores", "recipes", "benchmarks/*.py", "benchmarks/pages", "pyproject.toml"]
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *code],
                                    capture_output=True, text=True, cwd=here.parent, timeout=10)
            if status.stdout.strip():
                commit += "+dirty"
        return commit
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    import torch

    mem = None
    try:
        import psutil

        mem = psutil.virtual_memory().total
    except ImportError:
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        # Other work on the machine when the result was written (1, 5, 15 min): on a shared host, the
        # difference between a quiet run and a contended one.
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "versions": {name: _version(name) for name in PACKAGES},
    }


def command() -> str:
    """The command line that produced this result, as a user would retype it."""
    module = sys.modules["__main__"].__spec__
    head = f"python -m {module.name}" if module is not None else f"python {sys.argv[0]}"
    return " ".join([head, *sys.argv[1:]])


def write_result(name: str, payload: dict[str, Any], directory: Path | None = None) -> Path:
    """Write ``benchmarks/results/<name>.json`` atomically, stamped with machine, versions and date.

    ``directory`` writes elsewhere instead: a trial run on a busy machine must not replace a committed result.
    """
    directory = RESULTS_DIR if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    record = {
        "name": name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "machine": machine(),
        "command": payload.pop("command", command()),
        **payload,
    }
    path = directory / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=float) + "\n")
    os.replace(tmp, path)
    return path
