"""The resumable training checkpoint: everything an epoch loop needs to continue bit for bit.

``last.pt`` is written after every finished epoch, atomically (temp file, fsync, rename, then
the directory fsynced), so a process killed at any moment leaves the previous epoch's checkpoint
or this one, never a torn file. It holds

- ``state_dict`` and ``meta``: the model, in ``save_weights`` form (``load_weights`` reads it);
- ``optimizer``: the optimizer's state (moments, step counts); the lr schedule is a pure function
  of the position in epochs (``TrainConfig.lr_at``), so the epoch and ``steps_per_epoch`` are its
  whole state;
- ``amp``: the precision and the fp16 gradient scaler's state;
- ``rng``: torch's CPU generator, the CUDA generator of the training device when there is one,
  Python's and NumPy's global generators. The data order and the augmentations are pure functions
  of (seed, epoch, sample), so no data-order generator needs saving: epoch ``e`` reads the same
  batches in a resumed run as in an uninterrupted one;
- ``history``, ``best_val_acc``, ``best_epoch``: the record so far, so the result of a resumed
  run is the uninterrupted run's;
- ``fingerprint``: the stage fingerprint it was trained under. A checkpoint whose fingerprint
  differs from the run's (a changed recipe) is never resumed.

Everything is a tensor or a plain value, so it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stores.durable import atomic_write_bytes

from ..errors import ModelError
from ..lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

CHECKPOINT_FILE = "last.pt"
FORMAT = 1


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every generator a training step may draw from, as tensors and plain values."""
    np_state: Any = np.random.get_state()  # legacy tuple form
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _tuples(value: Any) -> Any:
    """random.setstate wants tuples all the way down; a round trip through pickle keeps them, but be sure."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically and durably (a crash leaves the old file or the new one)."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buf)
    atomic_write_bytes(path, buf.getbuffer())


def load_checkpoint(path: Path, fingerprint: str) -> dict[str, Any] | None:
    """The checkpoint at ``path`` if it was written under ``fingerprint``; None if absent or stale."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means the same thing to the user
        raise ModelError(f"cannot read the training checkpoint {path}: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}; delete it to train from the "
                         "start") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "optimizer" not in state:
        return None  # an older last.pt (weights only): nothing to resume from
    if state.get("fingerprint") != fingerprint:
        return None
    return state
