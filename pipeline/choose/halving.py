"""Successive halving over candidates: many short trainings, then fewer longer ones, one at full length.

Rung 0 trains every candidate that fits the memory budget for a few epochs; the best ``1/eta``
(by validation accuracy) go on to a rung of ``eta`` times more epochs, and so on until one is left,
trained for the recipe's full epochs. The number of rungs comes from the number of candidates:
with ``n`` candidates, rung ``i`` keeps ``ceil(n / eta**i)`` of them, and the last rung (one
candidate) trains ``epochs`` epochs, rung ``i`` ``epochs / eta**(R - i)`` (at least 1).

Every training is a :func:`pipeline.api.run` of the recipe with the candidate's overrides, in one
shared store: the backbone and each distinct cache are built once and every later training reuses
them, and a training already stored (the same candidate at the same epochs, from an earlier choose)
is reused, not repeated. A rung retrains from the start: the finetune checkpoint
(``pipeline.methods.checkpoint``) belongs to the stage's fingerprint, which holds the epoch count,
and the learning rate schedule is a function of the total epochs, so a 3-epoch run is not the first
3 epochs of a 9-epoch run and cannot be continued into one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..api import run
from ..errors import BudgetError
from ..recipe import Recipe
from .meter import candidate_recipe
from .space import Candidate


@dataclass
class Trained:
    """One training of one candidate: what it scored and what it cost."""

    candidate: str
    epochs: int
    val_accuracy: float  # of the epoch chosen on validation data (the stored model's)
    val_loss: float | None  # of that epoch: breaks ties of accuracy on a small validation split
    test_accuracy: float
    epoch_seconds: float  # per training epoch, measured (the first, one-off epoch left out if there are more)
    train_seconds: float  # the trainer stage's wall time (0 when its result was stored already)
    build_seconds: float  # stored stages this run had to build first (backbone, caches)
    built: list[str]  # their names
    status: str  # computed | reused
    run_dir: str


def train_candidates(
    recipe: str | Path | Recipe, candidates: list[Candidate], epochs: int, *, target: str,
    store: str | Path | None, output: Path, log: Callable[[str], None] = print, rung: int = 0,
) -> list[Trained]:
    """Train each candidate for ``epochs`` epochs (a run of the recipe with its overrides, in ``store``)."""
    results = []
    for i, candidate in enumerate(candidates):
        resolved = candidate_recipe(recipe, candidate, target, {f"stages.{target}.train.epochs": epochs})
        result = run(resolved, store=store, output=output / "runs" / f"{candidate.id}-e{epochs}", quiet=True)
        metrics: dict[str, Any] = result.outputs[target]
        report = result.stages[target]
        built = [r for r in result.stages.values()
                 if r.name != target and r.status == "computed" and resolved.stages[r.name].cacheable]
        losses, best = metrics.get("val_loss_all") or [], metrics.get("best_epoch")
        trained = Trained(
            candidate=candidate.id, epochs=epochs, val_accuracy=float(metrics["best_val_accuracy"]),
            val_loss=losses[best] if isinstance(best, int) and best < len(losses) else None,
            test_accuracy=float(metrics["accuracy"]), epoch_seconds=float(metrics["epoch_seconds_steady"]),
            train_seconds=report.seconds if report.status == "computed" else 0.0,
            build_seconds=sum(r.seconds for r in built), built=[r.name for r in built], status=report.status,
            run_dir=str(result.run_dir),
        )
        extra = f"; built {', '.join(trained.built)} in {trained.build_seconds:.1f}s" if built else ""
        log(f"[rung {rung}, {epochs} epoch{'s' if epochs != 1 else ''}, {i + 1}/{len(candidates)}] "
            f"{candidate.id} {candidate.describe()}: val {trained.val_accuracy:.3f}, "
            f"{trained.epoch_seconds:.2f} s/epoch ({trained.status}{extra})")
        results.append(trained)
    return results


def rung_epochs(n: int, epochs: int, eta: int, min_epochs: int = 1) -> list[int]:
    """Epochs of each rung for ``n`` candidates: the last rung (one candidate) at ``epochs``."""
    sizes = [n]
    while sizes[-1] > 1:
        sizes.append(math.ceil(sizes[-1] / eta))
    last = len(sizes) - 1
    return [max(min_epochs, min(epochs, round(epochs / eta ** (last - i)))) for i in range(len(sizes))]


@dataclass
class Rung:
    epochs: int
    trained: dict[str, Trained]  # candidate id -> result
    kept: list[str] = field(default_factory=list)  # ids that go on (the winner alone, at the last rung)


@dataclass
class Halving:
    rungs: list[Rung]
    dropped: dict[str, str]  # candidate id -> where and why it dropped out ('at rung 1: ranked 3 of 3')
    winner: str


Train = Callable[..., list[Trained]]


def _rank_key(t: Trained) -> tuple[float, float]:
    """Higher validation accuracy first; equal accuracy (frequent on a small split): lower loss first.
    ``sorted`` is stable, so a full tie keeps the candidates' order."""
    return -t.val_accuracy, t.val_loss if t.val_loss is not None else math.inf


