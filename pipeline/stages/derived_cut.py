"""A frozen forward that starts from stored features: a cache at cut k serves a cut j < k.

``train_last_blocks: k`` leaves blocks ``[0, n-k)`` frozen. A feature stream taken there (read
back from a float cache through ``dequantize``) already holds what those blocks computed, so the
features at a higher cut ``j`` are blocks ``[n-k, n-j)`` applied to it: the image decode and the
first ``n-k`` blocks are not run again. This is how a sweep over cuts runs the bottom once
(``pipeline.derive_cuts.share_bottom``).

It is not a new stage type: ``frozen_forward`` takes this path when its ``input`` carries a
``Cut``, so the derived stream is an ordinary stage output, fingerprinted from its parent (the
dequantized cache) and its config like any other; it never shares a key with the image-based
forward at the same cut, whose parent is the decoded images.

What is refused, when the recipe is resolved (before any work), and why:

- features of another model (the ``Cut``'s model fingerprint is not this stage's ``model``);
- a cut below the stored one (``j > k``): blocks already applied cannot be undone;
- a ``precision`` other than the stored cut's, and int8 on either side: an int8 bottom is
  calibrated as a whole, so two calibrated halves are not the bottom a direct int8 forward makes;
- a source coded below 32 bits in any split (``quantize`` ``bits`` < 32, or ``eval_bits: 16``),
  unless ``lossy_source: true``: the blocks would run on rounded features, which is not the cache
  the images give. With the opt-in, the derived spec's lineage says which splits were lossy.

Last bits: the derived features come from the same folded blocks in the same order; with equal
batch composition they are what the image-based forward gives (the tests measure it). Batches
are aligned to absolute sample positions (``batch_size``, default decode's 64), so a resumed or
partitioned build forms the batches an uninterrupted one forms.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import StageError
from ..lazy import lazy_module
from ..models.arch import ArchConfig, structure
from ..ops.batching import Batch, batch_size_of, rechunk
from ..ops.device_feed import to_device
from ..spec import Cut, Derivation, FieldSpec, Spec, SplitSpec
from ..stream import Stream

if TYPE_CHECKING:
    from ..models import zoo
    from ..stage import StageInputs
    from .forward import ForwardStream, FrozenForward
else:
    zoo = lazy_module("pipeline.models.zoo")

# Batches of the derived forward when the stage sets no batch_size: decode's default, so a derived
# forward and the image-based one see the same batch composition (and so the same last bits).
DERIVE_BATCH = 64

def derived_spec(stage: FrozenForward, inputs: StageInputs) -> Spec:
    """The spec of ``stage`` run on its feature stream input (whose spec has a ``Cut``); refusals above."""
    data, model = inputs["input"], inputs["model"]
    source = data.cut
    assert source is not None  # the caller took this path because it has one
    j, k = stage.train_last_blocks, source.train_last_blocks
    model_fingerprint = inputs.parent("model")
    if source.model != model_fingerprint:
        raise StageError(
            f"`{stage.input}` holds features of another model ({source.arch}, model fingerprint "
            f"{str(source.model)[:12]}) than `{stage.model}` ({model.model.arch}, "
            f"{str(model_fingerprint)[:12]}); a cut can only be derived from features of "
            "the same backbone"
        )
    if j > k:
        raise StageError(
            f"train_last_blocks={j} is below the cut of `{stage.input}` (train_last_blocks={k}): its "
            f"features already went through blocks the cut at {j} leaves to train, which cannot be "
            f"undone; derive only cuts with train_last_blocks <= {k}, or read the images"
        )
    if "int8" in (stage.precision, source.precision):
        raise StageError(
            f"precision: int8 cannot be derived (the stored cut is {source.precision}, this stage "
            f"{stage.precision}): an int8 bottom is calibrated as a whole, so running its upper blocks "
            "separately is not the cache the images give; read the images for an int8 cut"
        )
    if stage.precision != source.precision:
        raise StageError(
            f"precision: {stage.precision} differs from the stored cut's ({source.precision}); a derived "
            "cut runs the rest of the bottom in the stored cut's arithmetic: set precision: "
            f"{source.precision}"
        )
    lossy = _lossy_splits(data)
    if lossy and not stage.lossy_source:
        where = ", ".join(f"{s} at {b} bits" for s, b in sorted(lossy.items()))
        raise StageError(
            f"`{stage.input}` was coded lossily ({where}); features derived from rounded values are not "
            "the cache the images give. Derive from a float cache (quantize bits: 32, eval_bits: 32), or "
            "set lossy_source: true to accept it (the lineage records it)"
        )
    shapes = {name: s.fields.get("x") for name, s in data.splits.items()}
    for split, field in shapes.items():
        if field is None or field.dtype != "float32" or tuple(field.shape) != tuple(source.feature_shape):
            raise StageError(
                f"expected float32 feature maps 'x' of shape {source.feature_shape} (the stored cut's) in "
                f"split {split!r}, found {field}; read a cache through a dequantize stage"
            )
    net = structure(ArchConfig.of(model))
    shape = zoo.feature_shape(net, j, source.resolution)
    fields = {"x": FieldSpec(tuple(shape), "float32"), "y": FieldSpec((), "int64"),
              "id": FieldSpec((), "int64")}
    splits = {name: SplitSpec(s.num_samples, fields) for name, s in data.splits.items()}
    n = len(net.blocks)
    derivation = Derivation(stage.input, inputs.parent("input"), k, (n - k, n - j), lossy or None)
    cut = Cut(source.arch, j, source.model, shape, source.resolution, stage.precision)
    # The source's coding is dropped: the derived features are new float32 maps at another shape,
    # not the coded stream they were computed from.
    derived = Spec(data.kind, data.num_classes, splits, data.meta).without_coding()
    return derived.with_derivation(derivation).with_cut(cut)


def _lossy_splits(data: Spec) -> dict[str, int]:
    """Split -> bits of the splits ``data`` was coded below float32 (empty: never coded, or losslessly)."""
    q = data.quantization
    if q is None:
        return {}
    coded = data.coded_bits
    if coded is None:  # a coded stream that does not say per split: assume the train bits everywhere
        coded = {name: q.bits for name in data.splits}
    return {name: bits for name, bits in coded.items() if bits < 32}


def plan_note(spec: Spec) -> str:
    """What ``python -m pipeline plan`` says about a derived stream."""
    source, cut = spec.derivation, spec.cut
    assert source is not None and cut is not None
    blocks = blocks_run(*source.blocks) + ("" if source.ran_blocks else " (the stored cut itself)")
    return f"cut {source.train_last_blocks} -> {cut.train_last_blocks}: {blocks} on `{source.stream}`"


def blocks_run(first: int, stop: int) -> str:
    """The blocks a derivation runs, as plans and run reports name them."""
    return f"blocks {first}..{stop - 1}" if stop > first else "no blocks"


class DerivedForwardStream(Stream):
    """The stored features ``forward`` reads, through its blocks (those between two cuts), in aligned batches.

    Batches are ``batch_size`` samples counted from the split's first sample, whatever batches
    the stored stream yields (its chunks): opened at ``start``, the parent is opened at the batch
    boundary before it and the lead-in samples are dropped after the forward, so every sample is
    computed in the batch an uninterrupted pass puts it in. ``report`` gives the derivation's
    cost for the run's stage report.
    """

    def __init__(self, forward: ForwardStream, batch_size: int, derived_from: Derivation) -> None:
        self.forward = forward
        self.parent = forward.parent
        self.spec = forward.spec
        self.stats = forward.stats
        self.batch_size = batch_size
        self.derived_from = derived_from

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        size = self.batch_size
        aligned = start - start % size
        lead_in = start - aligned
        parent = self.parent.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=aligned)
        forward = self.forward
        batches = to_device(rechunk(parent, size), forward.device, ("x",), depth=forward.feed_depth)
        for batch in forward.forward_batches(batches, split):
            if lead_in:
                n = batch_size_of(batch)
                skip = min(n, lead_in)
                lead_in -= skip
                if skip == n:
                    continue
                batch = {key: value[skip:] for key, value in batch.items()}
            yield batch

    def stored_bytes(self) -> int:
        return self.parent.stored_bytes()

    def report(self) -> dict[str, Any]:
        seconds, samples = self.stats.seconds, self.stats.samples
        return {
            "derived_from": self.derived_from.to_meta(),
            "samples": samples,
            "seconds": round(seconds, 4),
            "samples_per_s": round(samples / seconds, 1) if seconds > 0 else None,
        }
