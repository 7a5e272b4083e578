"""Successive halving's schedule and decisions, with trainings stood in by known scores (no torch work)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.choose.halving import Trained, rung_epochs, successive_halving
from pipeline.choose.space import Candidate
from pipeline.errors import BudgetError


def test_rung_epochs() -> None:
    # 27 candidates, eta 3: 27 -> 9 -> 3 -> 1, the last at the full 9 epochs
    assert rung_epochs(27, 9, 3) == [1, 1, 3, 9]
    assert rung_epochs(18, 12, 3) == [1, 1, 4, 12]  # 18 -> 6 -> 2 -> 1
    assert rung_epochs(4, 8, 2) == [2, 4, 8]
    assert rung_epochs(1, 5, 3) == [5]
    assert rung_epochs(9, 2, 3, min_epochs=2) == [2, 2, 2]  # warmup needs 2


class FakeTraining:
    """Scores fixed per candidate (accuracy grows with epochs), every call recorded."""

    def __init__(self, accuracy: dict[str, float], seconds: dict[str, float] | None = None,
                 loss: dict[str, float] | None = None) -> None:
        self.accuracy, self.seconds, self.loss = accuracy, seconds or {}, loss or {}
        self.calls: list[tuple[int, list[str]]] = []

    def __call__(self, recipe: Any, candidates: list[Candidate], epochs: int, **kw: Any) -> list[Trained]:
        self.calls.append((epochs, [c.id for c in candidates]))
        return [Trained(c.id, epochs, min(1.0, self.accuracy[c.id] + 0.01 * epochs), self.loss.get(c.id), 0.5,
                        self.seconds.get(c.id, 1.0), 1.0, 0.0, [], "computed", "")
                for c in candidates]


def cands(n: int) -> list[Candidate]:
    return [Candidate(f"c{i:02d}", {"cut": i}, {"stages.f.train_last_blocks": i}) for i in range(1, n + 1)]


def halve(candidates: list[Candidate], fake: FakeTraining, **kw: Any) -> Any:
    args: dict[str, Any] = {"target": "top", "epochs": 9, "eta": 3, "max_epoch_seconds": 10.0,
                            "store": None, "output": Path("unused"), "log": lambda line: None, "train": fake}
    return successive_halving("recipe.yaml", candidates, **{**args, **kw})


def test_the_best_third_goes_on_until_one_trains_at_full_epochs() -> None:
    fake = FakeTraining({f"c{i:02d}": i / 100 for i in range(1, 10)})
    result = halve(cands(9), fake)
    assert [(e, len(ids)) for e, ids in fake.calls] == [(1, 9), (3, 3), (9, 1)]
    assert fake.calls[1][1] == ["c09", "c08", "c07"]
    assert result.winner == "c09" and result.rungs[-1].epochs == 9
    assert result.dropped["c01"] == "at rung 0: ranked 9 of 9 (kept 3)"
    assert result.dropped["c07"] == "at rung 1: ranked 3 of 3 (kept 1)"


def test_slow_candidates_drop_out_after_rung_0() -> None:
    accuracy = {f"c{i:02d}": i / 100 for i in range(1, 10)}
    fake = FakeTraining(accuracy, seconds={"c09": 12.5, "c08": 11.0})
    result = halve(cands(9), fake)
    assert result.dropped["c09"] == "after rung 0: 12.50 s/epoch > time budget 10 s"
    assert "c08" in result.dropped and result.winner == "c07"
    assert fake.calls[1][1] == ["c07", "c06", "c05"]  # ceil(7 / 3) of the 7 within the time budget


def test_one_survivor_goes_straight_to_full_epochs() -> None:
    # 9 planned, 7 too slow: 2 left after rung 0, one after rung 1, which trains 9 epochs, not 3
    fake = FakeTraining({f"c{i:02d}": i / 100 for i in range(1, 10)},
                        seconds={f"c{i:02d}": 20.0 for i in range(3, 10)})
    result = halve(cands(9), fake)
    assert [e for e, _ in fake.calls] == [1, 9]
    assert result.winner == "c02"


def test_nothing_within_the_time_budget_names_the_fastest() -> None:
    fake = FakeTraining({"c01": 0.5, "c02": 0.6}, seconds={"c01": 12.0, "c02": 11.0})
    with pytest.raises(BudgetError, match=r"the fastest, c02 \(cut=2\), took 11.00 s/epoch"):
        halve(cands(2), fake)


def test_equal_accuracy_goes_to_the_lower_validation_loss() -> None:
    fake = FakeTraining({"c01": 0.5, "c02": 0.5}, loss={"c01": 0.9, "c02": 0.7})
    assert halve(cands(2), fake).winner == "c02"
