"""NeuroFlux vs backpropagation vs classic local learning under the same memory budget (issue: NeuroFlux).

Fashion-MNIST (Debian's package), resized to 32x32, VGG-11 at width 0.25 trained from scratch,
the paper's setting scaled to a 2-core CPU: a training subset, a quarter of the widths, and
budgets expressed relative to what backpropagation needs on this model:

- ``bp16``: the memory BP needs at batch 16 (BP runs, with small batches);
- ``below_bp``: 90% of what BP needs at batch 1 (BP cannot run at all).

Per budget, one run of each method, all in this process, on data already decoded in memory:
- BP: the full network end to end with the largest batch that fits (capped at ``--cap``);
- NeuroFlux: profiler -> Algorithm 1 blocks -> block-wise local learning with adaptive auxiliary
  nets, each block at its own batch size, a trained block's outputs kept (spilled) so later
  blocks never recompute it; then the early exit;
- classic LL: the same local learning with classic auxiliary nets and one batch size for the
  whole network (one block, no spill).

The spill here is held in memory: the store-backed spill stage (zarr entries, re-chunk,
prefetch, resume) is not built yet, so spill sizes are computed from the spilled tensors'
shapes (fp32 and the 8-bit cache codec: n bits per element + fp16 per-channel range).
Memory is the toolkit's training-memory meter (saved tensors + weights + gradients + optimizer).
Usage: python -m benchmarks.bench_neuroflux [--train 3000] [--epochs 4] [--target 0.8]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks._meta import write_result
from pipeline.data.decode import Decoder
from pipeline.data.sources import fashion_mnist
from pipeline.methods.neuroflux.aux import ExitModel, LocalLayer, build_aux_heads
from pipeline.methods.neuroflux.exit import ExitCandidate, choose_exit, count_parameters, throughput
from pipeline.methods.neuroflux.local import BlockState, train_block
from pipeline.methods.neuroflux.models import build_layer_net
from pipeline.methods.neuroflux.partition import MemoryBudgetError, block_max_batch, partition
from pipeline.methods.neuroflux.profiler import profile_module
from pipeline.methods.trainer import TrainConfig, evaluate, make_optimizer

ARCH, WIDTH, RES = "vgg11", 0.25, 32
PROFILE_BATCHES = (2, 4, 8, 16)
MIB = 2**20


def load_data(n_train: int, n_val: int, n_test: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    sets = fashion_mnist()
    dec = Decoder(RES, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    rng = np.random.default_rng(0)
    train_idx = rng.permutation(len(sets["train"]))
    test_idx = rng.permutation(len(sets["test"]))[:n_test]
    out = {}
    for split, source, idx in (
        ("train", "train", train_idx[:n_train]),
        ("val", "train", train_idx[n_train : n_train + n_val]),
        ("test", "test", test_idx),
    ):
        s = sets[source]
        x = torch.cat([dec(s.load(idx[i : i + 500])) for i in range(0, len(idx), 500)])
        out[split] = (x, torch.from_numpy(s.labels[idx].astype(np.int64)))
    return out


def batches(x: torch.Tensor, y: torch.Tensor, size: int, seed: int | None = None):
    order = (
        torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        if seed is not None
        else torch.arange(len(x))
    )
    for s in range(0, len(x), size):
        i = order[s : s + size]
        if len(i) > 1 or len(x) == 1:  # batch norm cannot train on a lone trailing sample
            yield x[i], y[i]


def first_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in curve if acc >= target), None)


def run_bp(data, budget: float, fit, cfg: TrainConfig, cap: int, target: float) -> dict[str, Any]:
    b = fit.max_batch(budget, cap)
    if b < 1:
        return {"method": "backprop", "runs": False, "needs_bytes_at_batch_1": fit.bytes_at(1)}
    net = build_layer_net(ARCH, 10, width_mult=WIDTH, seed=0)
    opt = make_optimizer(list(net.parameters()), cfg)
    loss_fn = nn.CrossEntropyLoss()
    t0, curve = time.perf_counter(), []
    steps = -(-len(data["train"][0]) // b)
    for epoch in range(cfg.epochs):
        net.train()
        for step, (x, y) in enumerate(batches(*data["train"], b, seed=epoch)):
            for g in opt.param_groups:
                g["lr"] = cfg.lr_at(epoch + step / steps)
            loss = loss_fn(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        curve.append((time.perf_counter() - t0, evaluate(net, batches(*data["val"], 256))[1]))
    return {
        "method": "backprop",
        "runs": True,
        "batch_size": b,
        "train_seconds": curve[-1][0],
        "val_curve": curve,
        "val_acc": curve[-1][1],
        "test_acc": evaluate(net, batches(*data["test"], 256))[1],
        "time_to_target_s": first_reach(curve, target),
        "parameters": count_parameters(net),
        "predicted_bytes": fit.bytes_at(b),
    }


def run_local(
    data,
    budget: float,
    fits,
    heads_kind: str,
    single_block: bool,
    cfg: TrainConfig,
    cap: int,
    rho: float,
    target: float,
    profile_seconds: float,
) -> dict[str, Any]:
    net = build_layer_net(ARCH, 10, width_mult=WIDTH, seed=0)
    heads = build_aux_heads(net.info, heads_kind, 10, seed=0)
    name = "neuroflux" if not single_block else "classic_ll"
    try:
        if single_block:
            b = min(f.max_batch(budget, cap) for f in fits)
            b = min(b, block_max_batch(fits, budget, cap))
            if b < 1:
                raise MemoryBudgetError("classic local learning: all layers together do not fit at batch 1")
            plan = [{"layers": list(range(len(fits))), "batch_size": b}]
        else:
            plan = [
                {"layers": list(blk.layers), "batch_size": blk.batch_size}
                for blk in partition(fits, int(budget), cap=cap, rho=rho)
            ]
    except MemoryBudgetError as exc:
        return {"method": name, "runs": False, "error": str(exc)}
    t0 = time.perf_counter() - profile_seconds  # profiling is part of NeuroFlux's cost
    curve: list[tuple[float, float]] = []
    best_so_far = 0.0
    current = {s: data[s] for s in ("train", "val", "test")}
    val_acc: dict[int, float] = {}
    spill_bytes: list[dict[str, float]] = []
    for k, blk in enumerate(plan):
        layers = [LocalLayer(net.layers[i], heads[i]) for i in blk["layers"]]
        state = BlockState.create(layers, cfg)
        xtr, ytr = current["train"]

        def on_epoch(state: BlockState, record: dict[str, Any]) -> None:
            nonlocal best_so_far
            best_so_far = max(best_so_far, *record["val_acc"])
            curve.append((time.perf_counter() - t0, best_so_far))

        train_block(
            state,
            lambda e, xtr=xtr, ytr=ytr, b=blk["batch_size"]: batches(xtr, ytr, b, seed=e),
            lambda: batches(*current["val"], 256),
            cfg,
            steps_per_epoch=-(-len(xtr) // blk["batch_size"]),
            layer_names=[f"layers.{i}" for i in blk["layers"]],
            on_epoch=on_epoch,
        )
        for i, acc in zip(blk["layers"], state.history[-1]["val_acc"], strict=True):
            val_acc[i] = acc
        if k + 1 < len(plan):  # spill: the next block reads these outputs, never recomputes this block
            with torch.no_grad():
                for m in layers:
                    m.eval()
                for split, (x, y) in list(current.items()):
                    outs = []
                    for s in range(0, len(x), 256):
                        h = x[s : s + 256]
                        for m in layers:
                            h = m.layer(h)
                        outs.append(h)
                    current[split] = (torch.cat(outs), y)
            c, h, w = current["train"][0].shape[1:]
            spill_bytes.append(
                {
                    "after_block": k,
                    "shape": [c, h, w],
                    "fp32_bytes_per_sample": 4 * c * h * w,
                    "int8_codec_bytes_per_sample": c * h * w + 4 * c,
                }
            )
    train_seconds = time.perf_counter() - t0
    cands = []
    for i in range(len(net.layers)):
        cands.append(
            ExitCandidate(i, val_acc[i], count_parameters(ExitModel(list(net.layers[: i + 1]), heads[i])))
        )
    chosen = choose_exit(cands, tolerance=0.005)
    compact = ExitModel(list(net.layers[: chosen.layer + 1]), heads[chosen.layer]).eval()
    test_acc = evaluate(compact, batches(*data["test"], 256))[1]
    full = build_layer_net(ARCH, 10, width_mult=WIDTH, seed=0).eval()
    return {
        "method": name,
        "runs": True,
        "blocks": plan,
        "train_seconds": train_seconds,
        "val_curve": curve,
        "val_acc_per_layer": [val_acc[i] for i in range(len(net.layers))],
        "exit_layer": chosen.layer,
        "exit_val_acc": chosen.val_acc,
        "test_acc": test_acc,
        "time_to_target_s": first_reach(curve, target),
        "compact_parameters": chosen.parameters,
        "full_parameters": count_parameters(full),
        "parameter_compression": count_parameters(full) / chosen.parameters,
        "compact_images_per_s": throughput(compact, (3, RES, RES)),
        "full_images_per_s": throughput(full, (3, RES, RES)),
        "spill": spill_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", type=int, default=3000)
    ap.add_argument("--val", type=int, default=1000)
    ap.add_argument("--test", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--cap", type=int, default=128)
    ap.add_argument("--rho", type=float, default=0.4)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(epochs=args.epochs, lr=0.003, optimizer="adamw", schedule="cosine")
    data = load_data(args.train, args.val, args.test)
    net = build_layer_net(ARCH, 10, width_mult=WIDTH, seed=0)
    t0 = time.perf_counter()
    fits = {
        kind: [
            profile_module(
                info.name,
                LocalLayer(net.layers[i], h),
                info.in_shape,
                num_classes=10,
                optimizer="adamw",
                batches=PROFILE_BATCHES,
            )
            for i, (info, h) in enumerate(zip(net.info, build_aux_heads(net.info, kind, 10), strict=True))
        ]
        for kind in ("adaptive", "classic")
    }
    profile_seconds = (time.perf_counter() - t0) / 2
    bp_fit = profile_module(
        "full", net, (3, RES, RES), num_classes=10, optimizer="adamw", batches=PROFILE_BATCHES
    )
    budgets = {"bp16": bp_fit.bytes_at(16), "below_bp": 0.9 * bp_fit.bytes_at(1)}
    rows = []
    for label, budget in budgets.items():
        for result in (
            run_bp(data, budget, bp_fit, cfg, args.cap, args.target),
            run_local(
                data,
                budget,
                fits["adaptive"],
                "adaptive",
                False,
                cfg,
                args.cap,
                args.rho,
                args.target,
                profile_seconds,
            ),
            run_local(
                data,
                budget,
                fits["classic"],
                "classic",
                True,
                cfg,
                args.cap,
                args.rho,
                args.target,
                profile_seconds,
            ),
        ):
            result.update(budget=label, budget_bytes=budget)
            rows.append(result)
            print(
                label,
                f"{budget / MIB:.2f} MiB",
                result["method"],
                {
                    k: result.get(k)
                    for k in (
                        "runs",
                        "batch_size",
                        "train_seconds",
                        "test_acc",
                        "exit_layer",
                        "time_to_target_s",
                        "parameter_compression",
                    )
                },
            )
    by = {(r["budget"], r["method"]): r for r in rows}
    nf, bp = by[("bp16", "neuroflux")], by[("bp16", "backprop")]
    dataset_bytes = 28 * 28  # a Fashion-MNIST image as stored (uint8)
    summary = {
        "speedup_vs_bp_at_bp16_train_time": bp["train_seconds"] / nf["train_seconds"] if nf["runs"] else None,
        "neuroflux_runs_where_bp_cannot": by[("below_bp", "neuroflux")]["runs"]
        and not by[("below_bp", "backprop")]["runs"],
        "parameter_compression": nf.get("parameter_compression"),
        "test_acc_neuroflux_minus_bp": nf["test_acc"] - bp["test_acc"],
        "spill_over_dataset_fp32": [s["fp32_bytes_per_sample"] / dataset_bytes for s in nf["spill"]],
        "spill_over_dataset_int8": [s["int8_codec_bytes_per_sample"] / dataset_bytes for s in nf["spill"]],
    }
    print(summary)
    write_result(
        "neuroflux",
        {
            "question": "NeuroFlux vs BP vs classic LL at one memory budget: time, accuracy, exit, spill",
            "settings": {
                **vars(args),
                "arch": ARCH,
                "width_mult": WIDTH,
                "resolution": RES,
                "profile_batches": PROFILE_BATCHES,
                "budgets_bytes": budgets,
                "data": "Fashion-MNIST (Debian package), train/val subsets of the official train split",
            },
            "profile": {kind: [f.as_dict() for f in fs] for kind, fs in fits.items()}
            | {"bp": bp_fit.as_dict()},
            "rows": rows,
            "summary": summary,
            "targets": {
                "neuroflux_faster_than_bp_same_budget": bool(
                    summary["speedup_vs_bp_at_bp16_train_time"]
                    and summary["speedup_vs_bp_at_bp16_train_time"] > 1
                ),
                "trains_where_bp_cannot": bool(summary["neuroflux_runs_where_bp_cannot"]),
                "exit_10x_fewer_parameters": bool((summary["parameter_compression"] or 0) >= 10),
            },
        },
    )


if __name__ == "__main__":
    main()
