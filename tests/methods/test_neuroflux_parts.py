"""NeuroFlux building blocks: models, auxiliary nets, profiler fits, Algorithm 1, local steps, early exit."""

from __future__ import annotations

import pytest
import torch

from pipeline.methods.neuroflux.aux import ExitModel, LocalLayer, aux_filters, build_aux_heads
from pipeline.methods.neuroflux.exit import (
    ExitCandidate,
    FinetunedExit,
    choose_exit,
    count_parameters,
    export_model,
    load_exported,
    search_exit,
)
from pipeline.methods.neuroflux.local import BlockState, evaluate_heads, train_block
from pipeline.methods.neuroflux.models import build_layer_net
from pipeline.methods.neuroflux.partition import MemoryBudgetError, group_by_batch, partition
from pipeline.methods.neuroflux.profiler import MemoryFit, fit_line, profile_module
from pipeline.methods.trainer import TrainConfig


def fit(name: str, slope: float, intercept: float) -> MemoryFit:
    return MemoryFit(name, slope, intercept, 1.0, (1, 2), (0, 0))


# ------------------------------------------------------------------------------- models, aux
@pytest.mark.parametrize("arch,layers", [("vgg11", 8), ("vgg16", 13), ("vgg19", 16), ("resnet18", 9)])
def test_layer_nets_have_the_papers_layers_and_run_on_32px(arch: str, layers: int) -> None:
    net = build_layer_net(arch, 10, width_mult=0.125, seed=0)
    assert len(net.layers) == layers
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert net.info[0].before_downsampling and not net.info[-1].before_downsampling


def test_adaptive_aux_uses_half_the_smallest_width_before_downsampling_and_half_the_largest_after() -> None:
    info = build_layer_net("vgg16", 10).info  # full width: 64 ... 512
    assert aux_filters(info, "adaptive") == [32, 32] + [256] * 11  # the paper's VGG numbers
    assert aux_filters(info, "classic") == [256] * 13


def test_unknown_arch_names_the_nearest() -> None:
    with pytest.raises(Exception, match="vgg16"):
        build_layer_net("vgg61", 10)


# ------------------------------------------------------------------------------- profiler
def test_fit_line_recovers_a_line_and_reports_r2() -> None:
    f = fit_line("l", [1, 2, 4, 8], [110, 120, 140, 180])
    assert f.slope == pytest.approx(10) and f.intercept == pytest.approx(100) and f.r2 == pytest.approx(1)
    assert f.max_batch(185, cap=64) == 8 and f.max_batch(105, cap=64) == 0 and f.max_batch(1e9, cap=64) == 64


def test_profiled_layer_memory_is_linear_in_batch() -> None:
    net = build_layer_net("vgg11", 10, width_mult=0.125, seed=0)
    heads = build_aux_heads(net.info, "adaptive", 10)
    f = profile_module(
        "layers.0",
        LocalLayer(net.layers[0], heads[0]),
        net.info[0].in_shape,
        num_classes=10,
        optimizer="adamw",
        batches=(1, 2, 4, 8),
    )
    assert f.r2 > 0.99 and f.slope > 0
    params = count_parameters(net.layers[0]) + count_parameters(heads[0])
    assert f.intercept >= 4 * params * 4 * 0.9  # weights + grads + two Adam moments, fp32


# ------------------------------------------------------------------------------- Algorithm 1
@pytest.mark.parametrize(
    "batches,rho,groups",
    [
        ([10, 12, 14, 100, 110, 300], 0.4, [[0, 1, 2], [3, 4], [5]]),
        ([10, 20, 40, 80], 0.4, [[0], [1], [2], [3]]),  # every layer its own block
        ([50, 50, 50], 0.0, [[0, 1, 2]]),
        ([64, 40, 64], 0.4, [[0, 1, 2]]),  # within 0.4 of the larger both ways
        ([64, 38, 64], 0.4, [[0], [1], [2]]),
    ],
)
def test_grouping_follows_rho(batches: list[int], rho: float, groups: list[list[int]]) -> None:
    assert group_by_batch(batches, rho) == groups


