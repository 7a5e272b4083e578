"""The generic epoch loop: learns, checkpoints, respects frozen parts, schedules, fails loudly."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from torch import nn

from pipeline.errors import DataError, ModelError
from pipeline.methods.trainer import TrainConfig, evaluate, make_optimizer, train
from pipeline.models.weights import load_weights, state_dict_hash
from pipeline.models.zoo import build_backbone, split_at

Pair = tuple[torch.Tensor, torch.Tensor]


def blobs(n: int, seed: int, dim: int = 8, classes: int = 3) -> Pair:
    """Gaussian blobs far apart: linearly separable, so a working loop must reach high accuracy."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(123)) * 4
    y = torch.randint(0, classes, (n,), generator=g)
    return centers[y] + torch.randn(n, dim, generator=g), y


def batches_of(data: Pair, size: int = 16, *, shuffle_seed: int | None = None) -> Iterator[Pair]:
    x, y = data
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(shuffle_seed)) \
        if shuffle_seed is not None else torch.arange(len(y))
    for i in range(0, len(y), size):
        idx = order[i:i + size]
        yield x[idx], y[idx]


TRAIN, VAL = blobs(192, 0), blobs(96, 1)


def linear_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))


def run(model: nn.Module, cfg: TrainConfig, tmp: Path | None, **kw: object):  # noqa: ANN201
    return train(model, model.parameters(), lambda e: batches_of(TRAIN, shuffle_seed=e),
                 lambda: batches_of(VAL, 64), cfg, checkpoint_dir=tmp, **kw)


def test_learns_a_separable_problem_and_writes_checkpoints(tmp_path: Path) -> None:
    model = linear_model()
    loss0, acc0, n = evaluate(model, batches_of(VAL))
    result = run(model, TrainConfig(epochs=6, lr=0.02), tmp_path)
    losses = [h["train_loss"] for h in result.history]
    assert losses[-1] < losses[0] / 2 and result.history[-1]["val_loss"] < loss0
    assert result.best_val_acc is not None and result.best_val_acc > 0.9 > acc0 and n == 96
    assert result.last_val_acc == result.history[-1]["val_acc"]
    assert result.best_val_acc == max(h["val_acc"] for h in result.history)
    for key in ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "epoch_seconds", "eval_seconds",
                "lr", "samples"):
        assert all(key in h for h in result.history)
    assert [h["samples"] for h in result.history] == [192] * 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]
    best, meta = load_weights(tmp_path / "best.pt")
    assert meta["epoch"] == result.best_epoch and meta["val_acc"] == result.best_val_acc
    last, _ = load_weights(tmp_path / "last.pt")
    assert state_dict_hash(last) == state_dict_hash(model)
    model.load_state_dict(best)
    assert evaluate(model, batches_of(VAL))[1] == result.best_val_acc


def test_frozen_params_and_eval_mode_parts_stay_untouched() -> None:
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    model = nn.Sequential(frozen, nn.ReLU(), nn.Linear(8, 3))
    for p in frozen.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def keep_frozen_in_eval(m: nn.Module) -> None:
        m.train()
        frozen.eval()  # BatchNorm running statistics must not move either

    run(model, TrainConfig(epochs=2, lr=0.05, weight_decay=0.1), None, train_mode=keep_frozen_in_eval)
    after = model.state_dict()
    for k in before:
        if k.startswith("0."):
            assert torch.equal(before[k], after[k]), k
    assert not torch.equal(before["2.weight"], after["2.weight"])


def test_no_trainable_parameters_is_an_error() -> None:
    model = linear_model()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ModelError, match="no trainable parameters"):
        run(model, TrainConfig(epochs=1), None)


def test_cosine_decays_constant_stays_warmup_rises() -> None:
    cos = run(linear_model(), TrainConfig(epochs=5, lr=0.01), None)
    lrs = [h["lr"] for h in cos.history]
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False)) and 0 < lrs[-1] < 0.01 * 0.05
    const = run(linear_model(), TrainConfig(epochs=3, lr=0.01, schedule="constant"), None)
    assert [h["lr"] for h in const.history] == [0.01] * 3
    cfg = TrainConfig(epochs=4, lr=0.01, warmup_epochs=2, optimizer="sgd")
    for hint in (12, None):
        seen: list[float] = []
        model = linear_model()
        train(model, model.parameters(), lambda e: batches_of(TRAIN), None, cfg, checkpoint_dir=None,
              steps_per_epoch=hint, progress=lambda info, seen=seen: seen.append(info["lr"]))
        assert len(seen) == 48
        peak = seen.index(max(seen))
        assert 23 <= peak <= 24 and seen[-1] < seen[peak] / 10
        assert all(a < b for a, b in zip(seen[12:23], seen[13:24], strict=True))  # per-step warmup
        if hint is None:  # unknown epoch length: the first epoch runs at its midpoint lr
            assert seen[:12] == [cfg.lr_at(0.5)] * 12
        else:
            assert seen[0] < 1e-4 and all(a < b for a, b in zip(seen[:11], seen[1:12], strict=True))


