"""Warm starts and replay, piece by piece (``pipeline.methods.warm_start``): the replay mix of each batch,
the class plan a grown head follows, and the checks an ``init:`` model must pass. Whole runs (a model file
from a run, ``update RUN_DIR``) are in ``tests/test_update.py``."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeline.errors import ModelError
from pipeline.methods.trainer import TrainConfig, cross_entropy, evaluate
from pipeline.methods.warm_start import (
    DISTILL_TEMPERATURE,
    ClassPlan,
    Distillation,
    InitError,
    InitSource,
    Replay,
    accuracy_of,
    class_tallies,
    count_classes,
    keep_columns,
    locate_init,
    of_classes,
    plan_init,
    prior_correction,
)
from pipeline.spec import ModelDesc

OLD = (0, 1, 2, 3, 4)


def stream(n_old: int, n_new: int, seed: int, batch: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of (x, y) where x[i, 0] is the sample's id: old samples (labels 0-4) then new ones (5),
    in a seeded order, as a shuffled epoch of a stream would come."""
    y = torch.cat([torch.arange(n_old) % 5, torch.full((n_new,), 5)])
    x = torch.arange(n_old + n_new, dtype=torch.float32)[:, None].repeat(1, 3)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(y), batch)]


def replay_epoch(replay: Replay, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(replay.batches(stream(*replay.counts, seed=epoch), epoch))


def test_each_batch_holds_the_share_of_earlier_samples_it_asks_for() -> None:
    replay = Replay(0.5, 32, OLD, seed=3, counts=(500, 100))
    batches = replay_epoch(replay, 0)
    assert replay.old_per_batch == 16 and replay.new_per_batch == 16
    assert len(batches) == replay.steps() == 7  # ceil(100 / 16): an epoch is one pass over the new samples
    for _x, y in batches[:-1]:
        assert len(y) == 32 and int((y == 5).sum()) == 16 and int((y < 5).sum()) == 16
    x, y = batches[-1]  # 4 new samples left: 4 earlier ones beside them, the same share
    assert int((y == 5).sum()) == 4 and int((y < 5).sum()) == 4
    ids = torch.cat([x[:, 0] for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    new_ids = ids[labels == 5].tolist()
    assert sorted(new_ids) == list(range(500, 600))  # every new sample once
    old_ids = ids[labels < 5].tolist()
    assert len(set(old_ids)) == len(old_ids) == 100  # earlier samples drawn without repeats when enough
    # the two kinds are interleaved, so a micro-batch of 16 sees both
    _first_x, first_y = batches[0]
    assert 0 < int((first_y[:16] == 5).sum()) < 16


@pytest.mark.parametrize("share,old,new", [(0.25, 8, 24), (0.75, 24, 8), (0.0, 0, 32)])
def test_other_shares(share: float, old: int, new: int) -> None:
    replay = Replay(share, 32, OLD, seed=0, counts=(300, 96))
    batches = replay_epoch(replay, 1)
    assert len(batches) == -(-96 // new)
    for _x, y in batches[:-1]:
        assert (int((y < 5).sum()), int((y == 5).sum())) == (old, new)


def test_replay_is_a_function_of_seed_and_epoch() -> None:
    replay = Replay(0.5, 32, OLD, seed=3, counts=(500, 100))
    a, b = replay_epoch(replay, 2), replay_epoch(replay, 2)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    other = replay_epoch(replay, 3)
    assert not torch.equal(a[0][0], other[0][0])  # another epoch: other samples, another order
    reseeded = replay_epoch(Replay(0.5, 32, OLD, seed=4, counts=(500, 100)), 2)
    assert not torch.equal(a[0][0], reseeded[0][0])


def test_too_few_earlier_samples_are_cycled_reshuffled() -> None:
    replay = Replay(0.5, 16, OLD, seed=0, counts=(10, 64))  # 8 per batch x 8 batches from a pool of 10
    batches = replay_epoch(replay, 0)
    labels = torch.cat([y for _, y in batches])
    ids = torch.cat([x[:, 0] for x, _ in batches])[labels < 5].tolist()
    assert len(ids) == 64
    counts = Counter(ids)
    assert set(counts) == set(range(10)) and max(counts.values()) - min(counts.values()) <= 1


def test_a_stream_that_changes_between_passes_is_refused() -> None:
    replay = Replay(0.5, 32, OLD, counts=(500, 99))  # counted 99 new samples; the epoch brings 100
    with pytest.raises(ModelError, match="gave 100 new and 500 earlier samples in epoch 0, 99 and 500 when "
                                         "counted; a stream's samples must not change between passes"):
        list(replay.batches(stream(500, 100, seed=0), 0))


def test_prior_offsets_undo_what_replay_does_to_the_class_balance() -> None:
    replay = Replay(0.5, 32, OLD, counts=(1000, 200))
    offsets = replay.prior_offsets(6)
    assert offsets is not None
    # a known class is 1/10 of half of each batch and 1/6 of the data; the new one half of it and 1/6
    assert torch.allclose(offsets, torch.tensor([math.log(0.6)] * 5 + [math.log(3.0)]))
    assert Replay(0.0, 32, OLD, counts=(1000, 200)).prior_offsets(6) is None  # no earlier sample: nothing


class Top(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(3, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def test_the_correction_applies_while_training_only_and_comes_off() -> None:
    top, x = Top(), torch.randn(4, 3)
    plain = top(x).detach()
    offsets = torch.arange(6, dtype=torch.float32)
    handle = prior_correction(top, offsets)
    assert torch.equal(top.train()(x).detach(), plain + offsets)
    assert torch.equal(top.eval()(x).detach(), plain)
    handle.remove()
    assert torch.equal(top.train()(x).detach(), plain)
    assert set(top.state_dict()) == {"head.0.weight", "head.0.bias"}


def test_distillation_adds_nothing_where_the_known_scores_agree_with_the_teacher() -> None:
    torch.manual_seed(0)
    model, x, y = nn.Linear(3, 6), torch.randn(8, 3), torch.randint(0, 6, (8,))
    ce = cross_entropy(TrainConfig())
    loss = Distillation.of(model, OLD, 1.0, ce)
    logits = model(x)
    assert torch.allclose(loss(logits, y, x), ce(logits, y, x), atol=1e-6)
    # the new class's score is not the teacher's business: changing it changes cross-entropy only
    moved = logits.detach().clone()
    moved[:, 5] += 3.0
    assert torch.allclose(loss(moved, y, x) - ce(moved, y, x), torch.zeros(()), atol=1e-6)
    # the same scores shifted by a constant are the same distribution (replay's prior offsets are one)
    assert torch.allclose(loss(moved + 1.5, y, x) - ce(moved + 1.5, y, x), torch.zeros(()), atol=1e-6)


def test_distillation_is_the_tempered_divergence_from_the_frozen_teacher() -> None:
    torch.manual_seed(0)
    model, x, y = nn.Linear(3, 6), torch.randn(8, 3), torch.randint(0, 6, (8,))
    ce = cross_entropy(TrainConfig())
    loss = Distillation.of(model, OLD, 0.5, ce)
    teacher = model(x).detach()
    with torch.no_grad():
        model.weight.add_(torch.randn_like(model.weight))  # the student moves; the teacher is a copy
    logits = model(x)
    t = DISTILL_TEMPERATURE
    p = torch.softmax(teacher[:, list(OLD)] / t, 1)
    log_q = torch.log_softmax(logits[:, list(OLD)] / t, 1)
    # on every sample (the new class's too, as Learning without Forgetting does), over the known classes
    expected = (p * (p.log() - log_q)).sum(1).mean() * t * t * 0.5
    extra = loss(logits, y, x) - ce(logits, y, x)
    assert float(extra.detach()) > 0 and torch.allclose(extra.detach(), expected, atol=1e-5)
    extra.backward()
    assert model.weight.grad is not None and loss.teacher.weight.grad is None  # the teacher never trains
    assert not any(p.requires_grad for p in loss.teacher.parameters())


def test_tallies_give_evaluates_accuracy_per_class() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6))
    batches = [(torch.randn(40, 3), torch.randint(0, 6, (40,))) for _ in range(3)]
    tallies = class_tallies(model, batches, 6)
    assert accuracy_of(tallies, range(6)) == evaluate(model, batches)[1]
    assert int(tallies[1].sum()) == 120
    only = [(x[y < 5], y[y < 5]) for x, y in batches]
    assert accuracy_of(tallies, OLD) == evaluate(model, only)[1]
    assert accuracy_of(tallies, ()) is None


def test_count_and_filter_by_class() -> None:
    batches = stream(50, 20, seed=1)
    assert count_classes(batches, OLD) == (50, 20)
    kept = list(of_classes(batches, (5,)))
    assert sum(len(y) for _, y in kept) == 20 and all(bool((y == 5).all()) for _, y in kept)


def test_keep_columns_predicts_among_the_known_classes_only() -> None:
    model = nn.Linear(3, 4)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([0.0, 1.0, 5.0, 2.0]))
    x = torch.zeros(2, 3)
    assert model(x).argmax(1).tolist() == [2, 2]
    assert keep_columns(model, [0, 1, 3])(x).argmax(1).tolist() == [3, 3]


# ------------------------------------------------------------------------------------ class plans
def test_class_plan_matches_by_name() -> None:
    plan = ClassPlan.of(["shirt", "bag", "boot"], ["bag", "shirt", "boot", "sandal"])
    assert plan.kept == ((0, 1), (1, 0), (2, 2)) and plan.added == (3,) and plan.old == (0, 1, 2)
    assert not plan.unchanged and ClassPlan.of(["a", "b"], ["a", "b"]).unchanged
    assert plan.summary() == {"classes_kept": ["bag", "shirt", "boot"], "classes_added": ["sandal"],
                              "classes_dropped": []}
    assert ClassPlan.of(["a", "b", "c"], ["a", "c"]).dropped == ("b",)


def description(**network: Any) -> dict[str, Any]:
    net = {"family": "transfer", "arch": "mobilenet_v2", "num_classes": 2, "width_mult": 0.35,
           "small_input": True, "train_last_blocks": 7, "top_input_shape": [32, 4, 4],
           "method": {"type": "vanilla"}, **network}
    return {"network": net, "input": {"resolution": 32}, "class_names": ["a", "b"][: net["num_classes"]]}


def check(desc: dict[str, Any], *, names: tuple[str, ...] = ("a", "b"), head: type = nn.Linear,
          model: ModelDesc | None = None, cut: int = 7, shape: tuple[int, ...] = (32, 4, 4),
          resolution: int = 32, method: dict[str, Any] | None = None) -> ClassPlan:
    return plan_init(desc, InitSource("m.pt", Path("runs/x/stages/top/model.pt")),
                     model=model or ModelDesc("mobilenet_v2", 19, 0.35, True, 32), model_name="backbone",
                     train_last_blocks=cut, top_input_shape=shape, resolution=resolution,
                     method=method or {"type": "vanilla"}, class_names=names, head=head)


def test_a_fitting_model_passes() -> None:
    assert check(description()).unchanged
    assert check(description(), names=("a", "b", "c")).added == (2,)


@pytest.mark.parametrize("change,words", [
    ({"model": ModelDesc("resnet18", 8, 1.0, True, 32)},
     ["runs/x/stages/top/model.pt is a mobilenet_v2 (width_mult 0.35, small_input) model",
      "`model: backbone` is a resnet18 (width_mult 1, small_input)"]),
    ({"model": ModelDesc("mobilenet_v2", 19, 0.5, True, 32)}, ["width_mult 0.35", "width_mult 0.5"]),
    ({"cut": 5}, ["trained at cut train_last_blocks=7", "trains the last 5 blocks"]),
    ({"shape": (32, 5, 5), "resolution": 40}, ["takes 32px images", "data is 40px", "(32, 5, 5)"]),
    ({"method": {"type": "tinytl", "mode": "bias"}},
     ["trained with method vanilla", "trains with tinytl {mode: bias}"]),
    ({"names": ("a", "b", "c"), "head": nn.Conv2d},
     ["classes the model does not know (c)", "ends in a Conv2d, which cannot grow", "remove init:"]),
    ({"names": ("x", "y")}, ["knows none of the data's classes"]),
])
def test_a_model_that_does_not_fit_is_refused_naming_both(change: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(InitError) as info:
        check(description(), **change)
    for word in words:
        assert word in str(info.value)


def test_a_backbone_model_file_is_refused() -> None:
    with pytest.raises(InitError, match="is a pretrained backbone .* not a finetune result"):
        check(description(family="backbone"))


def test_locating_refuses_exported_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(InitError, match=r"model.pt2 is an exported model \(.pt2\).*the model file it was "
                                        "exported from"):
        locate_init(str(tmp_path / "model.pt2"), None)
    with pytest.raises(FileNotFoundError, match="init: .*nope.pt does not exist; expected a model file"):
        locate_init(str(tmp_path / "nope.pt"), None)
    with pytest.raises(InitError, match="is a directory without a model.pt"):
        locate_init(str(tmp_path), None)
