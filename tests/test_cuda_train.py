"""Training on CUDA: the trainer at each precision, CPU/GPU agreement of a finetune step, TinyTL and MobileTL,
NeuroFlux's budget from the allocator, partition search and the memory command. Skipped without a GPU (CI
has none); run on one with ``python -m pytest -q tests/test_cuda_train.py``.

Tolerances, and why:
- one finetune step, CPU vs GPU at fp32 with TF32 off: the same arithmetic in another summation order
  (cuDNN's convolution algorithms, parallel reductions), so weights after one SGD step agree to 1e-5
  absolute and the loss to 1e-5 relative, not bit for bit;
- bf16/fp16 steps are checked to learn and to keep fp32 master weights, not against fp32 values.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from pipeline.context import RunContext  # noqa: E402
from pipeline.methods.adapters import MobileTLMethod, TinyTLMethod, apply_method  # noqa: E402
from pipeline.methods.neuroflux.profiler import profile_module  # noqa: E402
from pipeline.methods.trainer import TrainConfig, train  # noqa: E402
from pipeline.models.memory import device_step_peak, footprint  # noqa: E402
from pipeline.models.zoo import build_backbone, feature_shape, split_at  # noqa: E402
from pipeline.recipe import recipe_from_dict  # noqa: E402
from pipeline.runner import Runner  # noqa: E402
from stores.catalog import Catalog  # noqa: E402

CUDA = torch.device("cuda")
STEP_ATOL = 1e-5
LOSS_RTOL = 1e-5


@pytest.fixture(autouse=True)
def _no_tf32() -> Iterator[None]:
    """TF32 matmuls/convolutions round inputs to 10 mantissa bits: off, so fp32 means fp32 here."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def mobilenet_top(n: int = 5, size: int = 16) -> tuple[nn.Module, nn.Module, tuple[int, int, int]]:
    torch.manual_seed(0)
    net = build_backbone("mobilenet_v2", 3, width_mult=0.35, small_input=True)
    return net, split_at(net, n)[1], feature_shape(net, n, size)


def feature_batches(shape: tuple[int, ...], n: int = 4, batch: int = 16, seed: int = 0) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, *shape, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(n)]


# ------------------------------------------------------------------------------ trainer on CUDA
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_finetune_steps_on_cuda_at_each_precision(tmp_path: Path, precision: str) -> None:
    _, top, shape = mobilenet_top()
    top.to(CUDA)
    data = feature_batches(shape)
    result = train(top, top.parameters(), lambda e: iter(data), lambda: iter(data),
                   TrainConfig(epochs=4, lr=0.01, precision=precision), checkpoint_dir=tmp_path,
                   resume_key="k")
    losses = [h["train_loss"] for h in result.history]
    assert losses[-1] < losses[0]
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in top.parameters())
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    assert state["amp"]["precision"] == precision and "cuda" in state["rng"]
    if precision == "fp16":
        assert state["amp"]["scaler"]["scale"] > 0  # the gradient scaler's state is checkpointed


def test_one_finetune_step_agrees_between_cpu_and_gpu() -> None:
    _, top, shape = mobilenet_top()
    [(x, y)] = feature_batches(shape, n=1)
    after = {}
    losses = {}
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(top).to(device).train()
        for m in model.modules():  # CPU and GPU draw dropout's masks from different generators
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses[device] = loss.item()
        after[device] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    assert abs(losses["cpu"] - losses["cuda"]) <= LOSS_RTOL * abs(losses["cpu"])
    for k, v in after["cpu"].items():
        if v.is_floating_point():
            assert torch.allclose(v, after["cuda"][k], atol=STEP_ATOL, rtol=0), k


class Interrupted(Exception):
    pass


