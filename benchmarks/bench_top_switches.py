"""Which speed switch pays for the trained top, cut by cut (issue: faster than the loop a user would write).

The trained top of Cache & Reuse (MobileNetV2 at 224x224, the last 1, 4 and 7 blocks, batch 32, AdamW as
the trainer makes it) on feature tensors already in memory, so that only the top's arithmetic differs:

- ``eager``: the plain loop a user writes (``zero_grad``, forward, cross-entropy, ``backward``, ``step``)
  at torch's default thread count: the anchor every ratio divides by;
- ``trainer``: :func:`pipeline.methods.trainer.train` as a run calls it (``run.threads: auto``,
  ``run.deterministic``: micro-batches of 16, one thread each), in float32 and contiguous layout;
- ``trainer_channels_last``, ``trainer_bf16``, ``trainer_bf16_channels_last``: the same with
  ``train.memory_format: channels_last`` and/or ``train.precision: bf16``;
- ``eager_compiled``, ``eager_compiled_bf16``: the plain loop with the top under ``torch.compile``
  (inductor, this CPU's C++ compiler), float32 and bf16 autocast; the first epoch, which compiles,
  is reported apart (``first_epoch_seconds``) and left out of the steady time, like every pass's.

Every pass starts from the same weights and sees the same batches. Each repeat runs every pass back
to back, the order reversed every other repeat, and each pass's ratio is taken to the anchor of its
own repeat; the figures are the medians over repeats. A fresh spawned process per cut, with the
toolkit's heap policy applied as the CLI applies it.

``--accuracy`` also trains the Fashion-MNIST recipe's 2-bit row (recipes/cache_reuse/fashion_mnist.yaml,
``bits_2``: 20 epochs from a 2-bit cache with feature augmentation) with each trainer switch, over
``--seeds``, and reports test accuracy (mean, spread): whether a switch keeps accuracy within noise.

Usage: python -m benchmarks.bench_top_switches [--cuts 1 4 7] [--repeats 3] [--pass-seconds 2]
       [--accuracy --seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.bench_cache_reuse import steady

BATCH = 32
SAMPLES = 256
TRAINER_SWITCHES = {  # pass name -> train settings (TrainConfig fields)
    "trainer": {},
    "trainer_channels_last": {"memory_format": "channels_last"},
    "trainer_bf16": {"precision": "bf16"},
    "trainer_bf16_channels_last": {"precision": "bf16", "memory_format": "channels_last"},
}
COMPILED = {"eager_compiled": False, "eager_compiled_bf16": True}  # pass name -> bf16 autocast


def measure_cut(n: int, repeats: int, pass_seconds: float, arch: str = "mobilenet_v2", samples: int = SAMPLES,
                compiled: bool = True) -> dict[str, Any]:
    """Every pass at cut ``n`` of ``arch``, ``repeats`` times (``compiled``: with the torch.compile passes);
    run in a fresh process."""
    import torch

    from pipeline import threads
    from pipeline.methods.trainer import TrainConfig, make_optimizer, train
    from pipeline.models.zoo import build_backbone, split_at
    from pipeline.switches import apply_process_settings

    apply_process_settings()
    cores = torch.get_num_threads()
    threads.install("auto")
    torch.manual_seed(0)
    bottom, top0 = split_at(build_backbone(arch, 10), n)
    with torch.inference_mode():
        shape = tuple(bottom(torch.zeros(1, 3, 224, 224)).shape[1:])
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(samples, *shape, generator=g).clamp(0, 6)
    labels = torch.randint(0, 10, (samples,), generator=g)
    batches = [(feats[s:s + BATCH], labels[s:s + BATCH]) for s in range(0, samples, BATCH)]

    def eager(epochs: int, compiled: bool = False, bf16: bool = False) -> list[float]:
        torch.set_num_threads(cores)
        top = copy.deepcopy(top0).train()
        step_model = torch.compile(top) if compiled else top
        opt = make_optimizer(list(top.parameters()), TrainConfig(lr=1e-3, optimizer="adamw"))
        loss_fn = torch.nn.CrossEntropyLoss()
        times = []
        for _ in range(epochs):
            t0 = time.perf_counter()
            for x, y in batches:
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = step_model(x)
                loss = loss_fn(out.float(), y)
                loss.backward()
                opt.step()
            times.append(time.perf_counter() - t0)
        return times

    def trainer(epochs: int, settings: dict[str, str]) -> list[float]:
        top = copy.deepcopy(top0)
        cfg = TrainConfig(epochs=epochs, lr=1e-3, optimizer="adamw", **settings)
        result = train(top, top.parameters(), lambda _e: batches, None, cfg, checkpoint_dir=None,
                       batch_size=BATCH)
        return [h["epoch_seconds"] for h in result.history]

    epochs = max(3, 1 + math.ceil(pass_seconds / steady(eager(3))))
    passes = {"eager": lambda: eager(epochs)}
    passes.update({name: (lambda s=settings: trainer(epochs, s))
                   for name, settings in TRAINER_SWITCHES.items()})
    if compiled:
        passes.update({name: (lambda b=bf16: eager(epochs, True, b)) for name, bf16 in COMPILED.items()})
    runs: dict[str, list[list[float]]] = {name: [] for name in passes}
    for i in range(repeats):
        order = list(passes) if i % 2 == 0 else list(passes)[::-1]
        for name in order:
            runs[name].append(passes[name]())
        torch._dynamo.reset()  # the next repeat compiles again (from inductor's on-disk cache)
    anchor = [steady(t) for t in runs["eager"]]
    row: dict[str, Any] = {"train_last_blocks": n, "feature_shape": list(shape), "epochs_per_pass": epochs,
                           "samples": samples, "batch": BATCH, "passes": {}}
    for name, times in runs.items():
        ratios = [steady(t) / a for t, a in zip(times, anchor, strict=True)]
        row["passes"][name] = {
            "steady_epoch_seconds": [steady(t) for t in times],
            "first_epoch_seconds": [t[0] for t in times],
            "over_eager_paired": ratios,
            "over_eager_median": statistics.median(ratios),
        }
    trainer_passes = {k: v["over_eager_median"] for k, v in row["passes"].items() if k.startswith("trainer")}
    row["best_trainer_pass"] = min(trainer_passes, key=trainer_passes.__getitem__)
    return row


def accuracy(seeds: list[int]) -> dict[str, Any]:
    """Test accuracy of the Fashion-MNIST recipe's 2-bit row with each trainer switch, per seed."""
    from pipeline.context import RunContext
    from pipeline.recipe import load_recipe
    from pipeline.runner import Runner
    from stores.catalog import Catalog

    recipe_path = Path(__file__).resolve().parents[1] / "recipes" / "cache_reuse" / "fashion_mnist.yaml"
    out: dict[str, Any] = {"recipe": str(recipe_path.relative_to(recipe_path.parents[2])), "row": "bits_2",
                           "per_seed": {}, "summary": {}}
    with tempfile.TemporaryDirectory(prefix="bench-top-switches-") as store:
        for seed in seeds:
            accs = {}
            for name, settings in TRAINER_SWITCHES.items():
                overrides = [f"stages.bits_2.seed={seed}", f"stages.aug2.seed={seed}", "targets=[bits_2]",
                             *[f"stages.bits_2.train.{k}={v}" for k, v in settings.items()]]
                recipe = load_recipe(recipe_path, overrides)
                ctx = RunContext(catalog=Catalog(Path(store)), seed=recipe.seed, recipe_name=recipe.name)
                reports = {r.name: r for r in Runner(recipe, ctx).run()}
                metrics = reports["bits_2"].metrics
                accs[name] = {"test_acc": metrics["accuracy"],
                              "epoch_seconds": metrics["epoch_seconds_steady"]}
                print(f"seed {seed} {name}: test {metrics['accuracy']:.4f}", flush=True)
            out["per_seed"][seed] = accs
    for name in TRAINER_SWITCHES:
        values = [out["per_seed"][s][name]["test_acc"] for s in seeds]
        base = [out["per_seed"][s]["trainer"]["test_acc"] for s in seeds]
        out["summary"][name] = {
            "test_acc_mean": statistics.mean(values),
            "test_acc_spread": (max(values) - min(values)) if len(values) > 1 else 0.0,
            "minus_fp32_points_mean": 100 * statistics.mean(v - b for v, b in zip(values, base, strict=True)),
        }
    return out


