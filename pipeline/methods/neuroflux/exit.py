"""Early exit: pick the layer whose auxiliary head becomes the model's output, and export it.

Local learning gives every layer a classifier, so any prefix of the network is a complete
model. The exit is the layer with the highest validation accuracy; among layers within
``tolerance`` of that best accuracy (near ties), the one with the fewest parameters wins
(``rule: best`` ignores the tolerance). ``rule: fewest_parameters_near_full`` holds exits to the
full model's accuracy instead (the last layer's exit: every layer and its head), the question a
user compressing a model asks; the best of many noisy validation accuracies sits above it by
chance, which a tolerance of a point cannot absorb on a small validation split. With
``exit_finetune_epochs``, :func:`search_exit` fine-tunes candidates end to end, smallest first,
before comparing them (a prefix trained layer by layer for its own losses gains from training as
one model for one head). The compact model
(layers up to the exit plus its head) is exported with ``torch.export`` to a ``.pt2`` file that
stock PyTorch loads (``torch.export.load(path).module()``) without any of this toolkit's code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ...lazy import lazy_module

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")


ExitRule = Literal["fewest_parameters_within", "fewest_parameters_near_full", "best"]
EXIT_RULES: tuple[str, ...] = ExitRule.__args__  # type: ignore[attr-defined]


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
    if rule == "best":
        best = max(c.val_acc for c in candidates)
        # Highest accuracy; an exact tie goes to the smaller model.
        return min((c for c in candidates if c.val_acc == best), key=lambda c: (c.parameters, c.layer))
    reference = reference_accuracy(candidates, rule)
    near = [c for c in candidates if c.val_acc >= reference - tolerance - 1e-12]
    return min(near, key=lambda c: (c.parameters, -c.val_acc, c.layer))


def reference_accuracy(candidates: Sequence[ExitCandidate], rule: ExitRule) -> float:
    """The validation accuracy exits are held to: the best exit's, or the full model's (the last layer's)."""
    if rule in ("fewest_parameters_within", "best"):
        return max(c.val_acc for c in candidates)
    if rule == "fewest_parameters_near_full":
        return max(candidates, key=lambda c: c.layer).val_acc
    raise ValueError(f"unknown exit rule {rule!r}; expected one of {', '.join(EXIT_RULES)}")


# How far below the reference (beyond the tolerance) an exit may start and still be fine-tuned, by default
# (the stage's exit_finetune_reach): an exit further below is unlikely to reach the tolerance and not worth
# the epochs its try costs. Fine-tuning raised VGG-11's exits by up to about 3 points; VGG-16's and
# ResNet-18's deeper ones gained up to 4.3 (benchmarks/README.md, NeuroFlux), and the Fashion-MNIST recipe
# sets 0.045 for them. This default stays: a new one would change which exit recipes that leave it unset
# get, under the same fingerprint.
FINETUNE_REACH = 0.03


@dataclass(frozen=True)
class FinetunedExit:
    layer: int
    val_acc_before: float
    val_acc: float  # after fine-tuning (the untouched exit's where fine-tuning did not improve it)
    batch_size: int | None = None  # None: not fine-tuned (no batch fits the memory budget)
    seconds: float = 0.0
    # The exit: within the tolerance after fine-tuning, or the untouched rule's own choice (search_exit)
    accepted: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def search_exit(
    candidates: Sequence[ExitCandidate],
    finetune: Callable[[ExitCandidate], FinetunedExit],
    *,
    rule: ExitRule = "fewest_parameters_within",
    tolerance: float = 0.005,
    reach: float = FINETUNE_REACH,
) -> tuple[ExitCandidate, list[FinetunedExit]]:
    """The smallest exit within ``tolerance`` of the rule's reference accuracy once fine-tuned, fine-tuning
    only what the search needs: candidates in order of size, each starting within ``tolerance + reach`` of
    the reference; the first whose fine-tuned accuracy is within ``tolerance`` is the exit.
    :func:`choose_exit`'s own choice (within the tolerance as trained) ends the search at the latest,
    fine-tuned too; the ``best`` rule fine-tunes only its choice. Returns the exit (its fine-tuned
    accuracy) and every try, the exit last.

    The reference stays the one *as trained* (:func:`reference_accuracy`), so fine-tuning a small exit never
    moves the bar it is held to.
    """
    chosen = choose_exit(candidates, rule=rule, tolerance=tolerance)
    if rule == "best":
        tried = replace(finetune(chosen), accepted=True)
        return ExitCandidate(chosen.layer, tried.val_acc, chosen.parameters), [tried]
    reference = reference_accuracy(candidates, rule)
    tries: list[FinetunedExit] = []
    for c in sorted(candidates, key=lambda c: (c.parameters, c.layer)):
        if c.val_acc < reference - tolerance - reach - 1e-12:
            continue
        tried = finetune(c)
        within = tried.val_acc >= reference - tolerance - 1e-12
        tried = replace(tried, accepted=within or c.layer == chosen.layer)
        tries.append(tried)
        if tried.accepted:
            return ExitCandidate(c.layer, tried.val_acc, c.parameters), tries
    raise AssertionError("unreachable: the untouched choice is within the tolerance")


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
