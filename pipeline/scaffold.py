"""``python -m pipeline new NAME [DIR]``: copy the example recipes that ship with the package into a folder.

After a non-editable ``pip install`` there is no repository checkout, so the recipes the README runs travel
inside the package (``pipeline/recipes``; in the repository a symlink to ``recipes/``) and this command
writes them where the user works. Names are the shipped recipes' folders (``neuroflux`` writes
``neuroflux/digits.yaml`` and ``neuroflux/fashion_mnist.yaml``), ``quickstart`` and ``all``; files keep
their paths relative to ``recipes/``. Existing files are never overwritten without ``force``, and the check
covers every file before the first one is written, so a refusal leaves the folder as it was.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from .errors import MissingPathError, PipelineError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable  # 3.11+; only named for the type checker

ALL = "all"


class ScaffoldError(PipelineError, ValueError):
    """The example recipes cannot be written as asked (a file exists, an unknown name, a bad folder)."""


def _root() -> Traversable:
    root = files("pipeline") / "recipes"
    if not root.is_dir():
        raise MissingPathError(
            f"the example recipes are not installed with this copy of the toolkit (expected {root}); "
            "reinstall it (`pip install .` from the repository) or copy recipes/ from the repository"
        )
    return root


def _walk(node: Traversable, prefix: PurePosixPath) -> list[tuple[PurePosixPath, Traversable]]:
    found = []
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.is_dir():
            found += _walk(child, prefix / child.name)
        elif child.name.endswith(".yaml"):
            found.append((prefix / child.name, child))
    return found


def shipped() -> dict[PurePosixPath, Traversable]:
    """Every shipped recipe: its path relative to ``recipes/`` -> the packaged file."""
    return dict(_walk(_root(), PurePosixPath()))


def names() -> list[str]:
    """What ``new`` accepts: each top-level recipe's stem, each folder of recipes, and ``all``."""
    tops = {p.parts[0] if len(p.parts) > 1 else p.stem for p in shipped()}
    return sorted(tops) + [ALL]


def selected(name: str) -> dict[PurePosixPath, Traversable]:
    recipes = shipped()
    if name == ALL:
        return recipes
    chosen = {
        p: f for p, f in recipes.items() if (p.parts[0] == name if len(p.parts) > 1 else p.stem == name)
    }
    if not chosen:
        raise ScaffoldError(f"no example recipe called {name!r}; expected one of: {', '.join(names())}")
    return chosen


@dataclass(frozen=True)
class Written:
    path: Path
    action: str  # "written", "overwritten" or "unchanged" (already there with the same bytes)


def write(name: str, dest: Path, *, force: bool = False) -> list[Written]:
    """Copy the example recipe(s) ``name`` into ``dest`` (created if missing); see the module docstring."""
    chosen = {dest.joinpath(*rel.parts): f.read_bytes() for rel, f in selected(name).items()}
    if dest.exists() and not dest.is_dir():
        raise ScaffoldError(f"{dest} is a file, expected a folder to write the example recipes into")
    clashes = [p for p, data in chosen.items() if p.exists() and (not p.is_file() or p.read_bytes() != data)]
    if clashes and not force:
        listed = ", ".join(str(p) for p in clashes)
        raise ScaffoldError(
            f"{listed} already exist{'s' if len(clashes) == 1 else ''} with other content; nothing was "
            "written (add --force to overwrite, or pick another folder: `python -m pipeline new NAME DIR`)"
        )
    done = []
    for path, data in chosen.items():
        if path.is_file() and path.read_bytes() == data:
            done.append(Written(path, "unchanged"))
            continue
        existed = path.exists()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                raise ScaffoldError(f"{path} is a folder; cannot write a recipe over it, even with --force")
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)  # a reader never sees half a recipe
        except PermissionError as exc:
            raise ScaffoldError(
                f"cannot write {path}: permission denied ({exc.strerror}); pick a folder you can write to"
            ) from None
        except FileExistsError:  # a path component is a file (mkdir refuses)
            raise ScaffoldError(f"cannot create the folder for {path}: a file is in the way") from None
        except NotADirectoryError:
            raise ScaffoldError(f"cannot write {path}: a part of that path is a file, not a folder") from None
        done.append(Written(path, "overwritten" if existed else "written"))
    return done