def headline(rows: list[dict[str, Any]]) -> str:
    """One line for the results page: per cut, the fastest trainer switch's time over the eager loop."""
    def switch(name: str) -> str:
        return name.removeprefix("trainer_") if name != "trainer" else "fp32"

    return "trained top's epoch over the plain eager loop, best switch per cut: " + ", ".join(
        f"cut {r['train_last_blocks']} {r['passes'][r['best_trainer_pass']]['over_eager_median']:.2f} "
        f"({switch(r['best_trainer_pass'])})" for r in rows) + " (bar 0.85)"


def command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run."""
    parts = ["python -m benchmarks.bench_top_switches", f"--arch {args.arch}",
             f"--cuts {' '.join(map(str, args.cuts))}", f"--samples {args.samples}",
             f"--repeats {args.repeats}", f"--pass-seconds {args.pass_seconds}"]
    if not args.compile:
        parts.append("--no-compile")
    if args.accuracy:
        parts.append(f"--accuracy --seeds {' '.join(map(str, args.seeds))}")
    return " ".join(parts)


def main() -> None:
    from benchmarks._meta import write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="mobilenet_v2",
                    help="the backbone whose top trains (swin_t: a transformer)")
    ap.add_argument("--cuts", type=int, nargs="*", default=[1, 4, 7], help="none: the accuracy part only")
    ap.add_argument("--samples", type=int, default=SAMPLES, help="feature maps per epoch")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="leave out the torch.compile passes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pass-seconds", type=float, default=2.0, help="steady seconds each pass runs at least")
    ap.add_argument("--accuracy", action="store_true", help="also the Fashion-MNIST accuracy of each switch")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--results-dir", type=Path, default=None,
                    help="write the JSON here, not in benchmarks/results (a trial run must not replace one)")
    args = ap.parse_args()
    rows = []
    for n in args.cuts:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            row = pool.submit(measure_cut, n, args.repeats, args.pass_seconds, args.arch, args.samples,
                              args.compile).result()
        rows.append(row)
        print(f"cut {n}: " + ", ".join(f"{k} {v['over_eager_median']:.2f}" for k, v in row["passes"].items()),
              flush=True)
    payload: dict[str, Any] = {
        "question": "per cut, the trained top's steady epoch time with each speed switch, over the plain "
                    "eager loop on the same tensors",
        "command": command(args),
        "settings": {**{k: v for k, v in vars(args).items() if k != "results_dir"},
                     "resolution": 224, "weights": "random init",
                     "features": "randn clamped to [0, 6], in memory", "optimizer": "adamw (fused)"},
        "rows": rows,
        "headline": headline(rows) if rows else "",
        "targets": {"best_trainer_pass_at_most_0_85_of_eager": all(
            r["passes"][r["best_trainer_pass"]]["over_eager_median"] <= 0.85 for r in rows)} if rows else {},
    }
    if args.accuracy:
        payload["accuracy"] = accuracy(args.seeds)
    name = "top_switches" if args.arch == "mobilenet_v2" else f"top_switches_{args.arch}"
    print(f"wrote {write_result(name, payload, args.results_dir)}")


if __name__ == "__main__":
    main()
