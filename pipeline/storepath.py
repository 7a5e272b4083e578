"""Where the store lives: --store, then the recipe's store.path, then $ONDEVICE_TL_STORE,
then a per-user cache."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import MissingPathError

ENV_VAR = "ONDEVICE_TL_STORE"


def user_cache_dir() -> Path:
    """The toolkit's per-user cache folder: ``$XDG_CACHE_HOME/ondevice-tl``, else ``~/.cache/ondevice-tl``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ondevice-tl"


def default_store() -> Path:
    return user_cache_dir() / "store"


def resolve_store(cli: str | None, recipe: str | None, *, create: bool = True) -> Path:
    explicit = cli or recipe or os.environ.get(ENV_VAR)
    if not explicit:
        path = default_store()
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(explicit).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise MissingPathError(f"store path {path} exists but is not a directory")
    # Create a new store only where the user clearly meant one: its parent must exist,
    # so a typo in a deep path fails instead of scattering caches around the disk.
    if create and path.parent.is_dir():
        path.mkdir()
        return path
    raise MissingPathError(
        f"store directory {path} does not exist"
        + ("" if create else "")
        + f" (its parent {path.parent} {'exists' if path.parent.is_dir() else 'does not exist either'}); "
        "create it, or pass --store DIR / set store.path / $" + ENV_VAR
    )
