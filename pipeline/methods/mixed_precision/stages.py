"""Recipe stages of mixed-precision partitioning: the cut search, and a bf16 trainer for the top.

``partition_search`` (cacheable, like ``pretrain``): fake-quantization robustness
exploration with NSGA-II on the pretrained model's own task, which bounds the cuts whose
bottom can run int8 within δ; then, given the transfer's images (``target:``), the
transfer probe retrains the top above each of those cuts and picks the one with the best
target validation accuracy (``transfer.py`` says why the source task alone cannot: there
int8 is nearly free at every layer, so the last cut always wins).
The result (cut layer, per-layer precision, Pareto front, per-cut scores, cost) is a
stored, content-addressed JSON artifact, so any recipe with the same model, data and
settings reuses it instead of searching again.

``finetune_mixed``: the ``finetune`` stage with the top trained in bfloat16. Policy:
fp32 master weights and optimizer state, bf16 compute through autocast on the run's
device, CPU or CUDA (matmuls and convolutions in bf16, reductions and the loss in fp32):
the trainer's ``bf16`` precision (``pipeline.methods.amp``), entered per step so the
autocast cache of bf16 weight copies never outlives an optimizer step. The int8 bottom is not part
of this stage: it runs in ``frozen_forward`` with ``precision: int8`` and reaches the
top through the feature cache, which is how mixed precision and Cache & Reuse combine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from ...errors import ModelError, StageError
from ...lazy import lazy_module, require
from ...models.arch import ArchConfig, ModelValue, structure
from ...recipe_model import RecipeModel
from ...spec import MODEL, RESULT, STREAM, Spec
from ...stage import Stage, StageCall, StageInputs
from .. import build_record
from ..amp import check_precision
from ..finetune import Finetune
from ..trainer import TrainConfig
from .search import SearchConfig, nsga2, robustness

if TYPE_CHECKING:
    import torch

    from stores.catalog import Entry

    from ...context import RunContext
    from ...models import zoo
    from . import fakequant, graph, transfer
else:
    torch = lazy_module("torch")
    zoo = lazy_module("pipeline.models.zoo")
    fakequant = lazy_module("pipeline.methods.mixed_precision.fakequant")
    graph = lazy_module("pipeline.methods.mixed_precision.graph")
    transfer = lazy_module("pipeline.methods.mixed_precision.transfer")

PARTITION_FILE = "partition.json"


class Partition(Mapping[str, Any]):
    """The stored search result, read-only. A Mapping rather than a dict on purpose: the run report
    treats dict-valued results as trainer metrics (accuracy, epoch time), which a search result is not."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def summary(self) -> str:
        probe: dict[str, Any] = self.get("probe") or {}
        tlb = self["train_last_blocks"]
        picked = next((r for r in probe["cuts"] if r["train_last_blocks"] == tlb), None) if probe else None
        scored = (f"target val acc {picked['score']:.3f} vs best {probe['best_score']:.3f} over "
                  f"{len(probe['cuts'])} cuts; ") if picked is not None else ""
        return (f"cut after {self['cut_layer']} ({self['quantized_layers']}/{len(self['layers'])} layers "
                f"int8, train_last_blocks {self['train_last_blocks']}): {scored}"
                f"source acc {self['selected']['accuracy']:.3f} vs best {self['best_accuracy']:.3f}, "
                f"float {self['float_accuracy']:.3f}; "
                f"{self['evaluations']} evaluations in {self['seconds']:.0f}s")


def candidate_cuts(lg: graph.LayerGraph, granularity: str) -> dict[int, graph.CutPoint]:
    """Layers below -> the highest valid cut with exactly those layers below (block boundaries only
    for ``granularity == "block"``, so the chosen cut can run as ``frozen_forward``)."""
    cuts: dict[int, graph.CutPoint] = {}
    for cut in lg.cut_points():
        if granularity == "block" and cut.train_last_blocks is None:
            continue
        cuts[len(cut.layers_below)] = cut  # later cuts (higher in the order) replace earlier ones
    return cuts


class ProbeConfig(RecipeModel):
    """How the transfer probe retrains the top above each cut: the transfer's own settings (a recipe
    shares ``train`` with its finetune stages through a YAML anchor), at the top's precision."""

    batch_size: int = Field(32, ge=1)
    eval_batch_size: int = Field(256, ge=1)
    precision: Literal["bf16", "fp32"] = Field("bf16", description="the top's precision (finetune_mixed)")
    train: TrainConfig = TrainConfig(epochs=10)
    # Not the search's δ: a tolerance on a score measured on a few hundred validation images puts the pick
    # at its edge, below the best by up to the tolerance before the score's own noise (docs/methods.md).
    delta: float = Field(0.0, ge=0.0, lt=1.0, description="the highest cut whose probe score is within this "
                         "relative tolerance of the best (0: the best-scoring cut, ties to the higher cut)")


