"""Pretrain a backbone on source classes and keep it as a content-addressed artifact.

Pretrained ImageNet weights cannot be downloaded on many devices (and not here), so
the toolkit makes its own "pretrained" backbone: train on the source classes, store
the weights in the catalog, and let every later recipe with the same data and
settings reuse them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from ..data.decode import Decoder, InputAugment
from ..data.stream import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig, DatasetStream, placement
from ..deploy.model_file import save_backbone_model
from ..lazy import lazy_module
from ..models.arch import ArchConfig, ModelValue
from ..models.weights import load_weights, save_weights
from ..ops.batching import rechunk, xy
from ..spec import DATASET, MODEL, Spec
from ..stage import Stage, StageCall, StageInputs
from .amp import check_precision
from .graphed import check_cuda_graph
from .trainer import TrainConfig, train

if TYPE_CHECKING:
    import torch

    from stores.catalog import Entry

    from ..context import RunContext
else:
    torch = lazy_module("torch")

WEIGHTS_FILE = "weights.pt"


class Pretrain(Stage):
    """Train a backbone on source classes and store it as a content-addressed 'pretrained' artifact."""

    type_name: ClassVar[str] = "pretrain"
    # 2: CPU steps and evaluation in fixed micro-batches (run.deterministic): thread-invariant weights
    # 3: batch norms' running statistics as their own kernel computes them (not a second var_mean;
    #    the variance may differ in the last bit)
    version: ClassVar[int] = 3
    trains: ClassVar[bool] = True
    kind: ClassVar[str] = MODEL
    inputs: ClassVar[dict[str, str]] = {"input": DATASET}
    cacheable: ClassVar[bool] = True
    # A killed pretrain continues from the last epoch checkpointed in its staging directory, which the
    # catalog keys by this stage's fingerprint (a changed recipe never continues a stale one).
    resumable: ClassVar[bool] = True
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"prefetch"})

    input: str
    arch: str = "mobilenet_v2"
    width_mult: float = Field(1.0, gt=0)
    small_input: bool = False
    resolution: int = Field(224, ge=8)
    batch_size: int = Field(64, ge=1)
    augment: AugmentConfig | None = AugmentConfig(crop_padding=4, hflip=0.5)
    train: TrainConfig = TrainConfig(epochs=10)
    prefetch: int = 2
    seed: int = 0

    def _arch(self, num_classes: int) -> ArchConfig:
        return ArchConfig(self.arch, num_classes, self.width_mult, self.small_input, self.resolution)

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        data = inputs["input"]
        data.split("train", stage=self.type_name)
        check_precision(self.train.precision, ctx.torch_device)
        check_cuda_graph(self.train.cuda_graph, ctx.torch_device, self.train.precision, self.train.optimizer)
        return self._arch(data.num_classes).spec()

    def estimate_bytes(self, spec: Spec) -> int | None:
        return None

    def build(
        self, ctx: RunContext, inputs: dict[str, Any], staging: Path, call: StageCall
    ) -> dict[str, Any]:
        torch.manual_seed(self.seed)
        data = inputs["input"]
        arch = self._arch(len(data.class_names))
        net = arch.build().to(ctx.torch_device)
        augment = None
        if self.augment is not None:
            augment = InputAugment(
                random_resized_crop=self.augment.random_resized_crop,
                crop_padding=self.augment.crop_padding,
                hflip=self.augment.hflip,
            )
        decoder = Decoder(self.resolution, mean=IMAGENET_MEAN, std=IMAGENET_STD)
        cpu_work, threads = placement("auto", None, ctx.device)
        stream = DatasetStream(data, data.spec, decoder, augment, ("train",), self.batch_size, self.prefetch,
                               cpu_work=cpu_work, threads=threads)

        def train_batches(epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            opened = stream.open("train", epoch=epoch, shuffle=True, seed=self.seed)
            return xy(rechunk(opened, self.batch_size))

        eval_split = "val" if "val" in data.splits else None

        def eval_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            assert eval_split is not None  # only passed to train() when there is one
            return xy(stream.open(eval_split))

        def on_epoch(record: dict[str, Any]) -> None:
            ctx.metrics_log({"stage": call.name, **record})
            ctx.progress.log(
                f"[{call.name}] epoch {record['epoch']}: loss {record['train_loss']:.3f} "
                f"val acc {record.get('val_acc', float('nan')):.3f} "
                f"({record['epoch_seconds']:.1f}s)"
            )

        result = train(
            net,
            list(net.parameters()),
            train_batches,
            eval_batches if eval_split else None,
            self.train,
            checkpoint_dir=staging / "checkpoints",
            on_epoch=on_epoch,
            steps_per_epoch=-(-len(data.splits["train"]) // self.batch_size),
            resume_key=call.fingerprint,
            bars=ctx.progress,
            label=call.name,
            batch_size=self.batch_size,
            batch_setting=f"stages.{call.name}.batch_size",
            log=lambda m: ctx.progress.log(f"[{call.name}] {m}"),
        )
        best, _ = load_weights(staging / "checkpoints" / "best.pt") if eval_split else (net.state_dict(), {})
        net.load_state_dict(best)
        meta = {
            "arch": self.arch,
            "num_classes": len(data.class_names),
            "class_names": data.class_names,
            "best_val_acc": result.best_val_acc,
            "epochs": self.train.epochs,
        }
        save_weights(net, staging / WEIGHTS_FILE, meta)
        for f in (staging / "checkpoints").glob("*"):
            f.unlink()
        (staging / "checkpoints").rmdir()
        return {"best_val_acc": result.best_val_acc, "history": result.history}

    def load(self, ctx: RunContext, entry: Entry, call: StageCall) -> ModelValue:
        state, meta = load_weights(Path(entry.path) / WEIGHTS_FILE)
        arch = self._arch(int(meta["num_classes"]))
        save_backbone_model(ctx, call, state, arch)  # the run's model file, whether built now or reused
        return ModelValue(arch, state, f"pretrain entry {entry.fingerprint[:12]}")