def successive_halving(
    recipe: str | Path | Recipe, candidates: list[Candidate], *, target: str, epochs: int, eta: int,
    max_epoch_seconds: float, store: str | Path | None, output: Path, min_epochs: int = 1,
    log: Callable[[str], None] = print, train: Train = train_candidates,
) -> Halving:
    """Halve ``candidates`` (all within the memory budget) down to one trained at ``epochs`` epochs.

    Candidates slower than ``max_epoch_seconds`` per epoch in rung 0 drop out there; if every one
    does, :class:`~pipeline.errors.BudgetError` names the fastest.
    """
    schedule = rung_epochs(len(candidates), epochs, eta, min_epochs)
    by_id = {c.id: c for c in candidates}
    alive = [c.id for c in candidates]
    rungs: list[Rung] = []
    dropped: dict[str, str] = {}
    step = 0
    while True:
        rung_no = len(rungs)
        # One survivor left before the schedule ends: it goes straight to the full epochs.
        rung_epochs_now = schedule[step] if len(alive) > 1 else schedule[-1]
        results = train(recipe, [by_id[i] for i in alive], rung_epochs_now, target=target, store=store,
                        output=output, log=log, rung=rung_no)
        rung = Rung(rung_epochs_now, {r.candidate: r for r in results})
        rungs.append(rung)
        if rung_no == 0:
            slow = [i for i in alive if rung.trained[i].epoch_seconds > max_epoch_seconds]
            for i in slow:
                dropped[i] = (f"after rung 0: {rung.trained[i].epoch_seconds:.2f} s/epoch > time budget "
                              f"{max_epoch_seconds:g} s")
            alive = [i for i in alive if i not in slow]
            if not alive:
                fastest = min(results, key=lambda r: r.epoch_seconds)
                raise BudgetError(
                    f"no candidate meets --max-epoch-seconds {max_epoch_seconds:g}: all {len(results)} that "
                    f"fit the memory budget were measured slower in rung 0; the fastest, {fastest.candidate} "
                    f"({by_id[fastest.candidate].describe()}), took {fastest.epoch_seconds:.2f} s/epoch"
                )
        ranked = sorted(alive, key=lambda i: _rank_key(rung.trained[i]))
        if rung_epochs_now == schedule[-1] and (len(alive) == 1 or step == len(schedule) - 1):
            rung.kept = ranked[:1]
            for place, i in enumerate(ranked[1:], start=2):
                dropped[i] = f"at rung {rung_no}: ranked {place} of {len(ranked)} at full epochs"
            return Halving(rungs, dropped, ranked[0])
        keep = max(1, math.ceil(len(ranked) / eta))
        rung.kept = ranked[:keep]
        for place, i in enumerate(ranked[keep:], start=keep + 1):
            dropped[i] = f"at rung {rung_no}: ranked {place} of {len(ranked)} (kept {keep})"
        alive = rung.kept
        step += 1