def test_partition_batch_is_the_smallest_of_the_block_and_fits_the_budget() -> None:
    fits = [fit("a", 10, 100), fit("b", 8, 100), fit("c", 1, 100)]
    blocks = partition(fits, 1000, cap=128, rho=0.4)
    # per-layer maxima 90, 112, 128 -> a and b group (within 0.4), c joins (128 vs 90: 0.30)
    assert [b.layers for b in blocks] == [(0, 1, 2)]
    block = blocks[0]
    assert block.layer_batches == (90, 112, 128)
    # all three layers' statics are in memory together: (1000 - 300) // 10 = 70 < 90
    assert block.batch_size == 70 and block.predicted_bytes <= 1000


def test_partition_splits_where_layers_do_not_fit_together() -> None:
    fits = [fit("a", 1, 600), fit("b", 1, 600)]  # each fits alone, not both
    blocks = partition(fits, 700, cap=64, rho=0.4)
    assert [b.layers for b in blocks] == [(0,), (1,)]
    assert all(b.predicted_bytes <= 700 for b in blocks)


def test_budget_below_batch_one_names_the_layer_and_its_need() -> None:
    with pytest.raises(MemoryBudgetError, match=r"layers\.3.*needs 1\.00 MiB"):
        partition([fit("layers.0", 10, 100), fit("layers.3", 2**19, 2**19)], 2**19, cap=8)


# ------------------------------------------------------------------------------- local training
def _toy_data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 2
    x = torch.randn(n, 3, 32, 32, generator=g) * 0.1 + y.view(-1, 1, 1, 1).float()
    return x, y