def interrupt_after_first_epoch(record: dict[str, Any]) -> None:
    raise Interrupted  # after last.pt is written: what a kill between epochs leaves behind


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_on_cuda_continues_the_uninterrupted_run(tmp_path: Path, precision: str) -> None:
    _, top, shape = mobilenet_top()
    data = feature_batches(shape)
    cfg = TrainConfig(epochs=3, precision=precision)
    whole = copy.deepcopy(top).to(CUDA)
    train(whole, whole.parameters(), lambda e: iter(data), None, cfg, checkpoint_dir=tmp_path / "a",
          resume_key="k")
    part = copy.deepcopy(top).to(CUDA)
    with pytest.raises(Interrupted):
        train(part, part.parameters(), lambda e: iter(data), None, cfg, checkpoint_dir=tmp_path / "b",
              resume_key="k", on_epoch=interrupt_after_first_epoch)
    again = copy.deepcopy(top).to(CUDA)  # a new process: a fresh model, the checkpoint on disk
    result = train(again, again.parameters(), lambda e: iter(data), None, cfg, checkpoint_dir=tmp_path / "b",
                   resume_key="k")
    assert result.resumed_from == 1
    # Same GPU, same kernels, same inputs: equal unless a kernel is nondeterministic (then within 1e-6).
    for (k, a), b in zip(whole.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-6, rtol=0), k


# ------------------------------------------------------------------------------ TinyTL / MobileTL
@pytest.mark.parametrize("method", [TinyTLMethod(type="tinytl", mode="lite_bias"),
                                    TinyTLMethod(type="tinytl", mode="bias"),
                                    MobileTLMethod(type="mobiletl", variant="proj-bn")],
                         ids=lambda m: m.label())
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_tinytl_and_mobiletl_train_on_cuda(method: Any, precision: str) -> None:
    net, top, shape = mobilenet_top()
    apply_method(method, net.arch, list(net.blocks), top, 5, shape)
    cpu_top = copy.deepcopy(top)
    top.to(CUDA)
    data = feature_batches(shape)
    before = {k: v.detach().cpu().clone() for k, v in top.state_dict().items()}
    result = train(top, top.parameters(), lambda e: iter(data), None,
                   TrainConfig(epochs=2, lr=0.01, precision=precision), checkpoint_dir=None)
    assert all(math.isfinite(h["train_loss"]) for h in result.history)
    moved = [k for k, v in top.state_dict().items() if not torch.equal(before[k], v.detach().cpu())]
    assert moved, "nothing trained"
    # The custom autograd functions (bit-packed masks, frozen-weight conv) give the gradients the
    # plain layers give: CPU and GPU agree on one fp32 step.
    if precision == "fp32":
        x, y = data[0]
        grads = {}
        for device, model in (("cpu", cpu_top), ("cuda", copy.deepcopy(cpu_top).to(CUDA))):
            model.train()
            for m in model.modules():  # CPU and GPU draw dropout's masks from different generators
                if isinstance(m, nn.Dropout):
                    m.p = 0.0
            nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            grads[device] = {n: p.grad.detach().cpu() for n, p in model.named_parameters()
                             if p.grad is not None}
        for name, g in grads["cpu"].items():
            assert torch.allclose(g, grads["cuda"][name], atol=1e-4, rtol=1e-3), name


# ------------------------------------------------------------------------------ a recipe on CUDA
RECIPE: dict[str, Any] = {
    "name": "cuda_train",
    "run": {"device": "cuda"},
    "stages": {
        "digits": {"type": "digits"},
        "target": {"type": "split", "input": "digits", "classes": [5, 6, 7, 8, 9], "per_class": 20,
                   "val_fraction": 0.2, "test_fraction": 0.2},
        "source": {"type": "split", "input": "digits", "classes": [0, 1, 2, 3, 4], "val_fraction": 0.2,
                   "test_fraction": 0.0},
        "backbone": {"type": "pretrain", "input": "source", "arch": "mobilenet_v2", "width_mult": 0.35,
                     "small_input": True, "resolution": 16, "train": {"epochs": 1, "precision": "bf16"}},
        "images": {"type": "decode", "input": "target", "resolution": 16},
        "single": {"type": "finetune", "mode": "single_stage", "model": "backbone", "images": "images",
                   "train_last_blocks": 4, "batch_size": 16, "train": {"epochs": 2, "precision": "fp16"}},
        "mobiletl": {"type": "finetune", "mode": "single_stage", "model": "backbone", "images": "images",
                     "train_last_blocks": 4, "batch_size": 16, "method": "mobiletl",
                     "train": {"epochs": 1}},
        "tinytl": {"type": "finetune", "mode": "single_stage", "model": "backbone", "images": "images",
                   "train_last_blocks": 4, "batch_size": 16,
                   "method": {"type": "tinytl", "mode": "lite_bias"},
                   "train": {"epochs": 1, "precision": "bf16"}},
    },
    "targets": ["single", "mobiletl", "tinytl"],
}