class PartitionSearch(Stage):
    """Find the mixed-precision cut: NSGA-II over per-layer bits (fake quantization) bounds the cuts
    whose bottom runs int8; the transfer probe (``target:``) scores them; then the δ rule."""

    type_name: ClassVar[str] = "partition_search"
    # 2: the transfer probe (``target:``), per-cut source int8 accuracy in ``cuts``, ``seconds`` = total,
    # times in build.json beside partition.json; 3: the probe's pick by its own tolerance (probe.delta)
    # 4: the probe's batch norms keep the running statistics their kernel computes (finetune@3)
    version: ClassVar[int] = 4
    kind: ClassVar[str] = RESULT
    inputs: ClassVar[dict[str, str]] = {"model": MODEL, "input": STREAM, "target": STREAM}
    cacheable: ClassVar[bool] = True
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"batch_size"})

    model: str = Field(..., description="the pretrained model, with the classifier of its own task")
    input: str = Field(..., description="decoded images of the model's own classes (calibration, eval)")
    target: str | None = Field(
        None, description="decoded images of the transfer task (train, val): each int8-feasible cut is "
        "scored by retraining the top above it (the transfer probe); without it the highest such cut wins")
    probe: ProbeConfig = ProbeConfig()
    bits: tuple[int, ...] = (4, 6, 8, 16)
    initial_bits: tuple[int, ...] = (8, 16)
    population: int = Field(32, ge=4)
    generations: int = Field(20, ge=1)
    min_samples: int = Field(64, ge=1, description="validation samples in the first generation")
    max_samples: int = Field(512, ge=1, description="validation samples in the last generation and the front")
    delta: float = Field(0.01, ge=0.0, lt=1.0, description="relative accuracy tolerance of Definition 7")
    calibration_samples: int = Field(256, ge=1, description="samples that set activation ranges")
    calibration_split: str = "train"
    eval_split: str = "val"
    cut_granularity: Literal["block", "layer"] = Field(
        "block", description="block: only cuts frozen_forward can run; layer: every single-tensor cut")
    batch_size: int = Field(256, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check_bits(self) -> PartitionSearch:
        if not self.bits or any(not 2 <= b <= 16 for b in self.bits) or len(set(self.bits)) != len(self.bits):
            raise ValueError(f"bits must be distinct widths in 2..16, found {list(self.bits)}")
        if not set(self.initial_bits) <= set(self.bits):
            raise ValueError(f"initial_bits {list(self.initial_bits)} must be a subset of bits "
                             f"{list(self.bits)}")
        if self.min_samples > self.max_samples:
            raise ValueError(f"min_samples ({self.min_samples}) must not exceed max_samples "
                             f"({self.max_samples})")
        return self

    def _config(self) -> SearchConfig:
        return SearchConfig(bits=tuple(sorted(self.bits)), initial_bits=tuple(self.initial_bits),
                            population=self.population, generations=self.generations,
                            min_samples=self.min_samples, max_samples=self.max_samples, delta=self.delta,
                            seed=self.seed)

    def _graph(self, model: Spec) -> graph.LayerGraph:
        return graph.layer_graph(structure(ArchConfig.of(model)))

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        require("pymoo")  # the search's NSGA-II; an extra ("search"), so checked before any work
        data, model = inputs["input"], inputs["model"]
        for split in {self.calibration_split, self.eval_split}:
            field = data.split(split, stage=self.type_name).fields.get("x")
            if field is None or len(field.shape) != 3:
                raise StageError(f"expected decoded images 'x' of shape (C,H,W) in split {split!r} of "
                                 f"`{self.input}`, found {field}")
        if data.num_classes != model.num_classes:
            raise StageError(f"the search measures `{self.model}` on its own task, so `{self.input}` must "
                             f"have its {model.num_classes} classes; found {data.num_classes} (use images of "
                             "the classes the model was pretrained on, not the transfer target's)")
        if self.target is not None:
            target = inputs["target"]
            for split in ("train", "val"):
                field = target.split(split, stage=self.type_name).fields.get("x")
                if field is None or len(field.shape) != 3:
                    raise StageError(f"the transfer probe expected decoded images 'x' of shape (C,H,W) in "
                                     f"split {split!r} of `target: {self.target}`, found {field}")
            if self.cut_granularity != "block":
                raise StageError("`target:` scores each cut by retraining the blocks above it, which needs "
                                 "cut_granularity: block (found layer); drop `target:` to search layer cuts "
                                 "by quantization alone")
            check_precision(self.probe.precision, ctx.torch_device, where="probe.precision")
        lg = self._graph(model)  # fails here, before any work, if the model cannot be traced
        cuts = candidate_cuts(lg, self.cut_granularity)
        if not cuts:
            raise StageError(f"{model.model.arch} has no valid {self.cut_granularity} cut below its "
                             "classifier")
        return Spec(RESULT, model.num_classes, meta={"arch": model.model.arch, "candidate_cuts": len(cuts),
                                                     "layers": len(lg.layers)})

    def _images(self, stream: Any, split: str, n: int, shuffle: bool,
                ref: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys, have = [], [], 0
        batches = stream.open(split, shuffle=shuffle, seed=self.seed)
        try:
            for batch in batches:
                xs.append(batch["x"])
                ys.append(batch["y"])
                have += len(batch["y"])
                if have >= n:
                    break
        finally:
            batches.close()
        if not xs:
            raise StageError(f"split {split!r} of `{ref or self.input}` is empty")
        return torch.cat(xs)[:n], torch.cat(ys)[:n]

    def build(
        self, ctx: RunContext, inputs: dict[str, Any], staging: Path, call: StageCall
    ) -> dict[str, Any]:
        name = call.name
        model_value: ModelValue = inputs["model"]
        net = model_value.build(seed=self.seed).eval()  # as if seeded, then constructed
        lg = graph.layer_graph(net)  # traced on the CPU, before the network moves to the device
        cuts = candidate_cuts(lg, self.cut_granularity)
        layers = [layer for layer in lg.layers if layer != lg.classifier]
        calib_x, _ = self._images(inputs["input"], self.calibration_split, self.calibration_samples, False)
        x, y = self._images(inputs["input"], self.eval_split, self.max_samples, True)
        # Fake quantization runs where the run does (its weights and the evaluation images moved once):
        # every one of the search's evaluations is a forward pass on the device.
        device = ctx.torch_device
        net.to(device)
        x, y = x.to(device), y.to(device)
        if len(x) < self.max_samples:
            ctx.progress.log(f"[{name}] {self.eval_split} has only {len(x)} samples (max_samples "
                             f"{self.max_samples}); using all of them")
        cfg = self._config()
        cfg = SearchConfig(**{**cfg.__dict__, "max_samples": len(x),
                              "min_samples": min(cfg.min_samples, len(x))})
        fq = fakequant.FakeQuantModel(net, layers, calib_x.split(self.batch_size))

        def evaluate(bits: tuple[int, ...], samples: int) -> float:
            fq.set_scheme(dict(zip(layers, bits, strict=True)))
            return fq.accuracy(x[:samples], y[:samples], self.batch_size)

        fq.set_scheme({})
        float_accuracy = fq.accuracy(x, y, self.batch_size)
        result = nsga2(evaluate, len(layers), sorted(cuts), cfg,
                       log=lambda m: ctx.progress.log(f"[{name}] {m}"))
        sel = result.selected
        # What the quantization search sees of each cut: the source accuracy with its bottom at int8. It
        # is kept to show the signal (flat where int8 is nearly free), not used: the front decides.
        source_int8 = {}
        for n in sorted(cuts):
            fq.set_scheme({layer: cfg.int_bits for layer in layers[:n]})
            source_int8[n] = fq.accuracy(x, y, self.batch_size)
        chosen = sel.quantized_layers
        probe = None
        if self.target is not None and chosen > 0:
            feasible = [(n, c) for n, c in sorted(cuts.items()) if n <= chosen]
            probe = self._probe(ctx, name, inputs, model_value, fq, layers, feasible, cfg.int_bits)
            chosen = probe["selected"]["layers_below"]
        elif self.target is None:
            ctx.progress.log(f"[{name}] no `target:`: the cut is the highest whose bottom runs int8 within "
                             "δ; what freezing it costs the transfer is not measured")
        cut = cuts.get(chosen)
        payload = {
            "arch": getattr(net, "arch", type(net).__name__), "layers": layers, "classifier": lg.classifier,
            "num_blocks": lg.num_blocks, "delta": self.delta, "cut_granularity": self.cut_granularity,
            "float_accuracy": float_accuracy, "eval_samples": len(x),
            "cuts": [{"node": c.node, "layer": c.layer, "layers_below": n,
                      "train_last_blocks": c.train_last_blocks, "source_accuracy_int8": source_int8[n],
                      "int8_within_delta": n <= sel.quantized_layers} for n, c in sorted(cuts.items())],
            "cut_layer": cut.layer if cut else None, "cut_node": cut.node if cut else None,
            # no cut within δ: nothing runs as int8 and every block trains
            "train_last_blocks": cut.train_last_blocks if cut else lg.num_blocks,
            "quantized_layers": chosen,
            # the highest cut the quantization search alone allows (its choice without a probe)
            "int8_quantized_layers": sel.quantized_layers,
            "precision": {layer: (f"int{b}" if i < chosen else "bf16")
                          for i, (layer, b) in enumerate(zip(layers, sel.bits, strict=True))},
            "robustness": robustness(result.front, layers, self.delta, cfg.bits),
            "search": {"population": cfg.population, "generations": cfg.generations, "bits": list(cfg.bits),
                       "min_samples": cfg.min_samples, "max_samples": cfg.max_samples},
            **result.to_dict(),
            "quantization_seconds": result.seconds,
            "probe": probe,
            "seconds": result.seconds + (probe["seconds"] if probe else 0.0),
        }
        # the times apart (build.json): the content is the same whichever build made it
        build_record.write(staging, PARTITION_FILE, payload)
        return {"cut_layer": payload["cut_layer"], "train_last_blocks": payload["train_last_blocks"],
                "evaluations": result.evaluations}

    def _probe(self, ctx: RunContext, name: str, inputs: dict[str, Any], model_value: ModelValue,
               fq: fakequant.FakeQuantModel, layers: list[str], feasible: list[tuple[int, graph.CutPoint]],
               int_bits: int) -> dict[str, Any]:
        """The transfer probe over ``feasible`` cuts, and Definition 7 on its scores (``transfer.py``)."""
        stream = inputs["target"]
        splits = stream.spec.splits
        data = {split: transfer.Labelled(*self._images(stream, split, splits[split].num_samples, False,
                                                       ref=self.target))
                for split in ("train", "val")}
        blocks = list(fq.model.get_submodule("blocks").children())  # a BlockNet: block cuts only
        below = {c.train_last_blocks: n for n, c in feasible}

        def make(tlb: int) -> tuple[torch.nn.Module, torch.nn.Module]:
            # the bottom as deployed: the pretrained blocks below the cut, every layer at int_bits
            fq.set_scheme({layer: int_bits for layer in layers[:below[tlb]]})
            bottom = torch.nn.Sequential(*blocks[:len(blocks) - tlb])
            net = model_value.build(seed=self.seed)  # as the finetune stage builds its top
            zoo.replace_classifier(net, stream.spec.num_classes)
            return bottom, zoo.split_at(net, tlb)[1]

        cfg = self.probe.train.model_copy(update={"precision": self.probe.precision})
        start = time.perf_counter()
        records = transfer.probe_cuts(
            [(n, c.train_last_blocks, c.layer) for n, c in feasible if c.train_last_blocks is not None], make,
            data["train"], data["val"], cfg, batch_size=self.probe.batch_size, seed=self.seed,
            device=ctx.torch_device, eval_batch_size=self.probe.eval_batch_size, bars=ctx.progress,
            log=lambda m: ctx.progress.log(f"[{name}] {m}"))
        fq.set_scheme({})
        picked = transfer.select_cut(records, self.probe.delta)
        return {"cuts": records, "best_score": max(r["score"] for r in records),
                "selected": {k: picked[k] for k in ("layers_below", "train_last_blocks", "cut_layer",
                                                    "score")},
                "delta": self.probe.delta, "epochs": cfg.epochs, "precision": cfg.precision,
                "batch_size": self.probe.batch_size,
                "train_samples": len(data["train"]), "val_samples": len(data["val"]),
                "seconds": time.perf_counter() - start}

    def load(self, ctx: RunContext, entry: Entry, call: StageCall) -> Partition:
        path = Path(entry.path) / PARTITION_FILE
        try:
            partition = Partition(build_record.read(Path(entry.path), PARTITION_FILE))
        except (OSError, ValueError) as exc:
            raise ModelError(f"stage {call.name!r}: cannot read the stored partition {path}: {exc}") from None
        ctx.progress.log(f"[{call.name}] {partition.summary()}")
        return partition


class FinetuneMixed(Finetune):
    """``finetune`` with the top in bf16 (fp32 master weights + autocast); fp32 = plain finetune."""

    type_name: ClassVar[str] = "finetune_mixed"
    inputs: ClassVar[dict[str, str]] = {"model": MODEL, "images": STREAM, "features": STREAM}

    top_precision: Literal["bf16", "fp32"] = "bf16"

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        spec = super().resolve(inputs, ctx)
        return Spec(RESULT, spec.num_classes, meta={**spec.meta, "top_precision": self.top_precision})

    def model_notes(self, specs: dict[str, Spec]) -> dict[str, Any]:
        # The model file holds the fp32 master weights; this top trained and was evaluated in bf16.
        return {**super().model_notes(specs), "top_precision": self.top_precision, "weights": "fp32 master"}

    @property
    def precision(self) -> str:
        return "bf16" if self.top_precision == "bf16" else self.train.precision

    def result_extras(self, call: StageCall) -> dict[str, Any]:
        cut = call.inputs["features"].cut if self.mode == "two_stage" else None
        bottom = (cut.precision if cut is not None else "fp32") if self.mode == "two_stage" else None
        return {"top_precision": self.top_precision, "master_weights": "fp32",
                "bottom_precision": bottom or self.top_precision}
