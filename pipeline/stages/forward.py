"""Frozen forward: run the bottom of a backbone (eval mode, no grad) up to the cut.

The cut is stated from the top, ``train_last_blocks: N``, because that is how users
think about transfer learning; the output spec records it (with the model's
fingerprint) so the trainer can check it trains exactly the blocks above this cut.

``precision`` chooses the arithmetic of the bottom (mixed-precision partitioning):
``fp32`` (default), ``bf16`` (autocast) or ``int8`` (static int8 kernels on CPU,
calibrated on the first ``calibration_batches`` batches of ``calibration_split``; see
``pipeline.methods.mixed_precision.int8``). The output is float32 in every case, so
it feeds quantize/cache unchanged; precision is in the config (and so in the
fingerprint) and in the spec's ``cut`` meta. When int8 kernels are unavailable the
bottom runs in fp32 with a warning, and its fingerprint differs from a real int8
entry's, so a cache never mixes the two.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from ..errors import ModelError, StageError
from ..lazy import lazy_module
from ..models.fold import fold_batch_norms
from ..ops.batching import Batch, rechunk
from ..registry import register
from ..spec import MODEL, STREAM, FieldSpec, Spec, SplitSpec
from ..stage import Stage
from ..stream import Stream, StreamStats
from .model import ModelValue

if TYPE_CHECKING:
    import torch

    from ..models import zoo
else:
    torch = lazy_module("torch")
    zoo = lazy_module("pipeline.models.zoo")


def check_cut(train_last_blocks: int, model: Spec) -> None:
    n = model.meta["num_blocks"]
    if not 0 <= train_last_blocks <= n:
        raise ModelError(
            f"train_last_blocks={train_last_blocks} is outside the valid range 0..{n} "
            f"for {model.meta['arch']} ({n} blocks)"
        )


class ForwardStream(Stream):
    def __init__(self, parent: Stream, bottom: torch.nn.Module, spec: Spec, batch_size: int | None,
                 autocast_bf16: bool = False) -> None:
        self.parent = parent
        self.bottom = bottom.eval()
        self.spec = spec
        self.batch_size = batch_size
        self.autocast_bf16 = autocast_bf16
        self.stats = StreamStats()

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        batches = self.parent.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start)
        if self.batch_size:
            batches = rechunk(batches, self.batch_size)
        for batch in batches:
            t0 = time.perf_counter()
            with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=self.autocast_bf16):
                x = self.bottom(batch["x"]).float()
            self.stats.add(time.perf_counter() - t0, len(x))
            yield {**batch, "x": x}

    def stored_bytes(self) -> int:
        return self.parent.stored_bytes()


@register
class FrozenForward(Stage):
    """The frozen bottom of a backbone (eval mode, no grad) up to the cut, in fp32, bf16 or int8."""

    type_name: ClassVar[str] = "frozen_forward"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": STREAM, "model": MODEL}
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"batch_size"})
    # 2: batch norms folded into the convolutions (fp32/bf16): outputs differ in the last bits
    version: ClassVar[int] = 2

    input: str
    model: str
    train_last_blocks: int = Field(..., ge=0, description="blocks above the cut (trained later)")
    batch_size: int | None = Field(None, ge=1, description="forward batch size; default: as decoded")
    precision: Literal["fp32", "bf16", "int8"] = Field("fp32", description="arithmetic of the bottom")
    calibration_batches: int = Field(8, ge=1, description="int8: batches observed to set activation ranges")
    calibration_split: str = Field("train", description="int8: split the calibration batches come from")

    def fingerprint_config(self) -> dict[str, Any]:
        """Calibration settings matter only to int8: an fp32/bf16 bottom ignores them, and so does its key."""
        config = super().fingerprint_config()
        if self.precision != "int8":
            config.pop("calibration_batches", None)
            config.pop("calibration_split", None)
        return config

    def identity(self, ctx: Any) -> str | None:
        if self.precision != "int8":
            return None
        from ..methods.mixed_precision.int8 import int8_support

        engine, _reason = int8_support()
        # int8 results depend on the kernels; a fallback to fp32 must never share their fingerprint.
        return f"int8:{engine}" if engine else "int8-unavailable:fp32-fallback"

    def resolve(self, inputs: dict[str, Spec], ctx: Any) -> Spec:
        data, model = inputs["input"], inputs["model"]
        check_cut(self.train_last_blocks, model)
        shapes = {name: s.fields.get("x") for name, s in data.splits.items()}
        for split, field in shapes.items():
            if field is None or len(field.shape) != 3:
                raise StageError(f"expected image tensors 'x' of shape (C,H,W) in split {split!r}, "
                                 f"found {field}")
        resolution = next(iter(shapes.values())).shape[-1]
        from .model import ArchConfig

        arch = ArchConfig(model.meta["arch"], model.num_classes, model.meta["width_mult"],
                          model.meta["small_input"], model.meta["resolution"])
        shape = zoo.feature_shape(arch.build(), self.train_last_blocks, resolution)
        fields = {"x": FieldSpec(tuple(shape), "float32"), "y": FieldSpec((), "int64"),
                  "id": FieldSpec((), "int64")}
        splits = {name: SplitSpec(s.num_samples, fields) for name, s in data.splits.items()}
        if self.precision == "int8" and self.calibration_split not in data.splits:
            raise StageError(f"calibration_split {self.calibration_split!r} is not a split of "
                             f"`{self.input}` (found {sorted(data.splits)})")
        cut = {"arch": model.meta["arch"], "train_last_blocks": self.train_last_blocks,
               "model": ctx.fingerprints.get(self.model), "feature_shape": list(shape),
               "resolution": resolution, "precision": self.precision}
        return Spec(STREAM, data.num_classes, splits, {**data.meta, "cut": cut})

    def run(self, ctx: Any, inputs: dict[str, Any], name: str) -> ForwardStream:
        model: ModelValue = inputs["model"]
        spec = self.resolve({"input": inputs["input"].spec, "model": model.spec}, ctx)
        bottom, _top = zoo.split_at(model.build(), self.train_last_blocks)
        for p in bottom.parameters():
            p.requires_grad_(False)
        bottom.eval()
        if self.precision == "int8":  # int8 conversion folds the batch norms itself
            bottom, used = self._int8(ctx, inputs["input"], bottom, name)
            spec = Spec(spec.kind, spec.num_classes, spec.splits,
                        {**spec.meta, "cut": {**spec.meta["cut"], "precision": used}})
        elif self.precision == "bf16" and ctx.torch_device.type != "cpu":
            raise StageError(f"precision: bf16 is implemented with CPU autocast; run.device is {ctx.device}")
        else:
            bottom = fold_batch_norms(bottom)
        return ForwardStream(inputs["input"], bottom.to(ctx.torch_device), spec, self.batch_size,
                             autocast_bf16=self.precision == "bf16")

    def _int8(self, ctx: Any, stream: Stream, bottom: torch.nn.Module,
              name: str) -> tuple[torch.nn.Module, str]:
        """The calibrated int8 bottom (or the fp32 one with a warning when int8 is unavailable)."""
        from ..methods.mixed_precision.int8 import int8_bottom

        if ctx.torch_device.type != "cpu":
            raise StageError(f"precision: int8 uses CPU int8 kernels; run.device is {ctx.device} "
                             "(set run.device: cpu or precision: fp32)")
        batches = stream.open(self.calibration_split)
        if self.batch_size:
            batches = rechunk(batches, self.batch_size)
        calibration = []
        try:
            for batch in batches:
                calibration.append(batch["x"])
                if len(calibration) >= self.calibration_batches:
                    break
        finally:
            batches.close()  # stop the decode prefetch thread now, not at garbage collection
        if not calibration:
            raise StageError(f"calibration split {self.calibration_split!r} of `{self.input}` is empty")
        return int8_bottom(bottom, calibration, where=f"stage {name!r} (frozen_forward)")