def test_pretrain_and_finetune_recipe_on_cuda(tmp_path: Path) -> None:
    recipe = recipe_from_dict(RECIPE)
    ctx = RunContext(catalog=Catalog(tmp_path / "store"), output_dir=tmp_path / "run", device="cuda")
    reports = {r.name: r for r in Runner(recipe, ctx).run()}
    for name in ("single", "mobiletl", "tinytl"):
        m = reports[name].metrics
        assert m["device"].startswith("cuda") and 0.0 <= m["accuracy"] <= 1.0, name
    assert reports["single"].metrics["precision"] == "fp16"
    # A CPU run reuses what the GPU trained: the device is not part of any fingerprint. (The fp16
    # trainer cannot even be planned on a CPU, so the CPU recipe leaves it out.)
    on_cpu = copy.deepcopy(RECIPE)
    del on_cpu["stages"]["single"]
    on_cpu["targets"] = ["mobiletl", "tinytl"]
    cpu = RunContext(catalog=Catalog(tmp_path / "store"), output_dir=tmp_path / "run2", device="cpu")
    again = {r.name: r for r in Runner(recipe_from_dict(on_cpu), cpu).run()}
    assert again["mobiletl"].status == "reused" and again["backbone"].status == "reused"


# ------------------------------------------------------------------------------ NeuroFlux / backprop
def test_profiler_reads_the_allocator_and_the_line_fits() -> None:
    from pipeline.methods.neuroflux.aux import LocalLayer, build_aux_heads
    from pipeline.methods.neuroflux.models import build_layer_net

    net = build_layer_net("vgg11", 10, width_mult=0.25, in_channels=3, resolution=32, seed=0).to(CUDA)
    heads = build_aux_heads(net.info, "adaptive", 10, seed=0).to(CUDA)
    unit = LocalLayer(net.layers[0], heads[0])
    fit = profile_module("conv0", unit, net.info[0].in_shape, num_classes=10, optimizer="adamw",
                         batches=(8, 16, 32, 64), device=CUDA)
    assert fit.slope > 0 and fit.intercept > 0 and fit.r2 > 0.99
    direct = device_step_peak(unit, (32, *net.info[0].in_shape), CUDA, num_classes=10)
    assert abs(direct - fit.bytes_at(32)) <= 0.05 * direct


def test_neuroflux_and_backprop_hold_their_gpu_budget(tmp_path: Path) -> None:
    from pipeline.methods.neuroflux.models import build_layer_net

    # The budget is what backprop needs at batch 16 on this GPU (as benchmarks/bench_neuroflux sets it).
    whole = build_layer_net("vgg11", 10, width_mult=0.25, in_channels=3, resolution=32, seed=0).to(CUDA)
    fit = profile_module("whole", whole, whole.in_shape, num_classes=10, optimizer="adamw", device=CUDA)
    budget = (fit.bytes_at(16) + 64) / 2**20
    del whole
    stages = {
        "digits": {"type": "digits"},
        "data": {"type": "split", "input": "digits", "val_fraction": 0.15, "test_fraction": 0.2},
        "images": {"type": "decode", "input": "data", "resolution": 32, "mean": [0.5] * 3, "std": [0.5] * 3},
        "nf": {"type": "neuroflux", "input": "images", "arch": "vgg11", "width_mult": 0.25,
               "memory_budget_mib": budget, "train": {"epochs": 1}, "export": False},
        "bp": {"type": "backprop", "input": "images", "arch": "vgg11", "width_mult": 0.25,
               "memory_budget_mib": budget, "train": {"epochs": 1}},
    }
    recipe = recipe_from_dict({"name": "nf_cuda", "run": {"device": "cuda"}, "stages": stages,
                               "targets": ["nf", "bp"]})
    ctx = RunContext(catalog=Catalog(tmp_path / "store"), output_dir=tmp_path / "run", device="cuda")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    reports = {r.name: r for r in Runner(recipe, ctx).run()}
    nf, bp = reports["nf"].metrics, reports["bp"].metrics
    assert nf["memory_measured_by"] == bp["memory_measured_by"] == "torch.cuda.max_memory_allocated"
    assert all(b["predicted_mib"] <= budget for b in nf["blocks"]) and bp["predicted_mib"] <= budget
    assert nf["device"].startswith("cuda") and bp["device"].startswith("cuda")
    # Evaluation batches and the cached data also sit on the GPU; training itself stays near the budget.
    assert (torch.cuda.max_memory_allocated() - base) / 2**20 <= 2 * budget


