"""Frozen forward: run the bottom of a backbone (eval mode, no grad) up to the cut.

The cut is stated from the top, ``train_last_blocks: N``, because that is how users
think about transfer learning; the output spec records it (with the model's
fingerprint) so the trainer can check it trains exactly the blocks above this cut.

``precision`` chooses the arithmetic of the bottom (mixed-precision partitioning):
``fp32`` (default; true float32 on a GPU too, no TF32), ``bf16`` (autocast, CPU or CUDA),
``fp16`` (CUDA autocast) or ``int8`` (static int8 kernels on CPU,
calibrated on the first ``calibration_batches`` batches of ``calibration_split``; see
``pipeline.models.int8``). The output is float32 in every case, so
it feeds quantize/cache unchanged; precision is in the config (and so in the
fingerprint) and in the spec's ``Cut``. When int8 kernels are unavailable the
bottom runs in fp32 with a warning, and its fingerprint differs from a real int8
entry's, so a cache never mixes the two.

On a GPU (``run.device: cuda``) the decoded images reach the device through
:func:`pipeline.ops.device_feed.to_device`: pinned, copied asynchronously a couple of batches
ahead, so the copies overlap the forward; the maps stay on the device for the quantizer. Running
out of GPU memory is a :class:`~pipeline.errors.DeviceMemoryError` naming the stage and batch size.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from ..device import ieee_fp32, is_out_of_memory, out_of_memory
from ..errors import StageError
from ..lazy import lazy_module
from ..models.arch import ArchConfig, ModelValue, check_cut, structure
from ..models.fold import fold_batch_norms
from ..ops.batching import Batch, rechunk
from ..ops.device_feed import to_device
from ..ops.padded_forward import padded_forward
from ..spec import MODEL, STREAM, Cut, FieldSpec, Spec, SplitSpec
from ..stage import Stage, StageCall, StageInputs
from ..stream import Stream, StreamStats

if TYPE_CHECKING:
    import torch

    from ..context import RunContext
    from ..models import zoo
else:
    torch = lazy_module("torch")
    zoo = lazy_module("pipeline.models.zoo")


AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


class ForwardStream(Stream):
    """``parent``'s images through the frozen ``bottom`` on ``device``; float32 maps, left on ``device``.

    ``autocast``: None (float32), or the reduced dtype ("bfloat16", "float16") autocast computes in.
    """

    def __init__(self, parent: Stream, bottom: torch.nn.Module, spec: Spec, batch_size: int | None,
                 autocast: str | None = None, *, device: torch.device | None = None,
                 name: str = "frozen_forward", feed_depth: int = 2) -> None:
        self.parent = parent
        self.bottom = bottom.eval()
        self.spec = spec
        self.batch_size = batch_size
        self.autocast = autocast
        self.device = device if device is not None else torch.device("cpu")
        self.name = name
        self.feed_depth = feed_depth
        self.stats = StreamStats()

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        batches = self.parent.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start)
        if self.batch_size:
            batches = rechunk(batches, self.batch_size)
        yield from self.forward_batches(to_device(batches, self.device, ("x",), depth=self.feed_depth), split)

    def forward_batches(self, batches: Iterator[Batch], split: str) -> Iterator[Batch]:
        """Each batch's ``x`` through the bottom, timed into ``stats``."""
        dtype = getattr(torch, self.autocast) if self.autocast else None
        for batch in batches:
            t0 = time.perf_counter()
            try:
                with torch.inference_mode(), ieee_fp32(self.device), \
                        torch.autocast(self.device.type, dtype, enabled=dtype is not None):
                    x = padded_forward(self.bottom, batch["x"]).float()
            except RuntimeError as exc:
                if not is_out_of_memory(exc):
                    raise
                n = len(batch["x"])
                raise out_of_memory(exc, stage=f"{self.name} (frozen_forward)", batch_size=n,
                                    setting=f"stages.{self.name}.batch_size", device=self.device,
                                    during=f"the frozen forward of split {split!r}",
                                    resumes="A cache build interrupted here resumes from the chunks it "
                                    "wrote") from None
            self.stats.add(time.perf_counter() - t0, len(x))
            yield {**batch, "x": x}

    def stored_bytes(self) -> int:
        return self.parent.stored_bytes()


