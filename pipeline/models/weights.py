"""Weights files: content hashing, atomic save, safe load, and loading with readable mismatches.

A weights file is ``{"state_dict": {name: tensor}, "meta": {plain values}}`` so it loads
with ``torch.load(weights_only=True)`` (no pickled code runs). Plain state_dicts, such
as torchvision hub checkpoints, load too, with empty metadata.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import MissingPathError, ModelError
from ..lazy import lazy_module

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")

log = logging.getLogger(__name__)

StateDict = dict[str, "torch.Tensor"]
PLAIN = (str, int, float, bool, type(None))
MAX_LISTED = 8  # keys listed per category in a mismatch message; the count says how many more


def _state(module_or_state_dict: nn.Module | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(module_or_state_dict, nn.Module):
        return module_or_state_dict.state_dict()
    return module_or_state_dict


def state_dict_hash(module_or_state_dict: nn.Module | Mapping[str, Any]) -> str:
    """sha256 of names, dtypes, shapes and bytes in sorted key order: the same on every device."""
    h = hashlib.sha256()
    for key, value in sorted(_state(module_or_state_dict).items()):
        h.update(key.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}|{tuple(t.shape)}\0".encode())
            # Reinterpret as bytes so every dtype (bfloat16, bool) hashes without a numpy round trip.
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(f"{type(value).__name__}|{value!r}\0".encode())
    return h.hexdigest()


def _check_plain(value: Any, where: str) -> None:
    if isinstance(value, PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ModelError(f"weights metadata key {where}.{k!r} must be a string, "
                                 f"found {type(k).__name__}")
            _check_plain(v, f"{where}.{k}")
        return
    raise ModelError(f"weights metadata {where} must be a plain value (str/int/float/bool/None/list/dict) "
                     f"so the file loads with weights_only=True, found {type(value).__name__}")


def temp_beside(path: Path) -> tuple[int, Path]:
    """A new, uniquely named file in ``path``'s folder, open for writing, to be renamed over ``path``.

    Unlike ``tempfile.mkstemp`` (always 0600) it gets the mode of any new file, 0666 less the umask:
    what it becomes is a model file or an export's description that others read and copy.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