# ------------------------------------------------------------------------------ memory command
def test_memory_command_on_cuda_reads_the_allocator(tmp_path: Path) -> None:
    from pipeline.memory_report import memory_report

    recipe = recipe_from_dict(RECIPE)
    ctx = RunContext(catalog=Catalog(tmp_path / "store"), device="cuda")
    text, data = memory_report(recipe, ctx)
    assert data["device"].startswith("cuda") and "allocator peak" in text
    for stage in data["stages"].values():
        assert stage["device"].startswith("cuda") and stage["device_peak_bytes"] > 0


def test_footprint_on_cuda_matches_its_cpu_analysis() -> None:
    _, top, shape = mobilenet_top()
    cpu = footprint(top, (8, *shape), num_classes=3)
    gpu = footprint(copy.deepcopy(top).to(CUDA), (8, *shape), num_classes=3)
    assert gpu.activation_bytes == cpu.activation_bytes  # the analytic rules do not depend on the device
    assert gpu.device_peak_bytes is not None and gpu.device_peak_bytes >= gpu.parameter_bytes
    assert cpu.device_peak_bytes is None


# ------------------------------------------------------------------------------ partition search
def test_fake_quantization_search_runs_on_cuda() -> None:
    from pipeline.methods.mixed_precision.fakequant import FakeQuantModel

    torch.manual_seed(0)
    net = build_backbone("mobilenet_v2", 3, width_mult=0.35, small_input=True).eval()
    layers = [n for n, m in net.named_modules() if isinstance(m, nn.Conv2d)][:4]
    x = torch.randn(32, 3, 16, 16)
    y = torch.randint(0, 3, (32,))
    cpu = FakeQuantModel(net, layers, x.split(16))
    gpu = FakeQuantModel(copy.deepcopy(net).to(CUDA), layers, x.to(CUDA).split(16))
    for scheme in ({}, dict.fromkeys(layers, 4)):
        cpu.set_scheme(scheme)
        gpu.set_scheme(scheme)
        assert cpu.accuracy(x, y) == pytest.approx(gpu.accuracy(x.to(CUDA), y.to(CUDA)), abs=1 / 32)


