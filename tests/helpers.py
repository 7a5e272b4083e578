"""Helpers for tests that run the pipeline as a user does: ``python -m pipeline run`` in a subprocess."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# How the interpreter is told to run the CLI; ("-c", SCRIPT) runs a wrapper script instead.
PIPELINE_MODULE = ("-m", "pipeline")


def run_argv(
    recipe: Path, store: Path, output: Path, *extra: str, entry: tuple[str, ...] = PIPELINE_MODULE
) -> list[str]:
    """argv of ``python -m pipeline run RECIPE --store STORE --output OUTPUT *EXTRA``."""
    paths = [str(recipe), "--store", str(store), "--output", str(output)]
    return [sys.executable, *entry, "run", *paths, *extra]


def run_pipeline(
    recipe: Path,
    store: Path,
    output: Path,
    *extra: str,
    entry: tuple[str, ...] = PIPELINE_MODULE,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run the recipe to completion (from the repository root), capturing stdout and stderr as text."""
    return subprocess.run(
        run_argv(recipe, store, output, *extra, entry=entry),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def start_pipeline(
    recipe: Path,
    store: Path,
    output: Path,
    *extra: str,
    stdout: int = subprocess.PIPE,
    start_new_session: bool = False,
) -> subprocess.Popen[str]:
    """Start the recipe in the background (to interrupt it); stderr is piped, text mode.

    The child gets SIGINT's default action back: a shell without job control starts background jobs
    (e.g. a test suite run with ``&``) with SIGINT ignored, and Python keeps an inherited SIG_IGN, so
    Ctrl-C tests would otherwise see a run that never noticed the signal.
    """
    return subprocess.Popen(
        run_argv(recipe, store, output, *extra),
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=start_new_session,
        preexec_fn=_default_sigint,
    )


def sigkill_at_checkpoint(proc: subprocess.Popen[str], store: Path, pattern: str = "*/last.pt",
                          timeout: float = 600) -> None:
    """SIGKILL ``proc`` (a run or update writing into ``store``, stderr piped) as soon as a file matching
    ``pattern`` appears in the store's staging: a crash in mid-training, after its first checkpoint."""
    deadline = time.monotonic() + timeout
    try:
        while not list((store / "staging").glob(pattern)):
            if proc.poll() is not None:
                said = proc.stderr.read() if proc.stderr is not None else ""
                raise AssertionError(f"it ended before a checkpoint appeared: {said}")
            assert time.monotonic() < deadline, f"no checkpoint after {timeout:g} s"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stage_call(stage: Any, name: str, ctx: Any = None, **inputs: Any) -> Any:
    """The ``StageCall`` the runner would hand ``stage`` named ``name`` for input specs ``inputs``."""
    from pipeline.stage import StageCall, StageInputs

    return StageCall(name, stage.resolve(StageInputs(inputs), ctx), inputs)
