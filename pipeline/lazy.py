"""Heavy libraries imported on first use, not when a module is imported.

``python -m pipeline validate`` (and ``stages``) only needs pyyaml and pydantic:
a recipe can be checked on a machine that does not have torch, zarr or h5py, such
as the laptop that prepares recipes for a Pi, or a lint job. Modules on that path
write ``torch = lazy_module("torch")`` instead of ``import torch``; the library is
imported the first time an attribute is read, and a missing one raises the usual
``ModuleNotFoundError`` there (the CLI turns it into a setup message).

Type checkers see the real module through an ``if TYPE_CHECKING: import torch``
beside it. Anything used at import time (a base class, a decorator, a constant)
cannot be lazy: such code lives in a module that is only imported when work runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from typing import Any

from .errors import OPTIONAL_MODULES


class LazyModule(types.ModuleType):
    """Stands in for a module until an attribute is read, then forwards to it."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            # copy, pickle and introspection probe dunders: never import for those
            raise AttributeError(attr)
        module = importlib.import_module(self.__name__)
        # Later reads hit the copied namespace directly; attributes the module
        # gains afterwards still come through this method.
        self.__dict__.update(module.__dict__)
        return getattr(module, attr)


def lazy_module(name: str) -> Any:
    """A stand-in for ``import name`` that imports on first attribute access."""
    return LazyModule(name)


def require(name: str) -> None:
    """Fail now, before any work, when an optional module (an extra's, ``errors.OPTIONAL_MODULES``) is
    missing, rather than when it is first used, maybe after an hour of work. The error names the extra."""
    if importlib.util.find_spec(name) is not None:
        return
    extra, feature = OPTIONAL_MODULES.get(name, ("all", "this feature"))
    raise ModuleNotFoundError(
        f"No module named {name!r}: {feature} needs it; install the {extra!r} extra "
        f"(`pip install -e '.[{extra}]'` in the repository, or `pip install 'ondevice-tl[{extra}]'`)",
        name=name,
    )
