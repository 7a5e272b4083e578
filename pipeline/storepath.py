"""Where the store lives: --store, then the recipe's store.path, then $ONDEVICE_TL_STORE,
then a per-user cache; and whether this process can use it."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import MissingPathError, PathPermissionError

ENV_VAR = "ONDEVICE_TL_STORE"
HOW_TO_CHOOSE = f"pass --store DIR, set store.path in the recipe, or set ${ENV_VAR}"
# What a run writes inside the store (stores/catalog.py): each must be writable when it exists.
WRITTEN_SUBDIRS = ("entries", "staging", "trash", "locks")


def user_cache_dir() -> Path:
    """The toolkit's per-user cache folder: ``$XDG_CACHE_HOME/ondevice-tl``, else ``~/.cache/ondevice-tl``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ondevice-tl"


def default_store() -> Path:
    return user_cache_dir() / "store"


def _not_a_directory(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` (or ``path`` itself) when it is not a directory."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def _writable(path: Path) -> bool:
    # os.access, not a trial write: it answers for this user without leaving anything behind.
    return os.access(path, os.W_OK | os.X_OK)


def _check_writable(path: Path) -> None:
    for candidate in (path, *(path / sub for sub in WRITTEN_SUBDIRS)):
        if candidate.is_dir() and not _writable(candidate):
            raise PathPermissionError(
                f"store directory {candidate} is not writable by this user (uid {os.getuid()}): a run "
                f"writes its cache entries, staging and locks there; fix: `chmod -R u+w {path}` (or run "
                f"as its owner), or use a store you can write: {HOW_TO_CHOOSE}"
            )


def _mkdir(path: Path, *, parents: bool) -> None:
    try:
        path.mkdir(parents=parents, exist_ok=True)
    except PermissionError:
        blocked = next((p for p in path.parents if p.exists()), path.parent)
        raise PathPermissionError(
            f"cannot create store directory {path}: {blocked} is not writable by this user "
            f"(uid {os.getuid()}); fix: create {path} with write access for this user, or {HOW_TO_CHOOSE}"
        ) from None


def resolve_store(
    cli: str | None, recipe: str | None, *, create: bool = True, writable: bool = False
) -> Path:
    """The store directory to use; ``create`` makes a new one where the user clearly meant one,
    ``writable`` checks that this process may write it (a run does; ``plan`` and ``cache ls`` only read)."""
    explicit = cli or recipe or os.environ.get(ENV_VAR)
    if not explicit:
        path = default_store()
        blocker = _not_a_directory(path)
        if blocker is not None:
            raise MissingPathError(
                f"the default store {path} cannot be created: {blocker} is a file, not a directory; "
                f"move it, or {HOW_TO_CHOOSE}"
            )
        _mkdir(path, parents=True)
        if writable:
            _check_writable(path)
        return path
    path = Path(explicit).expanduser()
    if path.is_dir():
        if writable:
            _check_writable(path)
        return path
    if path.exists():
        raise MissingPathError(f"store path {path} exists but is not a directory; {HOW_TO_CHOOSE}")
    blocker = _not_a_directory(path)
    if blocker is not None:
        raise MissingPathError(
            f"store path {path} cannot be a directory: {blocker} is a regular file, not a directory; "
            f"choose a path under a directory ({HOW_TO_CHOOSE})"
        )
    # Create a new store only where the user clearly meant one: its parent must exist,
    # so a typo in a deep path fails instead of scattering caches around the disk.
    if create and path.parent.is_dir():
        _mkdir(path, parents=False)
        return path
    raise MissingPathError(
        f"store directory {path} does not exist (its parent {path.parent} "
        f"{'exists' if path.parent.is_dir() else 'does not exist either'}); create it, or {HOW_TO_CHOOSE}"
    )
