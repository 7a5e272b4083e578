"""Early exit: pick the layer whose auxiliary head becomes the model's output, and export it.

Local learning gives every layer a classifier, so any prefix of the network is a complete
model. The exit is the layer with the highest validation accuracy; among layers within
``tolerance`` of that best accuracy (near ties), the one with the fewest parameters wins
(``rule: best`` ignores the tolerance). The compact model (layers up to the exit plus its
head) is exported with ``torch.export`` to a ``.pt2`` file that stock PyTorch loads
(``torch.export.load(path).module()``) without any of this toolkit's code.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ...lazy import lazy_module

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")


ExitRule = Literal["fewest_parameters_within", "best"]


@dataclass(frozen=True)
class ExitCandidate:
    layer: int
    val_acc: float
    parameters: int  # of the compact model ending at this layer's head

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_exit(
    candidates: Sequence[ExitCandidate],
    *,
    rule: ExitRule = "fewest_parameters_within",
    tolerance: float = 0.005,
) -> ExitCandidate:
    if not candidates:
        raise ValueError("no exit candidates: no layer was evaluated")
    if tolerance < 0:
        raise ValueError(f"exit tolerance must be >= 0, got {tolerance}")
    best = max(c.val_acc for c in candidates)
    if rule == "best":
        # Highest accuracy; an exact tie goes to the smaller model.
        return min((c for c in candidates if c.val_acc == best), key=lambda c: (c.parameters, c.layer))
    if rule != "fewest_parameters_within":
        raise ValueError(f"unknown exit rule {rule!r}; expected 'fewest_parameters_within' or 'best'")
    near = [c for c in candidates if c.val_acc >= best - tolerance - 1e-12]
    return min(near, key=lambda c: (c.parameters, -c.val_acc, c.layer))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def export_model(model: nn.Module, sample_shape: tuple[int, ...], path: Path) -> Path:
    """Write ``model`` (in eval mode) as a ``torch.export`` program; any batch size is accepted."""
    model = model.eval()
    example = (torch.zeros(2, *sample_shape),)
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(model, example, dynamic_shapes=({0: batch},))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")  # torch.export wants the .pt2 suffix
    torch.export.save(program, tmp)
    tmp.replace(path)  # never a half-written model under the final name
    return path


def load_exported(path: Path) -> nn.Module:
    return torch.export.load(str(path)).module()


def throughput(
    model: nn.Module, sample_shape: tuple[int, ...], *, batch: int = 64, repeats: int = 5
) -> float:
    """Inference images/s on the model's device (best of ``repeats`` timed batches after one warm-up;
    on CUDA each timing waits for the kernels to finish)."""
    model = model.eval()
    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    x = torch.randn(batch, *sample_shape).to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    best = float("inf")
    with torch.inference_mode():
        model(x)
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            model(x)
            sync()
            best = min(best, time.perf_counter() - t0)
    return batch / best
