"""NSGA-II over per-layer bit widths, and the δ rule that turns its Pareto front into a cut.

A scheme gives every candidate layer (topological order, classifier excluded) a bit
width q in {4, 6, 8, 16}. Definition 6's objectives, all three at once:

- maximize the number of quantized layers: the layers below the highest valid cut
  whose layers all have q <= 8 (``int_bits``). Only layers below the partition ever
  run as integers, so a layer quantized above it counts for nothing;
- maximize validation accuracy with every layer fake-quantized to its q;
- minimize the total bits, sum over layers of q (smaller integers are cheaper, and the
  pressure pushes each layer to the fewest bits it tolerates: its robustness).

Definition 7 (selection): among the non-dominated schemes, keep those within δ of the
best accuracy, relative (acc >= (1 - δ) * best), and take the one with the highest
cut; ties go to higher accuracy, then fewer bits.

Evaluations are the cost, so the validation sample grows linearly over generations
(``min_samples`` -> ``max_samples``): early generations drop bad schemes cheaply,
and the final population is re-evaluated on the full sample before the front is
taken. Identical (scheme, sample size) pairs are evaluated once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ...errors import ModelError

Evaluate = Callable[[tuple[int, ...], int], float]


@dataclass(frozen=True)
class SearchConfig:
    bits: tuple[int, ...] = (4, 6, 8, 16)
    initial_bits: tuple[int, ...] = (8, 16)
    population: int = 32
    generations: int = 20
    min_samples: int = 64
    max_samples: int = 512
    delta: float = 0.01
    int_bits: int = 8
    seed: int = 0

    def samples_at(self, generation: int) -> int:
        """Validation samples for ``generation`` (0-based): linear from min to max."""
        if self.generations <= 1:
            return self.max_samples
        frac = min(generation, self.generations - 1) / (self.generations - 1)
        return int(round(self.min_samples + frac * (self.max_samples - self.min_samples)))


@dataclass
class Scheme:
    bits: tuple[int, ...]
    accuracy: float
    samples: int
    quantized_layers: int  # layers below the scheme's cut (Definition 6, objective 1)
    sum_bits: int

    def objectives(self) -> tuple[float, float, float]:
        """As minimized: (-quantized layers, -accuracy, total bits)."""
        return (-float(self.quantized_layers), -self.accuracy, float(self.sum_bits))


@dataclass
class SearchResult:
    front: list[Scheme]
    selected: Scheme
    best_accuracy: float
    evaluations: int  # distinct (scheme, sample size) evaluations actually run
    samples_evaluated: int  # total validation samples forwarded, over all evaluations
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"front": [asdict(s) for s in self.front], "selected": asdict(self.selected),
                "best_accuracy": self.best_accuracy, "evaluations": self.evaluations,
                "samples_evaluated": self.samples_evaluated, "seconds": self.seconds, "history": self.history}


def quantized_prefix(bits: Sequence[int], cut_sizes: Sequence[int], int_bits: int = 8) -> int:
    """Layers below the highest cut (``cut_sizes``: layers below each valid cut) all at <= int_bits."""
    ok = 0
    for b in bits:
        if b > int_bits:
            break
        ok += 1
    return max((n for n in cut_sizes if n <= ok), default=0)


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """Pareto dominance for minimized objectives."""
    return all(x <= y for x, y in zip(a, b, strict=True)) and any(x < y for x, y in zip(a, b, strict=True))


def non_dominated(schemes: Sequence[Scheme]) -> list[Scheme]:
    """The schemes no other scheme dominates, duplicates (same bits) removed."""
    unique = list({s.bits: s for s in schemes}.values())
    return [s for s in unique
            if not any(dominates(o.objectives(), s.objectives()) for o in unique if o is not s)]


def select(front: Sequence[Scheme], delta: float) -> Scheme:
    """Definition 7: the highest cut among schemes within relative ``delta`` of the best accuracy."""
    if not front:
        raise ModelError("cannot select a cut from an empty Pareto front")
    if not 0.0 <= delta < 1.0:
        raise ModelError(f"delta must be in [0, 1), found {delta}")
    best = max(s.accuracy for s in front)
    feasible = [s for s in front if s.accuracy >= (1.0 - delta) * best - 1e-12]
    return max(feasible, key=lambda s: (s.quantized_layers, s.accuracy, -s.sum_bits))


def initial_population(n_var: int, cfg: SearchConfig, rng: np.random.Generator) -> np.ndarray:
    """``cfg.population`` schemes of ``initial_bits`` only (as indices into ``cfg.bits``), with both
    uniform extremes included so the front is anchored at all-high and all-low precision."""
    choices = np.array([cfg.bits.index(b) for b in cfg.initial_bits])
    pop = rng.choice(choices, size=(cfg.population, n_var))
    pop[0, :] = choices.max()
    if cfg.population > 1:
        pop[1, :] = choices.min()
    return pop


def nsga2(evaluate: Evaluate, n_var: int, cut_sizes: Sequence[int], cfg: SearchConfig,
          log: Callable[[str], None] | None = None) -> SearchResult:
    """Run NSGA-II (pymoo, ask-and-tell) with ``evaluate(bits, samples) -> accuracy``."""
    from pymoo.algorithms.moo.nsga2 import NSGA2
    from pymoo.core.evaluator import Evaluator
    from pymoo.core.problem import Problem
    from pymoo.operators.crossover.sbx import SBX
    from pymoo.operators.mutation.pm import PM
    from pymoo.operators.repair.rounding import RoundingRepair
    from pymoo.problems.static import StaticProblem

    if n_var < 1:
        raise ModelError("the model has no quantizable layer below its classifier to search over")
    if any(b not in cfg.bits for b in cfg.initial_bits):
        raise ModelError(f"initial_bits {cfg.initial_bits} must be a subset of bits {cfg.bits}")
    start = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    cache: dict[tuple[tuple[int, ...], int], float] = {}
    samples_evaluated = 0

    def scheme(bits: tuple[int, ...], samples: int) -> Scheme:
        nonlocal samples_evaluated
        key = (bits, samples)
        if key not in cache:
            cache[key] = float(evaluate(bits, samples))
            samples_evaluated += samples
        return Scheme(bits, cache[key], samples, quantized_prefix(bits, cut_sizes, cfg.int_bits), sum(bits))

    def decode(x: np.ndarray) -> tuple[int, ...]:
        return tuple(int(cfg.bits[int(i)]) for i in np.clip(np.round(x), 0, len(cfg.bits) - 1))

    problem = Problem(n_var=n_var, n_obj=3, xl=0, xu=len(cfg.bits) - 1, vtype=int)
    algorithm = NSGA2(pop_size=cfg.population, sampling=initial_population(n_var, cfg, rng),
                      crossover=SBX(prob=0.9, eta=15, vtype=float, repair=RoundingRepair()),
                      mutation=PM(eta=20, vtype=float, repair=RoundingRepair()), eliminate_duplicates=True)
    algorithm.setup(problem, termination=("n_gen", cfg.generations), seed=cfg.seed, verbose=False)
    history: list[dict[str, Any]] = []
    generation = 0
    while algorithm.has_next():
        pop = algorithm.ask()
        samples = cfg.samples_at(generation)
        evaluated = [scheme(decode(x), samples) for x in pop.get("X")]
        Evaluator().eval(StaticProblem(problem, F=np.array([s.objectives() for s in evaluated])), pop)
        algorithm.tell(infills=pop)
        history.append({"generation": generation, "samples": samples, "offspring": len(evaluated),
                        "best_accuracy": max(s.accuracy for s in evaluated),
                        "max_quantized_layers": max(s.quantized_layers for s in evaluated),
                        "evaluations": len(cache), "seconds": time.perf_counter() - start})
        if log is not None:
            log(f"generation {generation}: {samples} samples, {len(cache)} evaluations, "
                f"best acc {history[-1]['best_accuracy']:.3f}, "
                f"max quantized layers {history[-1]['max_quantized_layers']}")
        generation += 1
    final = [scheme(decode(x), cfg.max_samples) for x in algorithm.pop.get("X")]
    front = sorted(non_dominated(final), key=lambda s: (-s.quantized_layers, -s.accuracy, s.sum_bits))
    selected = select(front, cfg.delta)
    return SearchResult(front, selected, max(s.accuracy for s in front), len(cache), samples_evaluated,
                        time.perf_counter() - start, history)


def robustness(front: Sequence[Scheme], layers: Sequence[str], delta: float,
               bit_choices: Sequence[int]) -> list[dict[str, Any]]:
    """Layers ranked by robustness to quantization, from the δ-feasible part of the front.

    ``score`` is the mean over those schemes of (max bits - q) / (max bits - min bits):
    1 for a layer that always tolerates the fewest bits, 0 for one always kept at the most.
    """
    best = max(s.accuracy for s in front)
    feasible = [s for s in front if s.accuracy >= (1.0 - delta) * best - 1e-12]
    lo, hi = min(bit_choices), max(bit_choices)
    rows = []
    for i, name in enumerate(layers):
        qs = [s.bits[i] for s in feasible]
        rows.append({"layer": name, "position": i, "min_bits": min(qs),
                     "score": float(np.mean([(hi - q) / (hi - lo) for q in qs]))})
    return sorted(rows, key=lambda r: (-r["score"], r["min_bits"], r["position"]))
