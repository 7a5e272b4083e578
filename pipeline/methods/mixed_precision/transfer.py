"""The transfer probe: what freezing the layers below a cut costs the target task, measured by retraining.

Why the search needs it. The quantization search (``search.py``) measures accuracy on the model's
own task, through the model's own classifier, with the weights it was pretrained with. There,
freezing a layer costs nothing by construction (nothing is retrained, and the classifier was trained
on exactly those layers), so the only loss a cut can show is quantization's, and int8 costs a few
tenths of a point at most at every layer. Every cut then scores like the last one, and Definition 7
(the highest cut within δ) picks the cut before the classifier, where the transfer retrains a single
linear layer on features specialised to the pretraining classes. What a cut actually trades is how
well the top above it adapts to the target task, and only retraining shows that.

So each cut the quantization search allows (its bottom runs int8 within δ) is retrained the way the
transfer will be: the bottom, fake-quantized to 8 bits as the int8 kernels will run it, computes
the target's train and val features once; the top above the cut, initialised with the pretrained
weights and a fresh classifier, trains on those features with the transfer's own settings (a recipe
shares them with its finetune stages) at the top's precision; the cut's score is the top's best
validation accuracy over its epochs, which is how the finetune stage picks its checkpoint.

The pick is the best-scoring cut (equal scores go to the higher cut), or, with a tolerance
(``probe.delta``), the highest cut within it of the best: Definition 7's rule on these scores
(``select_cut``). The tolerance defaults to 0, not to the search's δ: a score measured on a few
hundred validation images is noisy (about a point), and a tolerance puts the pick at its edge, up
to the tolerance below the best before that noise. The cost is one transfer training per candidate
cut, without the test evaluation.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import ModelError
from ...lazy import lazy_module
from ..microbatch import DEFAULT_MICRO_BATCH, MicroBatches
from ..trainer import TrainConfig, thread_invariant, train

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")


@dataclass(frozen=True)
class Labelled:
    """Images (or features) and their labels, in memory."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)


def features(bottom: nn.Module, x: torch.Tensor, batch_size: int, device: torch.device) -> torch.Tensor:
    """``bottom(x)`` in eval mode without gradients, on ``device``; on a CPU under ``run.deterministic``
    in fixed micro-batches, so the features (and the scores trained on them) do not depend on the
    thread count."""
    bottom.eval()
    out = []
    with contextlib.ExitStack() as stack:
        micro = None
        if thread_invariant(device):
            from ...threads import compute_threads

            micro = stack.enter_context(MicroBatches(bottom, DEFAULT_MICRO_BATCH, compute_threads()))
        with torch.no_grad():
            for i in range(0, len(x), batch_size):
                chunk = x[i:i + batch_size].to(device)
                out.append(bottom(chunk) if micro is None else micro.forward(chunk, contextlib.nullcontext))
    return torch.cat(out)


def probe_cut(bottom: nn.Module, top: nn.Module, data_train: Labelled, data_val: Labelled, cfg: TrainConfig,
              *, batch_size: int, seed: int, device: torch.device, eval_batch_size: int = 256,
              label: str = "probe", bars: Any = None) -> dict[str, Any]:
    """Train ``top`` on ``bottom``'s features of ``data_train`` for ``cfg.epochs``; its score is the
    best accuracy on ``data_val`` over the epochs (the finetune stage's checkpoint rule).

    ``bottom`` is run as given (frozen, eval mode); ``top`` trains in place, on ``device``.
    The training order is drawn from ``seed`` and the epoch, like a stored stream's shuffle.
    """
    start = time.perf_counter()
    train_f = Labelled(features(bottom, data_train.x, eval_batch_size, device), data_train.y.to(device))
    val_f = Labelled(features(bottom, data_val.x, eval_batch_size, device), data_val.y.to(device))
    top.to(device)
    n = len(train_f)

    def train_batches(epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        for i in range(0, n, batch_size):
            idx = order[i:i + batch_size].to(device)
            yield train_f.x[idx], train_f.y[idx]

    def val_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, len(val_f), eval_batch_size):
            yield val_f.x[i:i + eval_batch_size], val_f.y[i:i + eval_batch_size]

    params = [p for p in top.parameters() if p.requires_grad]
    result = train(top, params, train_batches, val_batches, cfg, checkpoint_dir=None,
                   steps_per_epoch=math.ceil(n / batch_size), batch_size=batch_size, label=label, bars=bars)
    if result.best_val_acc is None:  # train() evaluates every epoch when given val batches
        raise ModelError(f"{label}: the probe's training reported no validation accuracy")
    return {
        "score": result.best_val_acc,
        "best_epoch": result.best_epoch,
        "val_accuracy_all": [h["val_acc"] for h in result.history],
        "val_loss_all": [h["val_loss"] for h in result.history],
        "train_loss_all": [h["train_loss"] for h in result.history],
        "train_samples": n,
        "val_samples": len(val_f),
        "trainable_parameters": sum(p.numel() for p in params),
        "seconds": time.perf_counter() - start,
    }


def select_cut(records: Sequence[dict[str, Any]], delta: float) -> dict[str, Any]:
    """Definition 7 on the probe's scores: the highest cut (most layers below) whose score is within
    relative ``delta`` of the best score (``delta`` 0: the best score, equal scores to the higher cut)."""
    if not records:
        raise ModelError("cannot select a cut: no cut was probed")
    if not 0.0 <= delta < 1.0:
        raise ModelError(f"delta must be in [0, 1), found {delta}")
    best = max(r["score"] for r in records)
    feasible = [r for r in records if r["score"] >= (1.0 - delta) * best - 1e-12]
    return max(feasible, key=lambda r: r["layers_below"])


def probe_cuts(cuts: Sequence[tuple[int, int, str]], make: Callable[[int], tuple[nn.Module, nn.Module]],
               data_train: Labelled, data_val: Labelled, cfg: TrainConfig, *, batch_size: int, seed: int,
               device: torch.device, eval_batch_size: int = 256, bars: Any = None,
               log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """``probe_cut`` for every ``(layers_below, train_last_blocks, cut_layer)``, highest cut first;
    ``make(train_last_blocks)`` gives that cut's (quantized bottom, fresh top)."""
    records = []
    for layers_below, tlb, layer in sorted(cuts, reverse=True):
        bottom, top = make(tlb)
        rec = probe_cut(bottom, top, data_train, data_val, cfg, batch_size=batch_size, seed=seed,
                        device=device, eval_batch_size=eval_batch_size, label=f"probe tlb {tlb}", bars=bars)
        records.append({"layers_below": layers_below, "train_last_blocks": tlb, "cut_layer": layer, **rec})
        if log is not None:
            log(f"probe: cut after {layer} (train_last_blocks {tlb}): val acc {rec['score']:.4f} "
                f"(epoch {rec['best_epoch']}, {rec['seconds']:.0f}s)")
    return records
