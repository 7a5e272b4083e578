"""Graph rewrites the runner applies: two adjacent stages computed as one stream.

A fusion changes how values are computed, never what: the fused stream yields bit for bit
what the two stages one after the other yield, so fingerprints, specs and stored entries are
those of the unfused graph. Each stage keeps its own report: the fused stream books its time
to the stage that would have spent it. This module is the only place that knows two stage
types at once; the stages themselves never look at each other.

Today's one fusion: ``dequantize`` then ``feature_aug``. The crop and flip move the one-byte
codes while they are decoded (in one pass of the compiled kernel when it is available,
:mod:`pipeline.codec.native`), instead of making float maps and then moving those. It runs on
the trainer's critical path every epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .codec.features import DEVICE_KEYS, MOVE_KEYS, DequantizedStream
from .codec.moves import CropFlip
from .graph import Graph
from .ops.batching import Batch, batch_size_of
from .stage import Stage
from .stages.feature_aug import FeatureAugment
from .stages.quantize import Dequantize
from .stream import Stream, StreamStats

if TYPE_CHECKING:
    import torch


class AugmentWhileDequantizing(Stream):
    """feature_aug fused with the dequantize stage before it: the crop and flip move the codes.

    Reads the quantized batches the dequantize stage reads (``source``), draws the moves as
    feature_aug draws them, and makes the maps with the dequantize stage's ``decode``. Time is
    booked as the two stages would book it: drawing the crops to feature_aug (this stream's
    stats), making the maps, moves and padding included, to dequantize (its stream's stats).
    """

    def __init__(self, source: Stream, dequantized: DequantizedStream,
                 draw: Callable[[Batch, int, int], CropFlip], splits: tuple[str, ...],
                 grid: tuple[int, int, int] | None = None) -> None:
        self.source = source
        self.grid = grid  # (prefix tokens, h, w) the moves act on; None: the maps' own (0, H, W)
        self.dequantized = dequantized
        self.draw = draw
        self.splits = splits
        self.spec = dequantized.spec
        self.stats = StreamStats()

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        batches = self.dequantized.fed(
            self.source.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start)
        )
        for batch in batches:
            n = batch_size_of(batch)
            t0 = time.perf_counter()
            crop = self.draw(batch, epoch, seed) if split in self.splits and n else None
            t1 = time.perf_counter()
            out = self.dequantized.decode(batch, crop)
            self.dequantized.stats.add(time.perf_counter() - t1, n)
            if crop is not None:
                self.stats.add(t1 - t0, n)
            yield out

    def open_coded(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
                   start: int = 0) -> Iterator[Batch]:
        """The batches :meth:`open` would decode, still coded, with the moves drawn for them as tensors
        (``dy``, ``dx``, ``flip``) on the device: :meth:`decode_coded` of each gives :meth:`open`'s maps,
        bit for bit. For a trainer that decodes in its own (CUDA-graph-captured) step."""
        batches = self.dequantized.fed(
            self.source.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start)
        )
        for batch in batches:
            n = batch_size_of(batch)
            t0 = time.perf_counter()
            out = {key: value for key, value in batch.items() if key in DEVICE_KEYS}
            if split in self.splits and n:
                crop = self.draw(batch, epoch, seed)
                device = next(v.device for k, v in out.items() if k != "y")
                out.update(zip(MOVE_KEYS, crop.move_tensors(device), strict=True))
                self.stats.add(time.perf_counter() - t0, n)
            yield out

    def decode_coded(self, batch: Batch) -> torch.Tensor:
        """The float32 maps of a batch of :meth:`open_coded` (moved where it carries moves)."""
        return self.dequantized.decode_coded(batch, self.grid)

    def stored_bytes(self) -> int:
        return self.dequantized.stored_bytes()


def fuse_dequantize_augment(augment: FeatureAugment, source: Stream,
                            dequantized: DequantizedStream) -> AugmentWhileDequantizing:
    """The feature_aug stage ``augment`` over ``dequantized``, computed while dequantizing ``source``."""
    prefix, h, w = dequantized.spec.feature_grid(dequantized.shape)
    return AugmentWhileDequantizing(source, dequantized, augment.crop_drawer(h, w, prefix), augment.splits,
                                    (prefix, h, w))


@dataclass(frozen=True)
class Fused:
    """``downstream`` reads ``upstream``'s output, and is computed together with it from ``source``."""

    downstream: str
    upstream: str
    source: str


def plan_fusions(graph: Graph, stages: dict[str, Stage]) -> dict[str, Fused]:
    """The fusions of ``graph``, by the name of the stage whose output becomes the fused stream."""
    out: dict[str, Fused] = {}
    for name, refs in graph.edges.items():
        stage = stages[name]
        if isinstance(stage, FeatureAugment):
            parent = refs.get("input")
            if parent is not None and isinstance(stages[parent], Dequantize):
                out[name] = Fused(name, parent, graph.edges[parent]["input"])
    return out


def apply_fusion(fused: Fused, stages: dict[str, Stage], values: dict[str, object]) -> Stream:
    """The fused stream for ``fused.downstream``, from the values of its upstream stage and source."""
    augment = stages[fused.downstream]
    dequantized = values[fused.upstream]
    source = values[fused.source]
    assert isinstance(augment, FeatureAugment)
    assert isinstance(dequantized, DequantizedStream) and isinstance(source, Stream)
    return fuse_dequantize_augment(augment, source, dequantized)
