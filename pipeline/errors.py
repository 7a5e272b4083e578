"""Exceptions raised by the pipeline package.

Every message says what was expected, what was found, and names the recipe file,
field, stage, sample or path involved, so a user never has to read a traceback.
Exceptions are rooted in ``ValueError`` (bad input) or ``OSError`` (environment) so
callers that already catch those keep working.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


class PipelineError(Exception):
    """Base of every error this package raises on purpose."""


class RecipeError(PipelineError, ValueError):
    """A recipe is malformed: wrong type, unknown key, invalid value."""


class StageError(PipelineError, ValueError):
    """A stage cannot be wired or configured (bad inputs, incompatible specs)."""


class DataError(PipelineError, ValueError):
    """A dataset or a sample is unusable (corrupt image, missing labels, empty split)."""


class ModelError(PipelineError, ValueError):
    """A model request cannot be met (unknown architecture, cut out of range, bad weights)."""


class BudgetError(PipelineError, ValueError):
    """No candidate of a search meets the user's budget; the message names the constraint and the
    nearest miss."""


class DeviceMemoryError(PipelineError, MemoryError):
    """The device (a GPU, or the CPU's RAM) ran out of memory while working: exit 1, not bad input, as
    the recipe is valid and the machine could not hold it at this size. The message names the stage,
    the batch size that failed and the setting to lower."""


class MissingPathError(PipelineError, FileNotFoundError):
    """A path the run needs does not exist; the message says how to provide it."""


class OutputError(PipelineError, ValueError):
    """An output directory (``--output``) holds something a run or sweep would overwrite or mix with, or
    is not a directory; the message names what is there and the way out (a new directory, ``--force``)."""


class StoreBudgetError(PipelineError, ValueError):
    """A run plans to store more than the store's byte budget (``--max-bytes``, ``store.max_bytes``) can
    hold: refused before any work, naming the entries and their estimated sizes."""


class PathPermissionError(PipelineError, PermissionError):
    """This user may not write a path the run needs (store, run directory); the message names the fix."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what systemd, docker and ``kill`` send), raised in the main thread.

    A KeyboardInterrupt, so it unwinds exactly like Ctrl-C: every ``finally`` and every handler
    of an interruption runs (nothing partial is committed, the run record is written), and the
    command then exits 143 (128 + SIGTERM) as a process killed by it would.
    """


class CacheMissWarning(UserWarning):
    """An input could not be fingerprinted, so its output will be recomputed, not reused."""


@contextmanager
def working_on(stage: str) -> Iterator[None]:
    """Any exception leaving this block names ``stage`` as where the run failed (``stage_of``), unless a
    stage inside it already did: the innermost stage at work is the one a run record names. A stream
    stage does its work when a consumer pulls, so an error there is named at that consumer."""
    try:
        yield
    except BaseException as exc:
        if stage_of(exc) is None:
            try:
                exc.failed_stage = stage  # type: ignore[attr-defined]
            except AttributeError:  # an exception type with __slots__: left unnamed
                pass
        raise


def stage_of(exc: BaseException) -> str | None:
    """The stage that was at work when ``exc`` was raised in a run (see ``working_on``), if known."""
    stage = getattr(exc, "failed_stage", None)
    return stage if isinstance(stage, str) else None


def nearest(name: str, choices: Iterable[str]) -> str | None:
    """The closest valid name to a typo, or None if nothing is close."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ' (did you mean 'x'?)' suffix for error messages, or ''."""
    choices = list(choices)
    hit = nearest(name, choices)
    return f" (did you mean {hit!r}?)" if hit else ""


# Modules that only one feature needs, installed by an extra of the package (pyproject.toml):
# module -> (extra, the feature that needs it).
OPTIONAL_MODULES: dict[str, tuple[str, str]] = {
    "pymoo": ("search", "the partition_search stage"),
    "networkx": ("search", "the partition_search stage"),
    "dask": ("dask", "the Dask executor (executor: {type: dask})"),
    "distributed": ("dask", "the Dask executor (executor: {type: dask})"),
    "h5py": ("hdf5", "HDF5 store entries (format: hdf5)"),
    "psutil": ("bench", "the benchmarks"),
}


def missing_dependency(exc: ModuleNotFoundError) -> str:
    """The message for a Python without the toolkit's dependencies: a setup step, not a bug."""
    name = (exc.name or "").split(".")[0]
    if name in OPTIONAL_MODULES:
        extra, feature = OPTIONAL_MODULES[name]
        return (
            f"error: {feature} needs {name!r}, which this Python ({sys.executable}) lacks; it comes with "
            f"the {extra!r} extra: `pip install -e '.[{extra}]'` in the repository (or "
            f"`pip install 'ondevice-tl[{extra}]'`); `.[all]` installs every extra"
        )
    return (
        f"error: this Python ({sys.executable}) lacks {exc.name or 'a module'!r}, which ondevice-tl needs; "
        "install the project into it (`pip install -e .` in the repository, as the README's first "
        "command does, or `pip install .` from a copy of it)"
    )
