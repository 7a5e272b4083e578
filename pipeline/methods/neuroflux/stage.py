"""Recipe stages: NeuroFlux, classic local learning and backpropagation under one memory budget.

``neuroflux`` (``variant: neuroflux``), per the paper:
  images -> profile every layer+aux head -> Algorithm 1 blocks (each with its batch size)
  -> for each block: read its input (the images, or the spill after the previous block,
     re-chunked to the block's batch size and prefetched) -> local learning -> stored block
  -> spill its outputs to the store for the next block -> early exit -> exported compact model.
``variant: classic_ll`` is the paper's classic local-learning baseline: the same local losses
with classic (fixed-width) auxiliary nets, every layer trained together as one block at one
batch size, so all layers' weights and optimizer states are in memory at once.
``backprop`` trains the same network end to end with the largest batch the budget holds.

Everything a run produces is a store entry keyed by the stage's training fingerprint (its
fingerprint without the exit settings): a trained block (with a per-epoch checkpoint while it
trains) and each spill; ``blocks.py`` runs that loop. A killed run therefore resumes
where it stopped: trained blocks are loaded, a block in training continues from its last
epoch, a spill being written continues at its first missing chunk. Spills are dropped once the
next one exists unless ``keep_spills``; the budget (``store.max_bytes``) governs them like any entry.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator

from stores.catalog import Catalog

from ...deploy.model_file import save_exit_model
from ...errors import ModelError, StageError
from ...fingerprint import derived_fingerprint, is_cacheable, partial_fingerprint
from ...lazy import lazy_module
from ...models.weights import load_weights
from ...ops.batching import Batch, every_kth, rechunk, xy
from ...ops.prefetch import prefetch
from ...spec import RESULT, STREAM, Spec
from ...stage import Stage, StageCall, StageInputs
from ...stream import Stream
from ..amp import check_precision
from ..graphed import check_cuda_graph
from ..trainer import TrainConfig, evaluate, train
from .archs import ARCHS
from .exit import (
    FINETUNE_REACH,
    ExitCandidate,
    ExitRule,
    FinetunedExit,
    choose_exit,
    count_parameters,
    export_model,
    load_exported,
    search_exit,
    throughput,
)
from .partition import Block, MemoryBudgetError, block_bytes, block_max_batch, partition
from .profiler import DEFAULT_BATCHES, MemoryFit, profile_module
from .spill import SpillConfig, Spills

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...context import RunContext
    from . import aux as aux_heads
    from . import blocks as block_runs
    from . import local as local_learning
    from . import models as layer_nets
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")
    aux_heads = lazy_module("pipeline.methods.neuroflux.aux")
    block_runs = lazy_module("pipeline.methods.neuroflux.blocks")
    local_learning = lazy_module("pipeline.methods.neuroflux.local")
    layer_nets = lazy_module("pipeline.methods.neuroflux.models")

# Settings that only choose, report or export the exit: they never change a trained block.
EXIT_SETTINGS = frozenset(
    {"exit_rule", "exit_tolerance", "exit_finetune_epochs", "exit_finetune_reach", "export",
     "target_accuracy"})
MIB = 2**20


def _measured_by(device: torch.device | None) -> str:
    """How the memory lines were measured on ``device`` (results name it: budgets compare only so)."""
    if device is not None and torch.device(device).type == "cuda":
        return "torch.cuda.max_memory_allocated"
    return "training-memory meter (saved tensors + weights, gradients, optimizer state)"


def net_device(net: nn.Module) -> torch.device:
    return next(net.parameters()).device


def trainable(batches: Iterator[Batch]) -> Iterator[Batch]:
    """Drop a trailing batch of one sample: batch norm cannot train on it."""
    for b in batches:
        if len(b["y"]) > 1:
            yield b


class _BudgetedTraining(Stage):
    """What every method at a memory budget shares: data, model, budget, schedule, evaluation."""

    kind: ClassVar[str] = RESULT
    inputs: ClassVar[dict[str, str]] = {"input": STREAM}
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"prefetch", "eval_batch_size"})
    # 2: CPU steps and evaluation in fixed micro-batches (run.deterministic), spills padded as the
    # frozen forward pads: thread-invariant weights and spills
    # 3: batch norms' running statistics as their own kernel computes them (not a second var_mean;
    #    the variance may differ in the last bit)
    version: ClassVar[int] = 3
    trains: ClassVar[bool] = True

    input: str = Field(description="decoded image stream with train, val (and test) splits")
    arch: str = Field(
        "vgg11", description=f"one of {', '.join(ARCHS)} (32x32 variants, trained from scratch)"
    )
    width_mult: float = Field(1.0, gt=0)
    memory_budget_mib: float = Field(gt=0, description="training memory budget M (MiB)")
    batch_cap: int = Field(128, ge=1, description="largest batch size any block/method may use (B)")
    profile_batches: tuple[int, ...] = Field(DEFAULT_BATCHES, description="batch sizes the profiler measures")
    train: TrainConfig = TrainConfig(epochs=5)
    eval_batch_size: int = Field(256, ge=1)
    prefetch: int = Field(2, ge=0, description="training batches kept ready by a background thread")
    target_accuracy: float | None = Field(
        None, gt=0, le=1, description="report the time until validation accuracy first reaches this"
    )
    val_per_epoch: int | None = Field(
        None, ge=1, description="validate each epoch (the curve, the time to target, the best epoch) on "
        "about this many samples, every k-th of the validation split (all of it when unset); the exit is "
        "chosen on the whole split, once, after training: a large split then decides the exit surely "
        "without making every epoch's check dearer")
    seed: int = 0

    @field_validator("profile_batches")
    @classmethod
    def _two_batches(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(value)) < 2 or min(value) < 1:
            raise ValueError(f"profile_batches needs two or more distinct sizes >= 1, got {list(value)}")
        return tuple(sorted(set(value)))

    @property
    def budget_bytes(self) -> int:
        return int(self.memory_budget_mib * MIB)

    def _image_shape(self, spec: Spec) -> tuple[int, int, int]:
        for split in ("train", "val"):
            spec.split(split, stage=self.type_name)
        x = spec.splits["train"].fields.get("x")
        if x is None or len(x.shape) != 3:
            raise StageError(f"`input: {self.input}` must carry images 'x' of shape (C,H,W), found {x}")
        c, h, w = (int(d) for d in x.shape)
        if h != w:
            raise StageError(f"`input: {self.input}` has {h}x{w} images; the models expect square inputs")
        return c, h, w

    def _net(self, spec: Spec) -> layer_nets.LayerNet:
        c, h, _ = self._image_shape(spec)
        try:
            return layer_nets.build_layer_net(
                self.arch,
                spec.num_classes,
                width_mult=self.width_mult,
                in_channels=c,
                resolution=h,
                seed=self.seed,
            )
        except ModelError as exc:
            raise StageError(f"arch: {exc}") from None

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        self._net(inputs["input"])  # unknown family, too-small images: fail before any work
        if self.type_name == "neuroflux" and self.train.memory_format != "contiguous":
            raise StageError(f"train.memory_format: {self.train.memory_format} is not applied by NeuroFlux's "
                             "layer-wise local learning; remove it here (the backprop stage takes it)")
        check_precision(self.train.precision, ctx.torch_device)
        eager_only = "NeuroFlux's local learning steps run eagerly" if self.type_name == "neuroflux" else None
        check_cuda_graph(self.train.cuda_graph, ctx.torch_device, self.train.precision, self.train.optimizer,
                         eager_only=eager_only)
        return Spec(RESULT, inputs["input"].num_classes, meta={"arch": self.arch})

    # ------------------------------------------------------------------ data
    def _train_batches(self, stream: Stream,
                       batch_size: int) -> Callable[[int], Iterator[tuple[torch.Tensor, torch.Tensor]]]:
        def batches(epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            opened = stream.open("train", epoch=epoch, shuffle=True, seed=self.seed)
            # Re-chunk (and dequantize, for spills) on the prefetch thread, off the training loop.
            return xy(prefetch(trainable(rechunk(opened, batch_size)), self.prefetch, name="nf-train"))

        return batches

    def _eval_batches(
        self, stream: Stream, split: str = "val", *, per_epoch: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``split``'s batches; ``per_epoch``: the subset every epoch's check sees (``val_per_epoch``)."""
        opened = stream.open(split)
        stride = self._epoch_stride(stream, split) if per_epoch else 1
        return xy(rechunk(opened if stride == 1 else every_kth(opened, stride), self.eval_batch_size))

    def _epoch_stride(self, stream: Stream, split: str = "val") -> int:
        """Every how many of ``split``'s samples an epoch's check sees (1: all of them)."""
        total = stream.spec.splits[split].num_samples
        return 1 if self.val_per_epoch is None else max(1, -(-total // self.val_per_epoch))

    @staticmethod
    def _test_split(stream: Stream) -> str:
        return "test" if "test" in stream.spec.splits else "val"

    def _curve_metrics(self, curve: list[tuple[float, float]]) -> dict[str, Any]:
        reached = None
        if self.target_accuracy is not None:
            reached = next((t for t, acc in curve if acc >= self.target_accuracy), None)
        return {"val_curve": curve, "target_accuracy": self.target_accuracy, "time_to_target_s": reached}

    def _whole_network(self, spec: Spec, device: torch.device) -> tuple[layer_nets.LayerNet, MemoryFit, int]:
        """(network, its memory line, the largest batch backpropagation through all of it fits the budget)."""
        net = self._net(spec).to(device)
        fit = self._profile("the whole network", net, net.in_shape, spec.num_classes, net_device(net))
        return net, fit, fit.max_batch(self.budget_bytes, self.batch_cap)

    def _end_to_end(self, ctx: RunContext, name: str, images: Stream, net: layer_nets.LayerNet,
                    fit: MemoryFit, batch: int, started: float) -> dict[str, Any]:
        """Backpropagation through ``net`` at ``batch``, the best epoch's weights loaded back; its metrics
        (``train_seconds`` counted from ``started``)."""
        ctx.progress.log(f"[{name}] backprop at batch {batch} under {self.memory_budget_mib:.2f} MiB")
        curve: list[tuple[float, float]] = []

        def on_epoch(record: dict[str, Any]) -> None:
            best = max([record["val_acc"], *(acc for _, acc in curve)])
            curve.append((time.perf_counter() - started, best))
            ctx.metrics_log({"stage": name, **record})
            ctx.progress.log(
                f"[{name}] epoch {record['epoch']}: val acc {record['val_acc']:.3f} "
                f"({record['epoch_seconds']:.2f}s)"
            )

        out_dir = ctx.stage_dir(name)
        scratch = tempfile.TemporaryDirectory(prefix=f"{name}-ckpt-") if out_dir is None else None
        checkpoints = Path(scratch.name) if scratch is not None else out_dir
        assert checkpoints is not None
        n_train = images.spec.splits["train"].num_samples
        result = train(
            net,
            net.parameters(),
            self._train_batches(images, batch),
            lambda: self._eval_batches(images, per_epoch=True),
            self.train,
            checkpoint_dir=checkpoints,
            on_epoch=on_epoch,
            steps_per_epoch=-(-n_train // batch),
            bars=ctx.progress,
            label=name,
            batch_size=batch,
            batch_setting=f"stages.{name}.memory_budget_mib (the batch it allows) or stages.{name}.batch_cap",
        )
        train_seconds = time.perf_counter() - started
        state, _ = load_weights(checkpoints / "best.pt")
        net.load_state_dict(state)
        test_split = self._test_split(images)
        _, test_acc, test_n = evaluate(
            net, self._eval_batches(images, test_split), precision=self.train.precision
        )
        if scratch is not None:
            scratch.cleanup()
        return {
            "accuracy": test_acc,
            "test_split": test_split,
            "test_samples": test_n,
            "variant": "backprop",
            "arch": self.arch,
            "width_mult": self.width_mult,
            "memory_budget_mib": self.memory_budget_mib,
            "batch_size": batch,
            "predicted_mib": fit.bytes_at(batch) / MIB,
            "profile": {"slope": fit.slope, "intercept": fit.intercept, "r2": fit.r2},
            "best_val_accuracy": result.best_val_acc,
            "train_seconds": train_seconds,
            **self._curve_metrics(curve),
            "parameters": count_parameters(net),
            "epochs": self.train.epochs,
            "device": str(ctx.torch_device),
            "precision": self.train.precision,
            "memory_measured_by": _measured_by(ctx.torch_device),
        }

    @staticmethod
    def _whole_network_line(fit: MemoryFit) -> str:
        return (f"  whole network {fit.slope / MIB:.3f} MiB/sample {fit.intercept / MIB:.2f} MiB static  "
                f"R² {fit.r2:.4f}")

    def _profile(
        self, name: str, module: nn.Module, shape: tuple[int, ...], num_classes: int, device: torch.device
    ) -> MemoryFit:
        return profile_module(
            name,
            module,
            shape,
            num_classes=num_classes,
            optimizer=self.train.optimizer,
            batches=self.profile_batches,
            device=device,
        )


class NeuroFlux(_BudgetedTraining):
    """Adaptive local learning under a memory budget with block-wise activation spill (or classic LL)."""

    type_name: ClassVar[str] = "neuroflux"
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset(
        {"prefetch", "eval_batch_size", "export", "keep_spills"}
    )
    # 4: the planner trains by backpropagation where it fits at backprop_from_batch (default 16): a loose
    #    budget's fingerprint, which meant blocks, now means the end-to-end network
    version: ClassVar[int] = 4

    variant: Literal["neuroflux", "classic_ll"] = "neuroflux"
    aux: Literal["adaptive", "classic"] | None = Field(
        None, description="auxiliary nets; default adaptive for neuroflux, classic for classic_ll"
    )
    rho: float = Field(0.4, ge=0, lt=1, description="Algorithm 1: max relative batch-size spread in a block")
    spill: SpillConfig = SpillConfig()
    keep_spills: bool = Field(False, description="keep every spill (default: drop one once the next exists)")
    exit_rule: ExitRule = Field(
        "fewest_parameters_within", description="the exit: fewest parameters within exit_tolerance of the "
        "best exit's validation accuracy (fewest_parameters_within) or of the full model's, the last layer's "
        "(fewest_parameters_near_full), or the best exit (best)")
    exit_tolerance: float = Field(
        0.005, ge=0, le=1, description="near tie: validation accuracy within this of the rule's reference"
    )
    exit_finetune_epochs: int = Field(
        0, ge=0, description="fine-tune exits end to end (prefix and head, under the memory budget, at "
        "train's settings) for this many epochs before comparing them, smallest first, stopping at the first "
        "within exit_tolerance: smaller exits at the same accuracy (benchmarks/README.md). 0: as trained")
    exit_finetune_reach: float = Field(
        FINETUNE_REACH, ge=0, le=1, description="fine-tune only exits that start within exit_tolerance plus "
        "this of the reference (what fine-tuning can be expected to gain; further below, a try costs its "
        "epochs for nothing)")
    export: bool = Field(True, description="write the compact model to the run's output directory")
    backprop_from_batch: int | None = Field(
        16, ge=1, description="variant neuroflux: where backpropagation through the whole network fits the "
        "budget at this batch size or larger, the planner trains it end to end instead of in blocks and says "
        "so (faster there: local learning's per-layer heads cost more than backpropagation's large batch "
        "does; benchmarks/README.md); there is no early exit then. null: always Algorithm 1's blocks")

    @property
    def aux_kind(self) -> Literal["adaptive", "classic"]:
        return self.aux or ("adaptive" if self.variant == "neuroflux" else "classic")

    def training_fingerprint(self, call: StageCall) -> str | None:
        """What trained blocks and spills are keyed by: the stage's fingerprint minus the exit settings.

        Choosing or exporting a different exit never changes a trained block, so those settings are
        left out: a recipe that only changes ``exit_tolerance`` reuses every block. None when the
        stage's input cannot be fingerprinted (nothing is stored then).
        """
        stage_fp, parent = call.fingerprint, call.parents.get("input", "")
        if not (stage_fp and parent and is_cacheable(stage_fp) and is_cacheable(parent)):
            return None
        return partial_fingerprint(self, parent, EXIT_SETTINGS)

    # ------------------------------------------------------------------ plan
    def profile_layers(
        self, spec: Spec, device: torch.device | None = None
    ) -> tuple[layer_nets.LayerNet, nn.ModuleList, list[aux_heads.LocalLayer], list[MemoryFit]]:
        """(network, auxiliary heads, layer+head units, each unit's memory line): the profiler's step,
        on ``device`` (CUDA: the allocator's peak; CPU: the training-memory meter), where they then are."""
        device = torch.device(device or "cpu")
        net = self._net(spec)
        heads = aux_heads.build_aux_heads(net.info, self.aux_kind, spec.num_classes, seed=self.seed)
        net.to(device)
        heads.to(device)
        local = [aux_heads.LocalLayer(layer, head) for layer, head in zip(net.layers, heads, strict=True)]
        fits = [
            self._profile(info.name, local[i], info.in_shape, spec.num_classes, device)
            for i, info in enumerate(net.info)
        ]
        return net, heads, local, fits

    def backprop_plan(self, spec: Spec,
                      device: torch.device) -> tuple[layer_nets.LayerNet, MemoryFit, int] | None:
        """The planner's first question: does backpropagation fit the budget at ``backprop_from_batch`` or
        more? Then (network, its memory line, the batch) to train it end to end; else None (blocks)."""
        if self.variant != "neuroflux" or self.backprop_from_batch is None:
            return None
        net, fit, batch = self._whole_network(spec, device)
        return (net, fit, batch) if batch >= self.backprop_from_batch else None

    def _backprop_reason(self, batch: int) -> str:
        return (f"backpropagation fits {self.memory_budget_mib:.2f} MiB at batch {batch} (>= "
                f"backprop_from_batch {self.backprop_from_batch}), where it trains faster than local "
                "learning: trained end to end, no early exit (backprop_from_batch: null trains blocks)")

    def memory_plan(self, spec: Spec, device: torch.device | None = None) -> tuple[str, dict[str, Any]]:
        """What ``python -m pipeline memory`` shows: every layer's line and the blocks, before training."""
        planned = self.backprop_plan(spec, torch.device(device or "cpu"))
        if planned is not None:
            _, fit, batch = planned
            return f"  plan: backprop: {self._backprop_reason(batch)}\n{self._whole_network_line(fit)}", {
                "budget_mib": self.memory_budget_mib, "plan": "backprop", "fit": fit.as_dict(),
                "batch_size": batch, "measured_by": _measured_by(device)}
        net, _, _, fits = self.profile_layers(spec, device)
        rows = [
            f"  {f.name:<10} {f.slope / MIB:8.3f} MiB/sample {f.intercept / MIB:8.2f} MiB static  "
            f"R² {f.r2:.4f}  max batch {f.max_batch(self.budget_bytes, self.batch_cap)}"
            for f in fits
        ]
        out: dict[str, Any] = {"budget_mib": self.memory_budget_mib, "layers": [f.as_dict() for f in fits],
                               "measured_by": _measured_by(device)}
        try:
            blocks = self.plan(fits, [info.name for info in net.info])
        except MemoryBudgetError as exc:
            out["error"] = str(exc)
            return "\n".join([*rows, f"  cannot run: {exc}"]), out
        out["blocks"] = [b.as_dict() for b in blocks]
        rows += [
            f"  block {b.index}: layers {b.layers[0]}-{b.layers[-1]} at batch {b.batch_size}, "
            f"{b.predicted_bytes / MIB:.2f} MiB of {self.memory_budget_mib:.2f}"
            for b in blocks
        ]
        return "\n".join(rows), out

    def plan(self, fits: list[MemoryFit], names: list[str]) -> list[Block]:
        """Blocks with batch sizes: Algorithm 1, or one block of every layer for classic LL."""
        if self.variant == "neuroflux":
            return partition(fits, self.budget_bytes, cap=self.batch_cap, rho=self.rho, names=names)
        b = block_max_batch(fits, self.budget_bytes, self.batch_cap)
        if b < 1:
            raise MemoryBudgetError(
                f"memory budget {self.memory_budget_mib:.2f} MiB is too small for classic local learning "
                f"of {self.arch}: all {len(fits)} layers with their auxiliary nets train together and need "
                f"{block_bytes(fits, 1) / MIB:.2f} MiB at batch size 1"
            )
        per_layer = tuple(f.max_batch(self.budget_bytes, self.batch_cap) for f in fits)
        return [Block(0, tuple(range(len(fits))), b, per_layer, int(block_bytes(fits, b)))]

    # ------------------------------------------------------------------ run
    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> dict[str, Any]:
        name = call.name
        images: Stream = inputs["input"]
        started = time.perf_counter()
        planned = self.backprop_plan(images.spec, ctx.torch_device)
        if planned is not None:
            return self._run_backprop(ctx, call, images, *planned, started)
        net, heads, local, fits = self.profile_layers(images.spec, ctx.torch_device)
        names = [info.name for info in net.info]
        profile_seconds = time.perf_counter() - started
        blocks = self.plan(fits, names)
        ctx.progress.log(
            f"[{name}] {self.variant}: {len(blocks)} block(s) under {self.memory_budget_mib:.2f} MiB: "
            + "; ".join(f"layers {b.layers[0]}-{b.layers[-1]} at batch {b.batch_size}" for b in blocks)
        )

        fingerprint = self.training_fingerprint(call)
        scratch = None
        catalog = ctx.catalog
        if fingerprint is None:  # nothing may be stored under it: work in a throwaway store
            scratch = tempfile.TemporaryDirectory(prefix=f"{name}-neuroflux-")
            catalog = Catalog(scratch.name)
            fingerprint = derived_fingerprint("0" * 64, call.fingerprint or name)
        spills = Spills(
            catalog,
            fingerprint,
            self.spill,
            prefetch=self.prefetch,
            keep=self.keep_spills,
            log=lambda msg: ctx.progress.log(f"[{name}] {msg}"),
        )
        run = block_runs.BlockRun(
            self, ctx, name, catalog, fingerprint, net, local, blocks, images, spills, started
        )
        try:
            for block in blocks:
                run.train(block)
            run.finish()
        finally:
            spills.close()
        train_seconds = time.perf_counter() - started

        val_acc = run.val_acc
        if self._epoch_stride(images) > 1:  # the epochs saw a subset: the exit is chosen on all of it
            val_acc = dict(enumerate(local_learning.evaluate_heads(local, self._eval_batches(images))))
        candidates = [
            ExitCandidate(
                i, val_acc[i], count_parameters(aux_heads.ExitModel(list(net.layers[: i + 1]), heads[i]))
            )
            for i in range(len(net.layers))
        ]
        exit_started = time.perf_counter()
        tuned: dict[int, nn.Module] = {}
        tries: list[FinetunedExit] = []
        if self.exit_finetune_epochs:
            finetune = self._exit_finetuner(ctx, name, net, heads, images, tuned)
            chosen, tries = search_exit(candidates, finetune, rule=self.exit_rule,
                                        tolerance=self.exit_tolerance, reach=self.exit_finetune_reach)
        else:
            chosen = choose_exit(candidates, rule=self.exit_rule, tolerance=self.exit_tolerance)
        compact = tuned[chosen.layer] if chosen.layer in tuned else aux_heads.ExitModel(
            list(net.layers[: chosen.layer + 1]), heads[chosen.layer])
        compact.eval()
        exit_seconds = time.perf_counter() - exit_started
        test_split = self._test_split(images)
        _, test_acc, test_n = evaluate(compact, self._eval_batches(images, test_split),
                                       precision=self.train.precision)
        # Every exit's test accuracy, for reporting only (the choice above saw validation data only):
        # the accuracy-vs-size curve a user picks a different tolerance from.
        exit_test_acc = local_learning.evaluate_heads(local, self._eval_batches(images, test_split))
        shape = net.in_shape
        full_parameters = count_parameters(net)
        metrics: dict[str, Any] = {
            "accuracy": test_acc,
            "test_split": test_split,
            "test_samples": test_n,
            "variant": self.variant,
            "aux": self.aux_kind,
            "plan": "blocks",
            "arch": self.arch,
            "width_mult": self.width_mult,
            "memory_budget_mib": self.memory_budget_mib,
            "blocks": [
                {
                    **b.as_dict(),
                    "layers": list(b.layers),
                    "layer_batches": list(b.layer_batches),
                    "predicted_mib": b.predicted_bytes / MIB,
                    "status": run.status[b.index],
                }
                for b in blocks
            ],
            "profile": [
                {"layer": f.name, "slope": f.slope, "intercept": f.intercept, "r2": f.r2} for f in fits
            ],
            "profile_r2_min": min(f.r2 for f in fits),
            "profile_seconds": profile_seconds,
            "spill_seconds": run.spill_seconds,
            "blocks_reused": sum(status == "reused" for status in run.status.values()),
            "train_seconds": train_seconds,
            **self._curve_metrics(run.curve),
            "val_acc_per_layer": [val_acc[i] for i in range(len(net.layers))],
            "exit_candidates": [
                {**c.as_dict(), "test_acc": acc} for c, acc in zip(candidates, exit_test_acc, strict=True)
            ],
            "exit_layer": chosen.layer,
            "exit_val_acc": chosen.val_acc,
            "exit_seconds": exit_seconds,
            "exit_finetune": [
                {**t.as_dict(), "test_acc": exit_test_acc[t.layer] if t.layer not in tuned
                 else evaluate(tuned[t.layer], self._eval_batches(images, test_split),
                               precision=self.train.precision)[1]}
                for t in tries
            ],
            "compact_parameters": chosen.parameters,
            "full_parameters": full_parameters,
            "parameter_compression": full_parameters / chosen.parameters,
            "compact_images_per_s": throughput(compact, shape),
            "full_images_per_s": throughput(net, shape),
            "device": str(ctx.torch_device),
            "precision": self.train.precision,
            "memory_measured_by": _measured_by(ctx.torch_device),
            "spills": run.spill_report(),
            "epochs": self.train.epochs,
            "model_file": save_exit_model(ctx, call, compact, arch=self.arch, width_mult=self.width_mult,
                                          in_shape=shape, aux=self.aux_kind, exit_layer=chosen.layer,
                                          num_classes=images.spec.num_classes),
        }
        metrics["exit_speedup"] = metrics["compact_images_per_s"] / metrics["full_images_per_s"]
        self._export(ctx, name, compact, shape, images, test_split, metrics,
                     f"the exit at layer {chosen.layer}")
        if scratch is not None:
            scratch.cleanup()
        return metrics

    def _exit_finetuner(
        self, ctx: RunContext, name: str, net: layer_nets.LayerNet, heads: nn.ModuleList, images: Stream,
        tuned: dict[int, nn.Module],
    ) -> Callable[[ExitCandidate], FinetunedExit]:
        """What :func:`search_exit` calls on a candidate: a copy of the exit (its layers and head) trained end
        to end for ``exit_finetune_epochs`` at the largest batch its memory line fits under the budget, at
        ``train``'s settings, its best validation epoch kept where it beats the exit as trained (then put in
        ``tuned``; the network itself is never changed)."""
        device = net_device(net)
        n_train = images.spec.splits["train"].num_samples
        cfg = self.train.model_copy(update={"epochs": self.exit_finetune_epochs, "warmup_epochs": 0})

        def finetune(c: ExitCandidate) -> FinetunedExit:
            started = time.perf_counter()
            model = aux_heads.ExitModel(copy.deepcopy(list(net.layers[: c.layer + 1])),
                                        copy.deepcopy(heads[c.layer]))
            label = f"the exit at layer {c.layer}"
            fit = self._profile(label, model, net.in_shape, images.spec.num_classes, device)
            batch = fit.max_batch(self.budget_bytes, self.batch_cap)
            before = evaluate(model, self._eval_batches(images), precision=self.train.precision)[1]
            if batch < 2:  # batch norm needs two samples; an exit that cannot train here stays as trained
                ctx.progress.log(f"[{name}] {label}: not fine-tuned (no batch of 2 or more fits "
                                 f"{self.memory_budget_mib:.2f} MiB end to end)")
                return FinetunedExit(c.layer, before, before, None, time.perf_counter() - started)
            with tempfile.TemporaryDirectory(prefix=f"{name}-exit-") as checkpoints:
                result = train(model, model.parameters(), self._train_batches(images, batch),
                               lambda: self._eval_batches(images, per_epoch=True), cfg,
                               checkpoint_dir=Path(checkpoints),
                               steps_per_epoch=-(-n_train // batch), bars=ctx.progress,
                               label=f"{name}: exit {c.layer}", batch_size=batch,
                               batch_setting=f"stages.{name}.memory_budget_mib or stages.{name}.batch_cap")
                after = result.best_val_acc if result.best_val_acc is not None else before
                # the best epoch, if picked on a subset, is judged like the exit before it: on all of them
                rejudge = result.best_val_acc is not None and self._epoch_stride(images) > 1
                if rejudge or after > before:
                    model.load_state_dict(load_weights(Path(checkpoints) / "best.pt")[0])
                if rejudge:
                    after = evaluate(model, self._eval_batches(images), precision=self.train.precision)[1]
                if after > before:
                    tuned[c.layer] = model
            ctx.progress.log(f"[{name}] {label} fine-tuned at batch {batch}: val acc {before:.3f} -> "
                             f"{max(after, before):.3f}")
            return FinetunedExit(c.layer, before, max(after, before), batch, time.perf_counter() - started)

        return finetune

    def _export(self, ctx: RunContext, name: str, compact: nn.Module, shape: tuple[int, ...], images: Stream,
                test_split: str, metrics: dict[str, Any], what: str) -> None:
        """With ``export``: ``compact`` as a torch.export program in the stage's folder, with reference
        inputs and outputs beside it; what was written goes into ``metrics``."""
        out_dir = ctx.stage_dir(name)
        if not self.export or out_dir is None:
            return
        # Exported from a CPU copy: the file is for devices, and loads on any machine.
        compact = copy.deepcopy(compact).cpu()
        path = export_model(compact, shape, out_dir / "exit_model.pt2")
        # Reference inputs and outputs beside the model, so a device can check its copy computes
        # what the toolkit's model computes; checked here once against the exported program.
        x = next(self._eval_batches(images, test_split))[0][:32].cpu()
        with torch.no_grad():
            logits = compact(x)
            diff = (load_exported(path)(x) - logits).abs().max().item()
        block_runs.save_atomic({"x": x, "logits": logits}, out_dir / "exit_model.reference.pt")
        metrics.update(exported_model=str(path), exported_max_abs_diff=diff,
                       bytes_written=path.stat().st_size)
        ctx.progress.log(f"[{name}] exported {what} to {path}")

    def _run_backprop(self, ctx: RunContext, call: StageCall, images: Stream, net: layer_nets.LayerNet,
                      fit: MemoryFit, batch: int, started: float) -> dict[str, Any]:
        """The planner's backpropagation: the whole network end to end, reported as this stage's result
        (``plan: backprop``, the reason), its model file the whole network (layers and classifier)."""
        reason = self._backprop_reason(batch)
        ctx.progress.log(f"[{call.name}] plan: {reason}")
        metrics = self._end_to_end(ctx, call.name, images, net, fit, batch, started)
        whole = aux_heads.ExitModel(list(net.layers), net.classifier).eval()
        parameters = count_parameters(net)
        metrics.update({
            "variant": self.variant,
            "aux": self.aux_kind,
            "plan": "backprop",
            "plan_reason": reason,
            "blocks": [],
            "exit_layer": None,
            "compact_parameters": parameters,
            "full_parameters": parameters,
            "parameter_compression": 1.0,
            "model_file": save_exit_model(ctx, call, whole, arch=self.arch, width_mult=self.width_mult,
                                          in_shape=net.in_shape, aux=self.aux_kind,
                                          exit_layer=len(net.layers) - 1, num_classes=images.spec.num_classes,
                                          head="classifier"),
        })
        self._export(ctx, call.name, whole, net.in_shape, images, metrics["test_split"], metrics,
                     "the whole network")
        return metrics


class Backprop(_BudgetedTraining):
    """The baseline: end-to-end backpropagation with the largest batch that fits the budget."""

    type_name: ClassVar[str] = "backprop"

    def memory_plan(self, spec: Spec, device: torch.device | None = None) -> tuple[str, dict[str, Any]]:
        """What ``python -m pipeline memory`` shows: the whole network's line and the batch it allows."""
        _, fit, batch = self._whole_network(spec, torch.device(device or "cpu"))
        text = (
            self._whole_network_line(fit)
            + f"\n  batch {batch} under {self.memory_budget_mib:.2f} MiB"
            + ("" if batch else f" (cannot run: needs {fit.bytes_at(1) / MIB:.2f} MiB at batch size 1)")
        )
        return text, {"budget_mib": self.memory_budget_mib, "fit": fit.as_dict(), "batch_size": batch,
                      "measured_by": _measured_by(torch.device(device or "cpu"))}

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> dict[str, Any]:
        images: Stream = inputs["input"]
        started = time.perf_counter()
        net, fit, batch = self._whole_network(images.spec, ctx.torch_device)
        if batch < 1:
            raise MemoryBudgetError(
                f"memory budget {self.memory_budget_mib:.2f} MiB is too small for backpropagation through "
                f"{self.arch} (width {self.width_mult}): it needs {fit.bytes_at(1) / MIB:.2f} MiB at batch "
                f"size 1 ({fit.intercept / MIB:.2f} MiB weights, gradients and optimizer state, "
                f"{fit.slope / MIB:.2f} MiB per sample)"
            )
        return self._end_to_end(ctx, call.name, images, net, fit, batch, started)
