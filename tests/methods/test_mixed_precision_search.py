"""NSGA-II over per-layer bits: non-dominated results, growing samples, Definition 7's δ rule."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.errors import ModelError
from pipeline.methods.mixed_precision.search import (
    Scheme,
    SearchConfig,
    dominates,
    non_dominated,
    nsga2,
    quantized_prefix,
    robustness,
    select,
)

SENSITIVITY = np.linspace(0.001, 0.03, 10)  # deeper layers lose more accuracy at low bits
COST = {4: 4.0, 6: 1.5, 8: 0.3, 16: 0.0}


def synthetic_accuracy(bits: tuple[int, ...], samples: int) -> float:
    return 0.95 - sum(s * COST[b] for s, b in zip(SENSITIVITY, bits, strict=True))


def scheme(bits: tuple[int, ...], acc: float, cuts: list[int]) -> Scheme:
    return Scheme(bits, acc, 100, quantized_prefix(bits, cuts), sum(bits))


def test_quantized_prefix_stops_at_the_first_high_precision_layer_and_at_valid_cuts() -> None:
    assert quantized_prefix((8, 4, 6, 16, 8), [1, 2, 3, 4, 5]) == 3
    assert quantized_prefix((8, 4, 6, 16, 8), [2, 4]) == 2  # 3 layers ok, but no valid cut after layer 3
    assert quantized_prefix((16, 8, 8), [1, 2, 3]) == 0
    assert quantized_prefix((8, 8, 8), [1, 3]) == 3


def test_delta_rule_on_a_constructed_front() -> None:
    cuts = list(range(1, 7))
    front = [
        scheme((16,) * 6, 0.900, cuts),  # best accuracy, no cut
        scheme((8, 8, 16, 16, 16, 16), 0.898, cuts),  # cut 2, -0.2%
        scheme((8, 8, 8, 8, 16, 16), 0.892, cuts),  # cut 4, -0.9% (inside δ = 1%)
        scheme((8, 8, 8, 8, 8, 16), 0.880, cuts),  # cut 5, -2.2%
        scheme((4, 4, 4, 4, 4, 4), 0.700, cuts),  # cut 6, far below
    ]
    assert select(front, 0.01).quantized_layers == 4
    assert select(front, 0.0).quantized_layers == 0
    assert select(front, 0.025).quantized_layers == 5
    assert select(front, 0.5).quantized_layers == 6
    # ties on the cut go to the more accurate scheme, then to fewer bits
    tied = [
        scheme((8, 8, 16), 0.90, [1, 2, 3]),
        scheme((4, 8, 16), 0.90, [1, 2, 3]),
        scheme((6, 8, 16), 0.89, [1, 2, 3]),
    ]
    assert select(tied, 0.05).bits == (4, 8, 16)
    with pytest.raises(ModelError, match="empty"):
        select([], 0.01)


def test_non_dominated_filters_dominated_and_duplicate_schemes() -> None:
    a = scheme((8, 8), 0.9, [1, 2])
    b = scheme((8, 16), 0.85, [1, 2])  # fewer layers, less accurate, more bits: dominated by a
    c = scheme((4, 4), 0.5, [1, 2])
    front = non_dominated([a, b, c, scheme((8, 8), 0.9, [1, 2])])
    assert {s.bits for s in front} == {(8, 8), (4, 4)}
    assert dominates(a.objectives(), b.objectives()) and not dominates(a.objectives(), c.objectives())


def test_nsga2_front_is_non_dominated_and_samples_grow() -> None:
    calls: list[tuple[tuple[int, ...], int]] = []

    def evaluate(bits: tuple[int, ...], samples: int) -> float:
        calls.append((bits, samples))
        return synthetic_accuracy(bits, samples)

    cfg = SearchConfig(population=32, generations=20, min_samples=32, max_samples=256, seed=1)
    result = nsga2(evaluate, 10, list(range(1, 11)), cfg)
    objs = [s.objectives() for s in result.front]
    for i, a in enumerate(objs):
        assert not any(dominates(b, a) for j, b in enumerate(objs) if j != i)
    assert all(s.samples == 256 for s in result.front)
    assert result.selected in result.front
    best = max(s.accuracy for s in result.front)
    assert result.selected.accuracy >= 0.99 * best
    # first generation: 8/16-bit schemes only, on the fewest samples; the budget then grows
    first = [b for b, n in calls[: cfg.population]]
    assert all(set(b) <= {8, 16} for b in first) and calls[0][1] == 32
    samples = [h["samples"] for h in result.history]
    assert samples == sorted(samples) and samples[0] == 32 and samples[-1] == 256
    assert result.evaluations == len(calls) <= cfg.population * (cfg.generations + 1)
    # by construction the best cut within 1% has 4 layers at 8 bits (0.3 * cumsum(SENSITIVITY[:4]) <= 0.0095)
    assert result.selected.quantized_layers == 4
    ranking = robustness(result.front, [f"l{i}" for i in range(10)], 0.01, cfg.bits)
    assert {r["layer"] for r in ranking} == {f"l{i}" for i in range(10)}
