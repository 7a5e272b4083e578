"""The CUDA allocator's view of one training step (``device_step_peak``), beside the meter of
``pipeline.models.memory``: what the analytic and saved-tensor counts leave out (temporaries, kernel
workspaces, allocator rounding) shows up only here. Apart from the meter so that each file holds one
concept; ``pipeline.models.memory`` re-exports it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def optimizer_slots(optimizer: str, momentum: float) -> int:
    if optimizer in ("adam", "adamw"):
        return 2
    if optimizer == "sgd":
        return 1 if momentum > 0 else 0
    raise ValueError(f"unknown optimizer {optimizer!r}; expected adamw, adam or sgd")


def _optimizer(params: list[nn.Parameter], optimizer: str, momentum: float) -> torch.optim.Optimizer:
    """The trainer's optimizer kind, fused as the trainer makes it on CUDA (its state is the same size)."""
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=momentum, fused=True)
    cls = torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=1e-3, fused=True)


def device_step_peak(module: nn.Module, input_shape: tuple[int, ...], device: torch.device | str, *,
                     num_classes: int | None = None, optimizer: str = "adamw", momentum: float = 0.9,
                     seed: int = 0, input_requires_grad: bool = False) -> int:
    """Bytes the CUDA allocator held at the peak of one training step of a copy of ``module`` on
    ``device``, above what it held before the copy: weights, gradients, optimizer state, activations
    and every temporary. The module itself is untouched."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device_step_peak reads the CUDA allocator; {device} has none (use footprint)")
    optimizer_slots(optimizer, momentum)  # unknown optimizer: the same error as footprint's
    # The libraries' first use on a device allocates what they keep for good (cuBLAS's workspace, tens
    # of MiB): a step on a throwaway copy first, so that lands in the base, not in this step's peak.
    _one_step(copy.deepcopy(module).to(device).train(), input_shape, device, num_classes, optimizer,
              momentum, seed, input_requires_grad)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _one_step(copy.deepcopy(module).to(device).train(), input_shape, device, num_classes, optimizer,
              momentum, seed, input_requires_grad)
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def _one_step(work: nn.Module, input_shape: tuple[int, ...], device: torch.device, num_classes: int | None,
              optimizer: str, momentum: float, seed: int, input_requires_grad: bool) -> None:
    """One training step of ``work`` (already on ``device``) on random data; everything it allocated is
    freed when it returns."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in work.parameters() if p.requires_grad]
    opt = _optimizer(params, optimizer, momentum) if params else None
    x = torch.randn(*input_shape, generator=gen).to(device).requires_grad_(input_requires_grad)
    with torch.enable_grad():
        out = work(x)
        if out.dim() == 2:
            y = torch.randint(0, num_classes or out.shape[-1], (out.shape[0],), generator=gen).to(device)
            loss = nn.functional.cross_entropy(out, y)
        else:
            loss = out.sum()
        if loss.requires_grad:
            loss.backward()
    if opt is not None:
        opt.step()
