"""Frozen forward: run the bottom of a backbone (eval mode, no grad) up to the cut.

The cut is stated from the top, ``train_last_blocks: N``, because that is how users
think about transfer learning; the output spec records it (with the model's
fingerprint) so the trainer can check it trains exactly the blocks above this cut.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from pydantic import Field

from ..errors import ModelError, StageError
from ..models.zoo import feature_shape, split_at
from ..ops.batching import Batch, rechunk
from ..registry import register
from ..spec import MODEL, STREAM, FieldSpec, Spec, SplitSpec
from ..stage import Stage
from ..stream import Stream, StreamStats
from .model import ModelValue


def check_cut(train_last_blocks: int, model: Spec) -> None:
    n = model.meta["num_blocks"]
    if not 0 <= train_last_blocks <= n:
        raise ModelError(
            f"train_last_blocks={train_last_blocks} is outside the valid range 0..{n} "
            f"for {model.meta['arch']} ({n} blocks)"
        )


class ForwardStream(Stream):
    def __init__(self, parent: Stream, bottom: torch.nn.Module, spec: Spec, batch_size: int | None) -> None:
        self.parent = parent
        self.bottom = bottom.eval()
        self.spec = spec
        self.batch_size = batch_size
        self.stats = StreamStats()

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        batches = self.parent.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start)
        if self.batch_size:
            batches = rechunk(batches, self.batch_size)
        for batch in batches:
            t0 = time.perf_counter()
            with torch.inference_mode():
                x = self.bottom(batch["x"])
            self.stats.add(time.perf_counter() - t0, len(x))
            yield {**batch, "x": x}

    def stored_bytes(self) -> int:
        return self.parent.stored_bytes()


@register
class FrozenForward(Stage):
    """The frozen bottom of a backbone (eval mode, no grad), up to the cut ``train_last_blocks`` from the top."""

    type_name: ClassVar[str] = "frozen_forward"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": STREAM, "model": MODEL}
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"batch_size"})

    input: str
    model: str
    train_last_blocks: int = Field(..., ge=0, description="blocks above the cut (trained later)")
    batch_size: int | None = Field(None, ge=1, description="forward batch size; default: as decoded")

    def resolve(self, inputs: dict[str, Spec], ctx: Any) -> Spec:
        data, model = inputs["input"], inputs["model"]
        check_cut(self.train_last_blocks, model)
        shapes = {name: s.fields.get("x") for name, s in data.splits.items()}
        for split, field in shapes.items():
            if field is None or len(field.shape) != 3:
                raise StageError(f"expected image tensors 'x' of shape (C,H,W) in split {split!r}, found {field}")
        resolution = next(iter(shapes.values())).shape[-1]
        from .model import ArchConfig

        arch = ArchConfig(model.meta["arch"], model.num_classes, model.meta["width_mult"],
                          model.meta["small_input"], model.meta["resolution"])
        shape = feature_shape(arch.build(), self.train_last_blocks, resolution)
        fields = {"x": FieldSpec(tuple(shape), "float32"), "y": FieldSpec((), "int64"),
                  "id": FieldSpec((), "int64")}
        splits = {name: SplitSpec(s.num_samples, fields) for name, s in data.splits.items()}
        cut = {"arch": model.meta["arch"], "train_last_blocks": self.train_last_blocks,
               "model": ctx.fingerprints.get(self.model), "feature_shape": list(shape),
               "resolution": resolution}
        return Spec(STREAM, data.num_classes, splits, {**data.meta, "cut": cut})

    def run(self, ctx: Any, inputs: dict[str, Any], name: str) -> ForwardStream:
        model: ModelValue = inputs["model"]
        spec = self.resolve({"input": inputs["input"].spec, "model": model.spec}, ctx)
        bottom, _top = split_at(model.build(), self.train_last_blocks)
        for p in bottom.parameters():
            p.requires_grad_(False)
        return ForwardStream(inputs["input"], bottom.to(ctx.torch_device), spec, self.batch_size)