# ------------------------------------------------------------------------------ CUDA graphs
def small_net() -> nn.Module:
    """Conv, batch norm, ReLU, pooling, linear: no dropout, so a graphed and an eager run draw nothing
    random and must agree to rounding."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3))


def uneven_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four batches of 16 and a short one of 7: the short one runs the graph's eager twin."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 8, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
            for n in (16, 16, 16, 16, 7)]


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_graphed_step_trains_as_the_eager_step(optimizer: str, precision: str) -> None:
    data = uneven_batches()
    states, results = {}, {}
    for mode in ("on", "off"):
        model = small_net().to(CUDA)
        cfg = TrainConfig(epochs=3, lr=0.01, optimizer=optimizer, precision=precision, cuda_graph=mode,
                          weight_decay=0.01, grad_clip=5.0)
        results[mode] = train(model, model.parameters(), lambda e: iter(data), lambda: iter(data[:2]), cfg,
                              checkpoint_dir=None)
        states[mode] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    assert results["on"].cuda_graph and not results["off"].cuda_graph
    tol = 1e-5 if precision == "fp32" else 2e-3
    for key, value in states["off"].items():
        assert torch.allclose(states["on"][key].float(), value.float(), atol=tol, rtol=0), key
    for a, b in zip(results["on"].history, results["off"].history, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=tol, abs=tol)
        assert abs(a["train_acc"] - b["train_acc"]) <= (0 if precision == "fp32" else 2) / 71
        assert a["samples"] == b["samples"] == 71


def test_a_graphed_run_and_an_eager_run_resume_each_other(tmp_path: Path) -> None:
    data = uneven_batches(1)
    whole = small_net().to(CUDA)
    train(whole, whole.parameters(), lambda e: iter(data), None, TrainConfig(epochs=3, lr=0.01),
          checkpoint_dir=tmp_path / "a", resume_key="k")
    for first, then in (("on", "off"), ("off", "on")):
        part = small_net().to(CUDA)
        with pytest.raises(Interrupted):
            train(part, part.parameters(), lambda e: iter(data), None,
                  TrainConfig(epochs=3, lr=0.01, cuda_graph=first), checkpoint_dir=tmp_path / first,
                  resume_key="k", on_epoch=interrupt_after_first_epoch)
        again = small_net().to(CUDA)
        result = train(again, again.parameters(), lambda e: iter(data), None,
                       TrainConfig(epochs=3, lr=0.01, cuda_graph=then), checkpoint_dir=tmp_path / first,
                       resume_key="k")
        assert result.resumed_from == 1 and result.cuda_graph == (then == "on")
        for (k, a), b in zip(whole.state_dict().items(), again.state_dict().values(), strict=True):
            assert torch.allclose(a.float(), b.float(), atol=1e-5, rtol=0), (first, then, k)


def test_a_nan_loss_in_a_graphed_epoch_is_named() -> None:
    from pipeline.errors import ModelError

    data = uneven_batches(2)
    data[1] = (torch.full_like(data[1][0], float("nan")), data[1][1])
    model = small_net().to(CUDA)
    with pytest.raises(ModelError, match="diverged.*epoch 0.*cuda_graph: off"):
        train(model, model.parameters(), lambda e: iter(data), None, TrainConfig(epochs=1, cuda_graph="on"),
              checkpoint_dir=None)


CODED_RECIPE: dict[str, Any] = {
    "name": "cuda_graph_two_stage",
    "run": {"device": "cuda"},
    "stages": {
        "digits": {"type": "digits"},
        "target": {"type": "split", "input": "digits", "classes": [5, 6, 7, 8, 9], "per_class": 40,
                   "val_fraction": 0.2, "test_fraction": 0.2},
        "backbone": {"type": "backbone", "arch": "mobilenet_v2", "width_mult": 0.35, "small_input": True,
                     "num_classes": 5},
        "images": {"type": "decode", "input": "target", "resolution": 16},
        "features": {"type": "frozen_forward", "input": "images", "model": "backbone",
                     "train_last_blocks": 4},
        "quantized": {"type": "quantize", "input": "features", "bits": 2},
        "cache": {"type": "cache", "input": "quantized"},
        "deq": {"type": "dequantize", "input": "cache"},
        "faug": {"type": "feature_aug", "input": "deq", "crop_padding": 1, "hflip": 0.5},
        "graphed": {"type": "finetune", "model": "backbone", "features": "faug", "batch_size": 16,
                    "train": {"epochs": 3, "cuda_graph": "on"}},
        "eager": {"type": "finetune", "model": "backbone", "features": "faug", "batch_size": 16,
                  "train": {"epochs": 3, "cuda_graph": "off"}},
    },
    "targets": ["graphed", "eager"],
}


def test_two_stage_on_cuda_decodes_the_resident_codes_inside_the_graph(tmp_path: Path) -> None:
    recipe = recipe_from_dict(CODED_RECIPE)
    ctx = RunContext(catalog=Catalog(tmp_path / "store"), output_dir=tmp_path / "run", device="cuda")
    reports = {r.name: r.metrics for r in Runner(recipe, ctx).run()}
    graphed, eager = reports["graphed"], reports["eager"]
    assert graphed["cuda_graph"] is True and eager["cuda_graph"] is False
    # Same data, schedule and kernels; only dropout's random draws differ: the curves stay close.
    assert graphed["train_loss_all"][0] == pytest.approx(eager["train_loss_all"][0], rel=0.1)
    assert abs(graphed["accuracy"] - eager["accuracy"]) <= 0.25


def test_cuda_graph_on_is_refused_where_it_cannot_capture(tmp_path: Path) -> None:
    from pipeline.errors import StageError

    spec = copy.deepcopy(CODED_RECIPE)
    spec["stages"]["graphed"]["train"]["precision"] = "fp16"
    ctx = RunContext(catalog=Catalog(tmp_path / "store"), device="cuda")
    with pytest.raises(StageError, match="stages.graphed.*cuda_graph: on.*fp16"):
        Runner(recipe_from_dict(spec), ctx)