@settings(max_examples=50, deadline=None)
@given(epochs=st.integers(1, 50), warm=st.floats(0, 0.99), pos=st.floats(0, 1))
def test_lr_schedule_is_bounded(epochs: int, warm: float, pos: float) -> None:
    cfg = TrainConfig(epochs=epochs, lr=0.1, warmup_epochs=warm * epochs)
    assert 0 <= cfg.lr_at(pos * epochs) <= 0.1


def test_label_smoothing_and_optimizers_accepted() -> None:
    for opt in ("adamw", "adam", "sgd"):
        cfg = TrainConfig(epochs=3, lr=0.05, optimizer=opt, label_smoothing=0.2, grad_clip=1.0)
        result = run(linear_model(), cfg, None)
        # Smoothed targets put a floor under the loss that hard targets do not have.
        assert result.history[-1]["train_loss"] > 0.3 and result.best_val_acc > 0.8
    with pytest.raises(ValidationError):
        TrainConfig(label_smoothing=1.5)


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_optimizers_are_fused_on_a_cpu_and_step_as_the_for_loop_ones(name: str) -> None:
    # Gradients that are mostly zero: the case the for-loop Adam's square root is slow on.
    torch.manual_seed(0)
    weights = [torch.randn(64, 32), torch.randn(32)]
    fused_params = [nn.Parameter(w.clone()) for w in weights]
    loop_params = [nn.Parameter(w.clone()) for w in weights]
    cfg = TrainConfig(lr=0.01, optimizer=name, weight_decay=0.01)
    fused = make_optimizer(fused_params, cfg)
    assert fused.defaults["fused"] is True
    extra = {"momentum": cfg.momentum} if name == "sgd" else {}
    loop = type(fused)(loop_params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False, **extra)
    for _ in range(5):
        for a, b in zip(fused_params, loop_params, strict=True):
            grad = torch.randn_like(a) * (torch.rand_like(a) < 0.05)
            a.grad, b.grad = grad.clone(), grad.clone()
        fused.step()
        loop.step()
    for a, b in zip(fused_params, loop_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_parameters_on_a_device_without_fused_kernels_get_the_for_loop_optimizer() -> None:
    meta = [nn.Parameter(torch.empty(4, 4, device="meta"))]
    assert not make_optimizer(meta, TrainConfig()).defaults["fused"]


def test_config_is_strict_and_frozen() -> None:
    with pytest.raises(ValidationError, match="lr_rate"):
        TrainConfig(lr_rate=0.1)
    with pytest.raises(ValidationError):
        TrainConfig(epochs=0)
    with pytest.raises(ValidationError, match="warmup_epochs"):
        TrainConfig(epochs=2, warmup_epochs=2)
    cfg = TrainConfig()
    with pytest.raises(ValidationError):
        cfg.lr = 1.0  # type: ignore[misc]


def test_non_finite_loss_names_epoch_step_and_fix() -> None:
    def poisoned(epoch: int) -> Iterator[Pair]:
        for i, (x, y) in enumerate(batches_of(TRAIN)):
            if epoch == 1 and i == 2:
                x = x.clone()
                x[0, 0] = float("nan")
            yield x, y

    model = linear_model()
    with pytest.raises(ModelError, match=r"epoch 1, step 2.*lower train\.lr"):
        train(model, model.parameters(), poisoned, None, TrainConfig(epochs=3), checkpoint_dir=None)


def test_empty_data_is_a_data_error() -> None:
    model = linear_model()
    with pytest.raises(DataError, match=r"train_batches\(0\)"):
        train(model, model.parameters(), lambda e: iter(()), None, TrainConfig(epochs=1), checkpoint_dir=None)
    with pytest.raises(DataError, match="no samples"):
        evaluate(model, [])


def test_without_eval_best_is_last_and_runs_are_reproducible(tmp_path: Path) -> None:
    model = linear_model()
    result = train(model, model.parameters(), lambda e: batches_of(TRAIN), None,
                   TrainConfig(epochs=2, seed=5), checkpoint_dir=tmp_path)
    assert result.best_val_acc is None
    assert result.best_epoch == 1 and all("val_acc" not in h for h in result.history)
    assert state_dict_hash(load_weights(tmp_path / "best.pt")[0]) == state_dict_hash(model)
    torch.randn(5)  # moves the global RNG: the trainer's own seed must make dropout reproducible anyway
    again = linear_model()
    train(again, again.parameters(), lambda e: batches_of(TRAIN), None, TrainConfig(epochs=2, seed=5),
          checkpoint_dir=None)
    assert state_dict_hash(again) == state_dict_hash(model)


def test_caller_rng_untouched() -> None:
    model = linear_model()
    state = torch.get_rng_state()
    run(model, TrainConfig(epochs=1), None)
    assert torch.equal(torch.get_rng_state(), state)


def test_trains_the_top_of_a_split_backbone(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = build_backbone("mobilenet_v2", 2, width_mult=0.35, small_input=True, dropout=0.0)
    bottom, top = split_at(net, 2)
    for p in bottom.parameters():
        p.requires_grad_(False)
    bottom.eval()
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (32,), generator=g)
    x = torch.randn(32, 3, 16, 16, generator=g) + y[:, None, None, None] * 2.0
    with torch.no_grad():
        feats = bottom(x)  # the cached features of two-stage training
    bottom_hash = state_dict_hash(bottom)
    records: list[dict] = []
    result = train(top, top.parameters(), lambda e: batches_of((feats, y), 8, shuffle_seed=e),
                   lambda: batches_of((feats, y), 32), TrainConfig(epochs=4, lr=0.01),
                   checkpoint_dir=tmp_path, on_epoch=records.append)
    assert records == result.history and result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    assert state_dict_hash(bottom) == bottom_hash
    best, _ = load_weights(tmp_path / "best.pt")
    assert set(best) <= set(net.state_dict())  # top checkpoints load back into the full net


def test_batches_read_ahead_train_the_same_model(tmp_path: Path) -> None:
    """Preparing batches on a thread, across epoch ends, changes nothing the model sees."""
    results = []
    for read_ahead in (0, 2):
        model = linear_model()
        result = run(model, TrainConfig(epochs=3, seed=1), None, read_ahead=read_ahead)
        results.append((state_dict_hash(model), [h["train_loss"] for h in result.history]))
    assert results[0] == results[1]


def test_channels_last_trains_the_same_model_to_rounding_and_saves_the_default_layout(tmp_path: Path) -> None:
    """train.memory_format: channels_last trains in NHWC and hands back (and saves) a contiguous network
    whose weights match the default layout's to rounding; the setting is part of the stage's fingerprint."""
    torch.manual_seed(0)
    net = build_backbone("mobilenet_v2", 3, width_mult=0.35, small_input=True, dropout=0.0)
    _, top0 = split_at(net, 7)  # its input: 32 channels at 4x4 (a 1x1 map is in both layouts at once)
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (48,), generator=g)
    with torch.no_grad():
        feats = torch.randn(48, *_top_input_shape(net, 7), generator=g) + y[:, None, None, None]
    trained = {}
    for layout in ("contiguous", "channels_last"):
        top = copy.deepcopy(top0)
        seen: list[bool] = []

        def note_layout(_m: nn.Module, args: tuple[torch.Tensor, ...], seen: list[bool] = seen) -> None:
            seen.append(args[0].is_contiguous(memory_format=torch.channels_last))

        hook = top.register_forward_pre_hook(note_layout)
        train(top, top.parameters(), lambda e: batches_of((feats, y), 16, shuffle_seed=e), None,
              # sgd: Adam's normalised steps would turn last-bit gradient differences into lr-sized ones
              TrainConfig(epochs=1, lr=0.01, optimizer="sgd", memory_format=layout),
              checkpoint_dir=tmp_path / layout)
        hook.remove()
        assert seen and all(seen) == (layout == "channels_last")
        assert all(p.is_contiguous() for p in top.parameters())  # handed back in the default layout
        saved, _ = load_weights(tmp_path / layout / "best.pt")
        assert all(t.is_contiguous() for t in saved.values())
        trained[layout] = top.state_dict()
    for key, value in trained["contiguous"].items():
        if value.is_floating_point():
            torch.testing.assert_close(trained["channels_last"][key], value, rtol=1e-2, atol=1e-3)
    with pytest.raises(ValidationError, match="memory_format"):
        TrainConfig(memory_format="nhwc")
    assert "memory_format" not in TrainConfig().model_dump(exclude_defaults=True)  # old fingerprints stay


def _top_input_shape(net: nn.Module, n: int) -> tuple[int, ...]:
    bottom, _ = split_at(net, n)
    with torch.no_grad():
        return tuple(bottom.eval()(torch.zeros(1, 3, 32, 32)).shape[1:])
