"""Transfer learning of the top blocks: single-stage baseline or two-stage from a feature cache.

Cache & Reuse (Yang et al.), Algorithm 1 vs Algorithm 2, on equal terms: the same
backbone, cut, optimizer, schedule, epochs and evaluation. Only where the training
batches come from differs, chosen by ``mode``:
- ``single_stage``: augmented images -> frozen bottom (no grad) -> top, every epoch;
- ``two_stage``: cached, dequantized, feature-augmented maps -> top.
Both evaluate the same function (bottom then top) on un-augmented data.

``method`` decides how the top trains (``pipeline.methods.adapters``): vanilla (every
parameter of the top), the FT-Last / FT-Norm+Last / FT-Full baselines, MobileTL or TinyTL.
It is applied to the top, after the cut, so every method trains from a cache as well as
from images. Each trainer logs its training-memory footprint (``pipeline.models.memory``).

``init`` starts the top from an earlier model file instead of the backbone's (a model update:
``pipeline.methods.warm_start``), its head grown for classes it did not know, and ``replay`` mixes
samples of the classes it knew into every batch of new ones.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator

from ..deploy.model_file import MODEL_FILE, save_transfer_model
from ..device import out_of_memory
from ..errors import DataError, ModelError, StageError
from ..lazy import lazy_module
from ..models.arch import ArchConfig, ModelValue, check_cut, seeded_net, structure
from ..models.weights import load_weights
from ..ops.batching import rechunk, xy
from ..spec import MODEL, RESULT, STREAM, Spec
from ..stage import Stage, StageCall, StageInputs
from ..stream import Stream
from . import build_record
from .adapters import DEFAULT_METHOD, Adapted, MethodConfig, apply_method, check_method, method_shorthand
from .amp import check_precision
from .checkpoint import CHECKPOINT_FILE
from .graphed import check_cuda_graph, graph_refusal
from .trainer import TrainConfig, cross_entropy, evaluate, train
from .warm_start import (
    DISTILL_TEMPERATURE,
    ClassPlan,
    Distillation,
    InitError,
    InitSource,
    Replay,
    UpdateReport,
    accuracy_of,
    class_tallies,
    count_classes,
    keep_columns,
    locate_init,
    of_classes,
    plan_init,
    prior_correction,
    read_init,
    warm_start,
)

if TYPE_CHECKING:
    import torch

    from stores.catalog import Entry

    from ..context import RunContext
    from ..models import memory, zoo
    from ..models.memory import Footprint
    from ..models.zoo import BlockNet, TopNet
else:
    torch = lazy_module("torch")
    memory = lazy_module("pipeline.models.memory")
    zoo = lazy_module("pipeline.models.zoo")

RESULT_FILE = "result.json"
BEST_FILE = "best.pt"  # the top's (single_stage: the whole network's) weights chosen on validation data


class Finetune(Stage):
    """Train the top blocks + classifier: two_stage from cached features, or the single_stage baseline."""

    type_name: ClassVar[str] = "finetune"
    # 2: CPU steps and evaluation in fixed micro-batches (run.deterministic): thread-invariant weights
    # 3: batch norms' running statistics as their own kernel computes them (not a second var_mean;
    #    the variance may differ in the last bit)
    version: ClassVar[int] = 3
    trains: ClassVar[bool] = True
    kind: ClassVar[str] = RESULT
    inputs: ClassVar[dict[str, str]] = {"model": MODEL, "images": STREAM, "features": STREAM}
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"memory_report", "prefetch"})
    # The trained result is a store entry keyed by the fingerprint: an identical rerun reuses it, and a
    # killed run continues from the last epoch checkpointed in its staging directory.
    cacheable: ClassVar[bool] = True
    resumable: ClassVar[bool] = True

    model: str
    images: str | None = Field(None, description="image stream (single_stage)")
    features: str | None = Field(None, description="feature stream at the cut (two_stage)")
    mode: Literal["two_stage", "single_stage"] = "two_stage"
    train_last_blocks: int | None = Field(None, ge=0, description="default: the cut of `features`")
    batch_size: int = Field(32, ge=1)
    eval_batch_size: int = Field(256, ge=1)
    train: TrainConfig = TrainConfig(epochs=10)
    method: MethodConfig = Field(DEFAULT_METHOD, description="vanilla | ft_full | ft_last | ft_norm_last | "
                                 "mobiletl {variant} | tinytl {mode}: how the top trains")
    memory_report: bool = Field(True, description="meter one training step and log the footprint")
    # Off by default: on a CPU whose cores the training step already fills, torch ops on a second
    # thread start a second OpenMP team that contends with training and lengthens epochs
    # (benchmarks/bench_train_prefetch). It pays when the step runs on an accelerator and CPU cores
    # sit idle.
    prefetch: int = Field(0, ge=0, description="training batches prepared on a background thread, "
                          "running on into the next epoch while one ends (GPU training; 0: training thread)")
    init: str | None = Field(
        None, description="start from an earlier model instead of the backbone's head: a model file a run "
        "wrote (<run>/stages/<stage>/model.pt) or a stored finetune result's fingerprint (prefix); new "
        "classes grow the head; identified by the file's content, not its path")
    replay: float | None = Field(
        None, ge=0, lt=1, description="with init: the share of each batch drawn from earlier samples (those "
        "of the classes init was trained on); an epoch is one pass over the new classes' samples. Unset: "
        "every training sample, as without init")
    distill: float | None = Field(
        None, gt=0, description="with init: weight of a distillation term keeping the model's scores on the "
        "classes init knew close to init's own (Learning without Forgetting, temperature 2; one more "
        "forward of the trained part per step). Unset: cross-entropy alone")
    seed: int = 0

    @field_validator("method", mode="before")
    @classmethod
    def _method_shorthand(cls, value: Any) -> Any:
        return method_shorthand(value)

    def input_refs(self) -> dict[str, str]:
        data = "features" if self.mode == "two_stage" else "images"
        value = getattr(self, data)
        if value is None:
            raise StageError(f"mode {self.mode!r} reads from `{data}:`, which is not set")
        return {"model": self.model, data: value}

    def _cut(self, inputs: Mapping[str, Spec], model_fingerprint: str | None = None) -> int:
        """The number of top blocks to train: the features' typed ``Cut`` (two_stage), or the config.

        ``model_fingerprint``: the model input's, which the features must have been made with
        (checked when resolving; None: not checked again).
        """
        model = inputs["model"]
        if self.mode == "two_stage":
            cut = inputs["features"].cut
            if cut is None:
                raise StageError(f"`features: {self.features}` is not a feature stream from a frozen_forward "
                                 "stage (its spec has no cut)")
            if self.train_last_blocks is not None and self.train_last_blocks != cut.train_last_blocks:
                raise StageError(f"train_last_blocks={self.train_last_blocks} but `{self.features}` was cut "
                                 f"at train_last_blocks={cut.train_last_blocks}")
            if model_fingerprint is not None and cut.model != model_fingerprint:
                raise StageError(f"`{self.features}` was computed with a different model than `{self.model}`")
            n = cut.train_last_blocks
        else:
            if self.train_last_blocks is None:
                raise StageError("single_stage needs train_last_blocks (the number of top blocks to train)")
            n = self.train_last_blocks
        check_cut(n, model)
        return n

    def _top_input_shape(self, inputs: Mapping[str, Spec], net: BlockNet, n: int) -> tuple[int, int, int]:
        """(C, H, W) at the cut: the cached features' shape, or the bottom's output for the images."""
        if self.mode == "two_stage":
            cut = inputs["features"].cut
            assert cut is not None  # checked by _cut
            return cut.feature_shape
        x = inputs["images"].split("train", stage=self.type_name).fields.get("x")
        if x is None or len(x.shape) != 3:
            raise StageError(f"`images: {self.images}` must carry image tensors 'x' of shape (C,H,W), "
                             f"found {x}")
        return zoo.feature_shape(net, n, int(x.shape[-1]))

    def prepare(self, net: BlockNet, n: int, num_classes: int,
                top_input_shape: tuple[int, int, int]) -> tuple[torch.nn.Module, TopNet, Adapted]:
        """(frozen bottom, top made trainable by ``method``, what the method did), from a fresh ``net``."""
        zoo.replace_classifier(net, num_classes)
        bottom, top = zoo.split_at(net, n)
        for p in bottom.parameters():
            p.requires_grad_(False)
        adapted = apply_method(self.method, net.arch, list(net.blocks), top, n, top_input_shape)
        return bottom, top, adapted

    def model_notes(self, specs: dict[str, Spec]) -> dict[str, Any]:
        """How the model file's weights were trained, for its description."""
        cut = specs["features"].cut if self.mode == "two_stage" else None
        return {"mode": self.mode, "trained_on_features_from": f"{cut.precision} bottom" if cut else "images"}

    def _footprint(self, bottom: torch.nn.Module, top: TopNet, adapted: Adapted, num_classes: int,
                   top_input_shape: tuple[int, int, int], measure: bool,
                   convention: str = "mask") -> Footprint:
        frozen = 0
        if self.mode == "single_stage":  # the frozen bottom's weights sit in memory too
            frozen = sum(t.numel() * t.element_size() for t in [*bottom.parameters(), *bottom.buffers()])
        return memory.footprint(top, (self.batch_size, *top_input_shape), num_classes=num_classes,
                         optimizer=self.train.optimizer, momentum=self.train.momentum, measure=measure,
                         frozen_bytes=frozen, label=f"{adapted.method}, {self.mode}", seed=self.seed,
                         convention=convention)

    def footprint_from_specs(self, specs: dict[str, Spec], ctx: RunContext, *,
                             measure: bool = True, convention: str = "mask") -> Footprint:
        """The training-memory footprint of this trainer from resolved specs (random weights: memory
        does not depend on their values). Used by ``pipeline.memory_report``."""
        refs = self.input_refs()
        inputs = {field: specs[ref] for field, ref in refs.items()}
        n = self._cut(inputs)  # resolving checked the features' model
        data = inputs["features" if self.mode == "two_stage" else "images"]
        net = seeded_net(ArchConfig.of(inputs["model"]), self.seed)
        shape = self._top_input_shape(inputs, net, n)
        bottom, top, adapted = self.prepare(net, n, data.num_classes, shape)
        top.to(ctx.torch_device)  # metered where it trains: on CUDA the allocator's peak is read too
        fp = self._footprint(bottom, top, adapted, data.num_classes, shape, measure, convention)
        fp.extra.update({"train_last_blocks": n, "method_details": adapted.details})
        return fp

    # --- warm start (init, replay): pipeline.methods.warm_start ------------------------------------
    def fingerprint_config(self) -> dict[str, Any]:
        """``init`` is identified by the model file's content (``identity``), not by where it is: the same
        model given by its path or by its stored result's fingerprint trains the same entry."""
        config = super().fingerprint_config()
        config.pop("init", None)
        return config

    def identity(self, ctx: RunContext) -> str | None:
        if self.init is None:
            return None
        from ..models.weights import file_sha256

        return f"init-model:{file_sha256(self._init_source(ctx).path)}"

    def _init_source(self, ctx: RunContext | None) -> InitSource:
        assert self.init is not None
        return locate_init(self.init, ctx.catalog if ctx is not None else None)

    def _class_names(self, data: Spec) -> list[str]:
        names = data.class_names
        if names is None or len(names) != data.num_classes:
            return [str(i) for i in range(data.num_classes)]
        return [str(n) for n in names]

    def _init_plan(self, description: Mapping[str, Any], source: InitSource, inputs: Mapping[str, Spec],
                   n: int, net: BlockNet) -> ClassPlan:
        """How the init model fits this stage (InitError, naming both, where it does not)."""
        data = inputs["features" if self.mode == "two_stage" else "images"]
        return plan_init(description, source, model=inputs["model"].model, model_name=self.model,
                         train_last_blocks=n, top_input_shape=self._top_input_shape(inputs, net, n),
                         resolution=data.resolution, method=self.method.model_dump(mode="json"),
                         class_names=self._class_names(data), head=type(zoo.final_layer(net)[1]))

    def _check_replay(self) -> None:
        if self.replay is None:
            return
        if self.init is None:
            raise StageError(f"replay: {self.replay} mixes earlier samples into each batch of new ones; "
                             "it needs init: (the model trained on the earlier ones): set init, or remove "
                             "replay")
        earlier = int(round(self.replay * self.batch_size))
        if earlier >= self.batch_size or (self.replay > 0 and earlier == 0):
            raise StageError(f"replay: {self.replay} of batch_size {self.batch_size} is {earlier} earlier "
                             "samples per batch, which leaves "
                             + ("no new one" if earlier >= self.batch_size else "the share at zero")
                             + ": choose a replay share or a batch_size that leaves both kinds in each batch")

    def plan_note(self, call: StageCall) -> str | None:
        if self.init is None:
            return None
        replay = f", replay {self.replay:g}" if self.replay is not None else ""
        distill = f", distill {self.distill:g}" if self.distill is not None else ""
        return f"warm start from {self.init}{replay}{distill}"

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        n = self._cut(inputs, inputs.parent("model"))
        self._check_replay()
        if self.distill is not None and self.init is None:
            raise StageError(f"distill: {self.distill:g} keeps the scores of the model init names; it needs "
                             "init: (the model trained before): set init, or remove distill")
        if self.init is not None:
            source = self._init_source(ctx)
            _state, description = read_init(source)
            self._init_plan(description, source, inputs, n, structure(ArchConfig.of(inputs["model"])))
        if self.method != DEFAULT_METHOD:
            # check_method only reads the blocks' structure
            blocks = list(structure(ArchConfig.of(inputs["model"])).blocks)
            check_method(self.method, inputs["model"].model.arch, blocks, n)
        data = inputs["features" if self.mode == "two_stage" else "images"]
        for split in ("train", "val"):
            data.split(split, stage=self.type_name)
        check_precision(self.precision, ctx.torch_device)
        check_cuda_graph(self.train.cuda_graph, ctx.torch_device, self.precision, self.train.optimizer)
        return Spec(RESULT, data.num_classes, meta={"mode": self.mode})

    @property
    def precision(self) -> str:
        """The training precision (``train.precision``; ``finetune_mixed`` sets its own)."""
        return self.train.precision

    def result_extras(self, call: StageCall) -> dict[str, Any]:
        """Metrics a subclass adds to the stored result."""
        return {}

    def build(
        self, ctx: RunContext, inputs: dict[str, Any], staging: Path, call: StageCall
    ) -> dict[str, Any]:
        """Train into ``staging`` (a store entry keyed by this stage's fingerprint): ``best.pt`` and
        ``result.json`` (with ``build.json``, its build's times) are kept; ``last.pt`` lets a killed
        build continue from its last epoch."""
        metrics = self._train(ctx, inputs, call, staging)
        metrics.update(self.result_extras(call))
        (staging / CHECKPOINT_FILE).unlink(missing_ok=True)  # the entry is the result; resume is over
        for stray in staging.glob(".*.tmp"):  # a weights write a kill interrupted: never data
            stray.unlink()
        build_record.write(staging, RESULT_FILE, metrics)  # times etc. apart: the result is content
        return {"accuracy": metrics["accuracy"], "mode": self.mode}

    def load(self, ctx: RunContext, entry: Entry, call: StageCall) -> dict[str, Any]:
        """The stored result (an identical rerun does not retrain); its weights are copied to the run dir."""
        path = Path(entry.path)
        try:
            metrics: dict[str, Any] = build_record.read(path, RESULT_FILE)
        except (OSError, ValueError) as exc:
            raise ModelError(f"stage {call.name!r}: cannot read the stored training result in {path}: "
                             f"{exc}; remove the entry (`python -m pipeline cache rm "
                             f"{entry.fingerprint[:12]}`) to train again") from None
        out_dir = ctx.stage_dir(call.name)
        if out_dir is not None:
            for file in (BEST_FILE, MODEL_FILE):
                if (path / file).is_file():
                    shutil.copyfile(path / file, out_dir / file)
            if (out_dir / MODEL_FILE).is_file():
                metrics["model_file"] = str(out_dir / MODEL_FILE)
        return metrics

    def _train(
        self, ctx: RunContext, inputs: dict[str, Any], call: StageCall, out_dir: Path
    ) -> dict[str, Any]:
        name = call.name
        model_value: ModelValue = inputs["model"]
        stream: Stream = inputs["features" if self.mode == "two_stage" else "images"]
        specs = dict(call.inputs)
        n = self._cut(specs)  # resolving checked the features' model
        net = model_value.build(seed=self.seed)  # as if seeded, then constructed
        shape = self._top_input_shape(specs, net, n)
        bottom, top, adapted = self.prepare(net, n, stream.spec.num_classes, shape)
        update = self._warm_start(ctx, name, specs, n, net, bottom, top) if self.init is not None else None
        trained = top if self.mode == "two_stage" else zoo.FrozenBottomNet(bottom, top)
        device = ctx.torch_device
        trained.to(device)
        fp = None
        if self.memory_report:
            try:
                fp = self._footprint(bottom, top, adapted, stream.spec.num_classes, shape, measure=True)
                ctx.progress.log(f"[{name}] {fp.summary()}")
            except (RuntimeError, ValueError) as exc:  # e.g. train-mode BN on a batch of one 1x1 map
                ctx.progress.log(f"[{name}] memory meter skipped: {exc}")

        cfg = self.train if self.precision == self.train.precision else \
            self.train.model_copy(update={"precision": self.precision})
        # A step captured as a CUDA graph can decode the stored codes itself: the training batches then
        # stay coded (and resident on the GPU) up to the step, and the decoding is captured with it.
        replay = self._replay(ctx, stream, update, name) if update is not None else None
        # (replay mixes decoded batches: the coded path is for plain epochs)
        coded = (replay is None and self.mode == "two_stage" and cfg.cuda_graph != "off"
                 and hasattr(stream, "open_coded")
                 and graph_refusal(device, cfg.precision, cfg.optimizer) is None)

        def train_batches(epoch: int) -> Iterator[tuple[Any, torch.Tensor]]:
            if coded:
                stored = stream.open_coded("train", epoch=epoch, shuffle=True, seed=self.seed)  # type: ignore[attr-defined]
                return (({k: v for k, v in b.items() if k != "y"}, b["y"])
                        for b in rechunk(stored, self.batch_size))
            batches = stream.open("train", epoch=epoch, shuffle=True, seed=self.seed)
            if replay is not None:
                return replay.batches(xy(rechunk(batches, self.batch_size)), epoch)
            return xy(rechunk(batches, self.batch_size))

        def eval_batches(split: str = "val") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            return xy(rechunk(stream.open(split), self.eval_batch_size))

        def on_epoch(record: dict[str, Any]) -> None:
            ctx.metrics_log({"stage": name, "mode": self.mode, **record})
            ctx.progress.log(
                f"[{name}] epoch {record['epoch']}: loss {record['train_loss']:.3f} "
                f"val acc {record['val_acc']:.3f} ({record['epoch_seconds']:.2f}s)"
            )

        test_split = "test" if "test" in stream.spec.splits else "val"
        num_classes = stream.spec.num_classes
        if update is not None:  # what the init model itself gets right on the classes it knew
            known = update.plan.old
            update.extra["init_accuracy_old_classes"] = accuracy_of(class_tallies(
                keep_columns(trained, known), of_classes(eval_batches(test_split), known), num_classes,
                precision=self.precision), known)
        params = [p for p in trained.parameters() if p.requires_grad]
        steps = -(-stream.spec.splits["train"].num_samples // self.batch_size)
        if replay is not None:
            steps = replay.steps()
        offsets = replay.prior_offsets(num_classes) if replay is not None else None
        # The teacher is copied before the offsets' hook is added (it is evaluated plain) and before training.
        distill = None
        if update is not None and self.distill is not None:
            distill = Distillation.of(trained, update.plan.old, self.distill, cross_entropy(cfg))
            update.extra["distill"] = {"weight": self.distill, "temperature": DISTILL_TEMPERATURE}
            ctx.progress.log(f"[{name}] distilling init's scores on {len(update.plan.old)} known classes "
                             f"(weight {self.distill:g}, temperature {DISTILL_TEMPERATURE:g})")
        corrected = prior_correction(top, offsets) if offsets is not None else None
        try:
            result = train(trained, params, train_batches, eval_batches, cfg, checkpoint_dir=out_dir,
                           on_epoch=on_epoch, steps_per_epoch=steps, read_ahead=self.prefetch,
                           resume_key=call.fingerprint, bars=ctx.progress, label=name,
                           batch_size=self.batch_size, batch_setting=f"stages.{name}.batch_size",
                           log=lambda m: ctx.progress.log(f"[{name}] {m}"),
                           prepare=stream.decode_coded if coded else None,  # type: ignore[attr-defined]
                           loss=distill)
        finally:
            if corrected is not None:
                corrected.remove()  # evaluated and saved as the plain network
        # Report the test accuracy of the checkpoint chosen on validation data.
        state, _ = load_weights(out_dir / BEST_FILE)
        trained.load_state_dict(state)
        try:
            if update is None:
                _, test_acc, test_n = evaluate(trained, eval_batches(test_split), precision=self.precision)
            else:  # the same predictions, tallied per class: the known and the new classes apart, one pass
                tallies = class_tallies(trained, eval_batches(test_split), num_classes,
                                        precision=self.precision)
                test_n = int(tallies[1].sum())
                test_acc = accuracy_of(tallies, range(num_classes)) or 0.0
                update.extra["accuracy_old_classes"] = accuracy_of(tallies, update.plan.old)
                update.extra["accuracy_new_classes"] = accuracy_of(tallies, update.plan.added)
                if test_n == 0:
                    raise DataError("evaluation batches yielded no samples (is the evaluation split empty?)")
        except torch.OutOfMemoryError as exc:
            raise out_of_memory(exc, stage=name, batch_size=self.eval_batch_size, device=device,
                                setting=f"stages.{name}.eval_batch_size",
                                during="the test evaluation",
                                resumes="A rerun continues from the last finished epoch") from None
        # The whole network (frozen bottom + trained top) with the description it is rebuilt from, kept
        # in the entry beside best.pt, so a reused result gives its model file too.
        save_transfer_model(ctx, call, bottom=bottom, top=top, arch=model_value.config, train_last_blocks=n,
                            top_input_shape=shape, method=self.method, resolution=stream.spec.resolution,
                            data_field="features" if self.mode == "two_stage" else "images",
                            notes=self._notes(specs, update), directory=out_dir)
        epoch_times = [h["epoch_seconds"] for h in result.history]
        quantization = specs["features"].quantization if self.mode == "two_stage" else None
        metrics = {
            "accuracy": test_acc,
            "test_split": test_split,
            "test_samples": test_n,
            "best_val_accuracy": result.best_val_acc,
            "best_epoch": result.best_epoch,
            "epoch_seconds": sum(epoch_times) / len(epoch_times),
            # The first epoch pays one-off costs (allocations, file cache): report the rest too.
            "epoch_seconds_steady": (sum(epoch_times[1:]) / (len(epoch_times) - 1)) if len(epoch_times) > 1
            else epoch_times[0],
            "epoch_seconds_all": epoch_times,
            "train_loss_all": [h["train_loss"] for h in result.history],
            "val_accuracy_all": [h.get("val_acc") for h in result.history],
            "val_loss_all": [h.get("val_loss") for h in result.history],  # breaks ties of val accuracy
            "cache_bytes": stream.stored_bytes() if self.mode == "two_stage" else 0,
            "bits": quantization.bits if quantization is not None else 32,
            "mode": self.mode,
            "train_last_blocks": n,
            "top_input_shape": list(shape),
            "trainable_parameters": sum(p.numel() for p in params),
            "method": adapted.method,
            "precision": self.precision,
            "device": str(device),
            "cuda_graph": result.cuda_graph,
            "resumed_after_epochs": result.resumed_from or 0,
            **(fp.metrics() if fp is not None else {}),
            "epochs": self.train.epochs,
            # What the entry keeps: the resume checkpoint (removed at commit) holds the epochs' times,
            # so its size varies from build to build and would make the result's bytes vary too.
            "bytes_written": sum(f.stat().st_size for f in out_dir.glob("*.pt") if f.name != CHECKPOINT_FILE),
        }
        if update is not None:
            metrics.update(update.metrics())
        return metrics

    def _notes(self, specs: dict[str, Spec], update: UpdateReport | None) -> dict[str, Any]:
        notes = self.model_notes(specs)
        if update is not None:  # what the model file was warm-started from (only then: same bytes as before)
            distill = {"distill": self.distill} if self.distill is not None else {}
            notes = {**notes, "warm_start": {"init_model_sha256": update.sha256, **update.plan.summary(),
                                             "replay": self.replay, **distill}}
        return notes

    def _warm_start(self, ctx: RunContext, name: str, specs: Mapping[str, Spec], n: int, net: BlockNet,
                    bottom: torch.nn.Module, top: TopNet) -> UpdateReport:
        """Load the init model into the fresh network (``warm_start``), checked as resolving checked it."""
        from ..models.weights import file_sha256, state_dict_hash

        source = self._init_source(ctx)
        sha = file_sha256(source.path)
        state, description = read_init(source)
        plan = self._init_plan(description, source, specs, n, net)
        warm_start(bottom, top, state, plan, source, self.model)
        start = {**{f"bottom.{k}": v for k, v in bottom.state_dict().items()},
                 **{f"top.{k}": v for k, v in top.state_dict().items()}}
        added = ", ".join(plan.names[i] for i in plan.added)
        ctx.progress.log(f"[{name}] warm start from {source.describe()}: {len(plan.kept)} classes kept"
                         + (f", {len(plan.added)} added ({added})" if added else ""))
        return UpdateReport(source, sha, plan, start_state_sha256=state_dict_hash(start))

    def _replay(self, ctx: RunContext, stream: Stream, update: UpdateReport, name: str) -> Replay | None:
        """The replay mix (None: no replay asked, or no new class to set apart from earlier samples)."""
        if self.replay is None:
            return None
        if not update.plan.added:
            ctx.progress.log(f"[{name}] replay: every class was in init's training data, so no sample is "
                             "new; training on every sample")
            return None
        counts = count_classes(xy(rechunk(stream.open("train"), self.eval_batch_size)), update.plan.old)
        if counts[0] == 0 and self.replay > 0:
            known = ", ".join(update.plan.names[i] for i in update.plan.old)
            raise InitError(f"replay: the training data has no sample of the classes init knew ({known}): "
                            "nothing to replay; remove replay, or keep those classes in the data")
        update.replay = Replay(self.replay, self.batch_size, update.plan.old, self.seed, counts)
        r = update.replay
        offsets = r.prior_offsets(len(update.plan.names))
        note = ""
        if offsets is not None:
            earlier, new = float(offsets[update.plan.old[0]]), float(offsets[update.plan.added[0]])
            update.extra["replay_prior_offsets"] = {"earlier": earlier, "new": new}
            note = f"; class scores offset by {earlier:+.3f} (earlier), {new:+.3f} (new) while training"
        ctx.progress.log(f"[{name}] replay: {counts[1]} new and {counts[0]} earlier samples; each batch "
                         f"{r.new_per_batch} new + {r.old_per_batch} earlier, {r.steps()} steps per epoch"
                         + note)
        return r