def save_weights(net: nn.Module | Mapping[str, torch.Tensor], path: str | Path,
                 metadata: Mapping[str, Any]) -> Path:
    """Write atomically: a crash leaves the old file or the new one, never a truncated file."""
    path = Path(path)
    _check_plain(dict(metadata), "meta")
    state: StateDict = {}
    for key, value in _state(net).items():
        if not isinstance(value, torch.Tensor):
            raise ModelError(f"state_dict entry {key!r} is a {type(value).__name__}, expected a tensor "
                             f"(saving {path})")
        state[key] = value.detach().to("cpu").contiguous()  # the same bytes whatever layout it trained in
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({"state_dict": state, "meta": dict(metadata)}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable; not every filesystem lets a directory be opened
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return path
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return path


# The first bytes of files people pass by mistake where a .pt file belongs (an image given as the model).
_MAGIC = {b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"GIF8": "a GIF image",
          b"BM": "a BMP image", b"RIFF": "a WebP image (or another RIFF file)", b"%PDF": "a PDF document",
          b"{": "a JSON or text file", b"\x1f\x8b": "a gzip archive"}


def not_a_torch_file(path: Path) -> str | None:
    """What ``path`` is when its first bytes say it is not a torch file (a zip archive, or a pickle from
    older torch), else None."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError:
        return None
    if head.startswith(b"PK") or head[:1] == b"\x80":
        return None
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            return kind
    return None


def missing_weights_message(path: Path, random: str = "random") -> str:
    """Why a weights file was not found, where it was looked for, and the ways on without one.

    The user who meets this is often offline with images of their own and no way to download
    weights: the two ways that need no file come first.
    """
    where = f"{path}" if path.is_absolute() else f"{path} (looked for {path.absolute()})"
    return (
        f"weights file not found: {where}. Without a weights file: train the backbone on images you "
        "have with a `pretrain` stage and give its name as `model:` (`python -m pipeline new own-data "
        f"FOLDER` writes such a recipe for an image folder), or write `weights: {random}` to start from "
        "random initialisation (transfer from it stays near chance). With one: copy a torchvision "
        "state_dict file (torch.save(model.state_dict())) to that path, or set `weights:` to where it is"
    )


def load_weights(path: str | Path) -> tuple[StateDict, dict[str, Any]]:
    """(state_dict, meta) from a file written by ``save_weights`` or a plain ``torch.save(state_dict)``."""
    path = Path(path)
    if not path.exists():
        raise MissingPathError(missing_weights_message(path))
    if not path.is_file():
        raise ModelError(f"weights path {path} is not a file (expected a .pt state_dict file)")
    kind = not_a_torch_file(path)
    if kind is not None:
        raise ModelError(f"weights file {path} is {kind}, not a file torch.save wrote (a .pt state_dict "
                         "file)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means the same thing to the user
        # torch's own message suggests weights_only=False, which would run whatever code the file holds:
        # never the advice for a file of unknown origin, so only its kind of failure is passed on.
        reason = "it holds objects other than tensors and plain values, which are never loaded" \
            if "weights_only" in str(exc) or "Unpickl" in type(exc).__name__ else \
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'unreadable'}"
        raise ModelError(f"cannot read weights file {path}: {reason} (corrupt, truncated, or not a file this "
                         "toolkit or torch.save(model.state_dict()) wrote)") from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        state, meta = obj["state_dict"], obj.get("meta") or {}
    elif isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        state, meta = obj, {}
    else:
        found = sorted(obj)[:MAX_LISTED] if isinstance(obj, dict) else type(obj).__name__
        raise ModelError(f"weights file {path} holds {found}, expected a state_dict (name -> tensor) "
                         "or {'state_dict': ..., 'meta': ...}")
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad or not isinstance(meta, dict):
        raise ModelError(f"weights file {path} has non-tensor state_dict entries {bad[:MAX_LISTED]} "
                         f"or non-dict meta ({type(meta).__name__})")
    return dict(state), dict(meta)


def _listed(keys: list[str]) -> str:
    more = f" (+{len(keys) - MAX_LISTED} more)" if len(keys) > MAX_LISTED else ""
    return ", ".join(keys[:MAX_LISTED]) + more


def _looks_torchvision(net: nn.Module, state_dict: Mapping[str, Any]) -> bool:
    # Only "blocks.": torchvision's Swin names its classifier "head." too, as our nets do.
    return hasattr(net, "from_torchvision_keys") and not any(k.startswith("blocks.") for k in state_dict)


def apply_weights(net: nn.Module, state_dict: Mapping[str, torch.Tensor], *, source: str,
                  strict_head: bool = False) -> list[str]:
    """Load ``state_dict`` into ``net`` or raise a ModelError listing every mismatch.

    With ``strict_head=False`` the final classifier layer may differ in size (weights
    trained on other classes): it keeps its fresh initialisation and a note says so.
    Returns those notes. Torchvision-named state_dicts are renamed first.
    """
    if _looks_torchvision(net, state_dict):
        state_dict = net.from_torchvision_keys(state_dict)  # type: ignore[operator]
    own = net.state_dict()
    # Listed in module order (blocks.2 before blocks.10) so the first problem shows first.
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    shape = [k for k in own if k in state_dict and tuple(own[k].shape) != tuple(state_dict[k].shape)]
    head_prefix = getattr(net, "final_layer_name", None)
    notes: list[str] = []
    if not strict_head and head_prefix and shape:
        skipped = [k for k in shape if k.startswith(head_prefix + ".")]
        if skipped:
            shape = [k for k in shape if k not in skipped]
            notes.append(f"classifier {head_prefix} not loaded from {source}: "
                         + ", ".join(f"{k} {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}"
                                     for k in skipped) + " (kept fresh initialisation)")
    else:
        skipped = []
    if missing or unexpected or shape:
        parts = []
        if missing:
            parts.append(f"missing keys: {_listed(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_listed(unexpected)}")
        if shape:
            parts.append("shape mismatches: " + _listed(
                [f"{k} {tuple(state_dict[k].shape)} in file vs {tuple(own[k].shape)} in model"
                 for k in shape]))
        arch = getattr(net, "arch", type(net).__name__)
        raise ModelError(f"weights from {source} do not fit {arch}: " + "; ".join(parts)
                         + " (check arch, width_mult and num_classes match the weights)")
    merged = {k: (own[k] if k in skipped else state_dict[k]) for k in own}
    net.load_state_dict(merged, strict=True)
    for note in notes:
        log.info(note)
    return notes


def hub_checkpoint(arch: str) -> Path | None:
    """A torchvision checkpoint for ``arch`` already in torch's hub cache; never downloads."""
    directory = Path(torch.hub.get_dir()) / "checkpoints"
    if not directory.is_dir():
        return None
    # torchvision names files "<arch>-<hash>.pth" (EfficientNet: "<arch>_<variant>-<hash>.pth").
    hits = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in (".pth", ".pt")
                  and p.name.startswith((f"{arch}-", f"{arch}_")) and "-" in p.name)
    return hits[0] if hits else None


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes: a weights or model file's content identity (never its path)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