def test_local_training_learns_and_resumes_identically(tmp_path) -> None:
    x, y = _toy_data()

    def batches(epoch: int):
        for s in range(0, len(x), 16):
            yield x[s : s + 16], y[s : s + 16]

    def make() -> BlockState:
        net = build_layer_net("vgg11", 2, width_mult=0.125, seed=0)
        heads = build_aux_heads(net.info, "adaptive", 2, seed=0)
        layers = [LocalLayer(net.layers[i], heads[i]) for i in range(2)]
        return BlockState.create(layers, cfg)

    cfg = TrainConfig(epochs=3, lr=0.01)
    full = train_block(make(), batches, lambda: batches(0), cfg, steps_per_epoch=4, layer_names=["a", "b"])
    assert evaluate_heads(full.layers, batches(0))[1] > 0.9

    class Interrupted(Exception):
        pass

    def checkpoint_then_die(state: BlockState, record: dict) -> None:
        torch.save(state.state_dict(), tmp_path / "state.pt")  # what the stage does after every epoch
        raise Interrupted

    with pytest.raises(Interrupted):
        train_block(
            make(),
            batches,
            None,
            cfg,
            steps_per_epoch=4,
            layer_names=["a", "b"],
            on_epoch=checkpoint_then_die,
        )
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert resumed.epoch == 1
    train_block(resumed, batches, lambda: batches(0), cfg, steps_per_epoch=4, layer_names=["a", "b"])
    for a, b in zip(full.layers, resumed.layers, strict=True):
        for (k, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(p, q), k


# ------------------------------------------------------------------------------- early exit
def test_exit_rule_prefers_the_smaller_model_among_near_ties() -> None:
    cands = [ExitCandidate(0, 0.80, 10), ExitCandidate(3, 0.897, 100), ExitCandidate(5, 0.90, 1000)]
    assert choose_exit(cands, tolerance=0.005).layer == 3
    assert choose_exit(cands, tolerance=0.0).layer == 5
    assert choose_exit(cands, rule="best").layer == 5
    assert choose_exit(cands, tolerance=0.2).layer == 0


def test_near_full_rule_holds_exits_to_the_last_layer_not_the_luckiest_one() -> None:
    # Layer 5's validation accuracy is above the full model's (the last layer's) by chance.
    cands = [ExitCandidate(1, 0.85, 10), ExitCandidate(2, 0.862, 60), ExitCandidate(5, 0.885, 400),
             ExitCandidate(7, 0.870, 650)]
    assert choose_exit(cands, tolerance=0.01).layer == 5
    assert choose_exit(cands, rule="fewest_parameters_near_full", tolerance=0.01).layer == 2
    with pytest.raises(ValueError, match="unknown exit rule 'smallest'.*fewest_parameters_near_full"):
        choose_exit(cands, rule="smallest")  # type: ignore[arg-type]


def _finetuner(gains: dict[int, float], tried: list[int]):
    def finetune(c: ExitCandidate) -> FinetunedExit:
        tried.append(c.layer)
        return FinetunedExit(c.layer, c.val_acc, c.val_acc + gains.get(c.layer, 0.0), 32, 1.0)

    return finetune


def test_exit_search_fine_tunes_smallest_first_and_stops_at_the_first_within_the_tolerance() -> None:
    cands = [ExitCandidate(0, 0.70, 5), ExitCandidate(1, 0.845, 10), ExitCandidate(2, 0.862, 60),
             ExitCandidate(3, 0.872, 100), ExitCandidate(7, 0.875, 650)]
    tried: list[int] = []
    # Layer 0 is beyond the reach (0.875 - 0.01 - 0.03): never fine-tuned. Layer 1 gains too little,
    # layer 2 enough: the search stops there, before the untouched rule's choice (layer 3).
    chosen, tries = search_exit(cands, _finetuner({1: 0.01, 2: 0.006}, tried),
                                rule="fewest_parameters_near_full", tolerance=0.01)
    assert tried == [1, 2]
    assert chosen == ExitCandidate(2, 0.868, 60)
    assert [t.accepted for t in tries] == [False, True]
    # Nothing smaller reaches it: the untouched choice ends the search, fine-tuned too.
    tried.clear()
    chosen, tries = search_exit(cands, _finetuner({}, tried), rule="fewest_parameters_near_full",
                                tolerance=0.01)
    assert tried == [1, 2, 3] and chosen.layer == 3 and tries[-1].accepted
    # The best rule fine-tunes its own choice only.
    tried.clear()
    chosen, _ = search_exit(cands, _finetuner({7: 0.002}, tried), rule="best")
    assert tried == [7] and chosen.val_acc == pytest.approx(0.877)


def test_exported_model_matches_the_toolkit_model(tmp_path) -> None:
    net = build_layer_net("resnet18", 10, width_mult=0.125, seed=0)
    heads = build_aux_heads(net.info, "adaptive", 10, seed=0)
    compact = ExitModel(list(net.layers[:4]), heads[3]).eval()
    path = export_model(compact, (3, 32, 32), tmp_path / "compact.pt2")
    loaded = load_exported(path)
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(loaded(x), compact(x), atol=1e-5)
    assert count_parameters(compact) < count_parameters(net)


def test_a_layer_joins_a_block_only_if_the_block_batch_stays_within_rho() -> None:
    fits = [fit(f"l{i}", 1, 300) for i in range(4)]  # each alone: batch 128 (the cap)
    blocks = partition(fits, 1000, cap=128, rho=0.4)
    # three together: (1000 - 900) // 1 = 100 >= 0.6 * 128; a fourth would not fit at all
    assert [(b.layers, b.batch_size) for b in blocks] == [((0, 1, 2), 100), ((3,), 128)]
    tight = partition(fits, 1000, cap=128, rho=0.1)  # 100 < 0.9 * 128: stop at two layers
    assert [(b.layers, b.batch_size) for b in tight] == [((0, 1), 128), ((2, 3), 128)]
