"""Successive halving over candidates: many short trainings, then fewer longer ones, one at full length.

Rung 0 trains every candidate that fits the memory budget for a few epochs; the best ``1/eta``
(by validation accuracy) go on to a rung of ``eta`` times more epochs, and so on until one is left,
trained for the recipe's full epochs. The number of rungs comes from the number of candidates:
with ``n`` candidates, rung ``i`` keeps ``ceil(n / eta**i)`` of them, and the last rung (one
candidate) trains ``epochs`` epochs, rung ``i`` ``epochs / eta**(R - i)`` (at least 1).

Each rung is a sweep (:func:`pipeline.sweep.run_sweep`) whose variants are the rung's candidates
at the rung's epochs: planned before it runs, every variant recorded as it ends (a killed choose
rerun with the same ``--output`` skips what finished), run here or on Dask, in one shared store: the
backbone and each distinct cache are built once and every later training reuses them, and a
training already stored (the same candidate at the same epochs, from an earlier choose) is reused,
not repeated. A rung retrains from the start: the finetune checkpoint
(``pipeline.methods.checkpoint``) belongs to the stage's fingerprint, which holds the epoch count,
and the learning rate schedule is a function of the total epochs, so a 3-epoch run is not the first
3 epochs of a 9-epoch run and cannot be continued into one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BudgetError, PipelineError
from ..recipe import Recipe
from ..sweep import run_sweep
from .meter import candidate_recipe
from .space import Candidate


class TrainingFailed(PipelineError, RuntimeError):
    """A candidate's training failed while working (not bad input): ``choose`` stops, exit 1."""


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
    executor: str = "local", workers: int | None = 2,
) -> list[Trained]:
    """Train each candidate for ``epochs`` epochs: one sweep over them, in ``output/rungs/``."""
    epochs_key = f"stages.{target}.train.epochs"
    points = [{**c.overrides, epochs_key: epochs} for c in candidates]
    # The candidates' recipes exactly as written (no derived cuts): winner.yaml, run again, then
    # reuses the winner's stored training.
    sweep = run_sweep(recipe, points=points, overrides={"targets": [target]}, target=target, store=store,
                      output=output / "rungs" / f"rung{rung}-e{epochs}", executor=executor, workers=workers,
                      quiet=True, derive_cuts=False, echo=lambda line: log(f"[rung {rung}] {line}"))
    results = []
    for i, (candidate, record) in enumerate(zip(candidates, sweep.variants, strict=True)):
        if record["status"] != "finished":
            raise TrainingFailed(f"candidate {candidate.id} ({candidate.describe()}) {record['status']} in "
                                 f"rung {rung}: {record.get('error', 'see its run record')} "
                                 f"({sweep.sweep_dir / record['run_dir']})")
        stages = record["stages"]
        resolved = candidate_recipe(recipe, candidate, target)
        built = [n for n, s in stages.items()
                 if n != target and s["status"] == "computed" and resolved.stages[n].cacheable]
        trained = Trained(
            candidate=candidate.id, epochs=epochs, val_accuracy=float(record["val_accuracy"]),
            val_loss=record.get("val_loss"), test_accuracy=float(record["test_accuracy"]),
            epoch_seconds=float(record["epoch_seconds_steady"]),
            train_seconds=float(stages[target]["seconds"]) if record["trained"] == "computed" else 0.0,
            build_seconds=sum(stages[n]["seconds"] for n in built), built=built, status=record["trained"],
            run_dir=str(sweep.sweep_dir / record["run_dir"]),
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