class FrozenForward(Stage):
    """The frozen bottom of a backbone (eval mode, no grad) up to the cut, in fp32, bf16 or int8."""

    type_name: ClassVar[str] = "frozen_forward"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": STREAM, "model": MODEL}
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"batch_size"})
    # 2: batch norms folded into the convolutions (fp32/bf16): outputs differ in the last bits
    # 3: batches padded to a multiple of FORWARD_BLOCK: a short batch's outputs no longer depend on threads
    version: ClassVar[int] = 3

    input: str
    model: str
    train_last_blocks: int = Field(..., ge=0, description="blocks above the cut (trained later)")
    batch_size: int | None = Field(None, ge=1, description="forward batch size; default: as decoded")
    precision: Literal["fp32", "bf16", "fp16", "int8"] = Field(
        "fp32", description="arithmetic of the bottom: fp32, bf16 (autocast), fp16 (CUDA autocast), "
        "int8 (CPU kernels)")
    calibration_batches: int = Field(8, ge=1, description="int8: batches observed to set activation ranges")
    calibration_split: str = Field("train", description="int8: split the calibration batches come from")
    lossy_source: bool = Field(
        False, description="input from a cache (a stream with a cut): accept features stored below 32 bits; "
        "the derived cut then is not the cache the images give, and its lineage says so")

    def fingerprint_config(self) -> dict[str, Any]:
        """Calibration settings matter only to int8: an fp32/bf16 bottom ignores them, and so does its key."""
        config = super().fingerprint_config()
        if self.precision != "int8":
            config.pop("calibration_batches", None)
            config.pop("calibration_split", None)
        return config

    def identity(self, ctx: RunContext) -> str | None:
        if self.precision != "int8":
            return None
        from ..models.int8 import int8_support  # torch-heavy: imported when a run resolves

        engine, _reason = int8_support()
        # int8 results depend on the kernels; a fallback to fp32 must never share their fingerprint.
        return f"int8:{engine}" if engine else "int8-unavailable:fp32-fallback"

    def sample_dependence(self) -> str | None:
        if self.precision == "int8":
            return (f"an int8 bottom is calibrated on the first {self.calibration_batches} batches of "
                    f"{self.calibration_split!r} (a statistic of the dataset): its cache is built whole")
        return None  # eval mode, batches padded (pipeline.ops.padded_forward): a sample's maps are its own

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        data, model = inputs["input"], inputs["model"]
        check_cut(self.train_last_blocks, model)
        self._check_device(ctx)
        if data.cut is not None:  # features at a lower cut: run only the blocks between (derived_cut)
            from .derived_cut import derived_spec

            return derived_spec(self, inputs)
        if self.lossy_source:
            raise StageError(f"lossy_source applies to a feature stream input (from a cache); `{self.input}` "
                             "holds images: remove lossy_source")
        shapes = {name: s.fields.get("x") for name, s in data.splits.items()}
        for split, field in shapes.items():
            if field is None or len(field.shape) != 3:
                raise StageError(f"expected image tensors 'x' of shape (C,H,W) in split {split!r}, "
                                 f"found {field}")
        first = next(iter(shapes.values()))
        assert first is not None  # checked above
        resolution = first.shape[-1]
        net = structure(ArchConfig.of(model))
        shape = zoo.feature_shape(net, self.train_last_blocks, resolution)
        fields = {"x": FieldSpec(tuple(shape), "float32"), "y": FieldSpec((), "int64"),
                  "id": FieldSpec((), "int64")}
        splits = {name: SplitSpec(s.num_samples, fields) for name, s in data.splits.items()}
        if self.precision == "int8" and self.calibration_split not in data.splits:
            raise StageError(f"calibration_split {self.calibration_split!r} is not a split of "
                             f"`{self.input}` (found {sorted(data.splits)})")
        cut = Cut(model.model.arch, self.train_last_blocks, inputs.parent("model"),
                  shape, resolution, self.precision, zoo.token_layout(net, self.train_last_blocks))
        return data.as_stream(splits).with_cut(cut)

    def _check_device(self, ctx: RunContext) -> None:
        """Precisions the run's device cannot compute, refused when the run is planned, before any work."""
        device = ctx.torch_device.type
        if self.precision == "int8" and device != "cpu":
            raise StageError(f"precision: int8 uses CPU int8 kernels; run.device is {ctx.device} "
                             "(set run.device: cpu, or precision: fp32, bf16 or fp16)")
        if self.precision == "fp16" and device != "cuda":
            raise StageError(f"precision: fp16 is CUDA autocast; run.device is {ctx.device} "
                             "(on a CPU use precision: bf16 or fp32)")

    def plan_note(self, call: StageCall) -> str | None:
        if call.spec.derivation is None or call.inputs["input"].cut is None:
            return None
        from .derived_cut import plan_note

        return plan_note(call.spec)

    def plan_action(self, call: StageCall) -> str | None:
        return "derive" if self.plan_note(call) is not None else None

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> Stream:
        model: ModelValue = inputs["model"]
        spec = call.spec
        source = call.inputs["input"].cut
        if source is not None:
            return self._derived(ctx, inputs["input"], model, call, source.train_last_blocks)
        bottom: torch.nn.Module = zoo.split_at(model.build(), self.train_last_blocks)[0]
        for p in bottom.parameters():
            p.requires_grad_(False)
        bottom.eval()
        if self.precision == "int8":  # int8 conversion folds the batch norms itself
            bottom, used = self._int8(ctx, inputs["input"], bottom, call.name)
            cut = spec.cut
            assert cut is not None  # resolve() set it
            spec = spec.with_cut(replace(cut, precision=used))
        else:
            bottom = fold_batch_norms(bottom)
        return ForwardStream(inputs["input"], bottom.to(ctx.torch_device), spec, self.batch_size,
                             AUTOCAST.get(self.precision), device=ctx.torch_device, name=call.name)

    def _derived(self, ctx: RunContext, stream: Stream, model: ModelValue, call: StageCall,
                 stored: int) -> Stream:
        """The blocks between the stored cut and this one, over the stored features (resolve checked them)."""
        from .derived_cut import DERIVE_BATCH, DerivedForwardStream

        blocks = zoo.blocks_between(model.build(), stored, self.train_last_blocks)
        for p in blocks.parameters():
            p.requires_grad_(False)
        middle = fold_batch_norms(blocks.eval())
        forward = ForwardStream(stream, middle.to(ctx.torch_device), call.spec, None,
                                AUTOCAST.get(self.precision), device=ctx.torch_device, name=call.name)
        derivation = call.spec.derivation
        assert derivation is not None  # resolve() set it
        return DerivedForwardStream(forward, self.batch_size or DERIVE_BATCH, derivation)

    def _int8(self, ctx: RunContext, stream: Stream, bottom: torch.nn.Module,
              name: str) -> tuple[torch.nn.Module, str]:
        """The calibrated int8 bottom (or the fp32 one with a warning when int8 is unavailable)."""
        self._check_device(ctx)
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
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # stop the decode prefetch thread now, not at garbage collection
        if not calibration:
            raise StageError(f"calibration split {self.calibration_split!r} of `{self.input}` is empty")
        from ..models.int8 import int8_bottom

        return int8_bottom(bottom, calibration, where=f"stage {name!r} (frozen_forward)")
