"""Spill: a trained block's outputs for every split, kept as a store entry and read back.

Once block ``k`` is trained, the outputs of the layers up to it are computed once for every
sample of every split and written to the store through the cache codec (optional n-bit
quantization, then a lossless codec, sample-chunked zarr). The next block reads that entry
instead of recomputing blocks ``0..k``: through re-chunk to its own batch size and prefetch.

A spill is an ordinary catalog entry, so everything the store does applies: the budget
makes room for it (or refuses with a clear error), an interrupted write resumes at the
first missing chunk (bit-identical to an uninterrupted one), and a reader's hold keeps it
from being evicted while a block trains from it. Its fingerprint is derived from the
NeuroFlux stage's fingerprint and the block it follows, so a changed recipe (model, data,
budget, seed, codec) can never read a stale spill.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from stores.catalog import Catalog, EntryUse, Staging
from stores.errors import BudgetError

from ...codec.features import DequantizedStream, coded_spec, decoded_spec, encoded
from ...fingerprint import derived_fingerprint
from ...lazy import lazy_module
from ...ops.batching import Batch
from ...ops.cache import StoredStream, write_stream
from ...ops.padded_forward import padded_forward
from ...recipe_model import RecipeModel
from ...spec import STREAM, FieldSpec, Spec, SplitSpec
from ...stream import MapStream, Stream

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")

SPILL_KIND = "neuroflux-spill"


class SpillConfig(RecipeModel):
    """How a block's outputs are stored and shuffled: the cache codec's settings (they change results)."""


    bits: Literal[1, 2, 4, 8, 16, 32] = Field(
        32, description="training split: n-bit quantile codes (1-8) or float16/32; val/test stay float"
    )
    compressor: Literal["zstd", "blosc", "none"] = "zstd"
    level: int = Field(3, ge=0, le=22)
    chunk_bytes: int = Field(1 << 20, ge=1024, description="target bytes per stored chunk")
    window_chunks: int = Field(4, ge=1, description="shuffle window in chunks")


def block_output_stream(
    parent: Stream,
    layers: Sequence[nn.Module],
    shape: Sequence[int],
    after_layer: int,
    splits: Sequence[str] | None = None,
) -> MapStream:
    """``parent`` with ``x`` replaced by the output of ``layers`` (eval mode, no autograd); y, id kept.

    ``shape``: one sample's output shape (the last layer's ``LayerInfo.out_shape``). ``splits``: the
    splits the stream carries (default all). Later blocks train on ``train`` and validate on ``val``;
    the test split is evaluated end to end from images, so it need not be spilled.
    """
    shape = tuple(int(d) for d in shape)
    kept = {
        name: SplitSpec(s.num_samples, {**s.fields, "x": FieldSpec(shape, "float32")})
        for name, s in parent.spec.splits.items()
        if splits is None or name in splits
    }
    spec = Spec(STREAM, parent.spec.num_classes, kept, {**parent.spec.meta, "after_layer": after_layer})

    device = next(layers[0].parameters()).device if layers else torch.device("cpu")

    def forward(batch: Batch, split: str, epoch: int, seed: int) -> Batch:
        for m in layers:
            m.eval()  # the block is trained: its batch norms use running statistics
        with torch.no_grad():
            x = batch["x"]
            h = x.to(device, non_blocking=True)  # the trained layers' device (CUDA: a GPU forward)
            # Padded as the frozen forward pads: a short batch's spilled bits then do not depend on
            # the thread count (pipeline/stages/forward.py).
            h = padded_forward(through, h)
        return {**batch, "x": h.to(x.device)}  # the spill is written from where its input came

    def through(h: torch.Tensor) -> torch.Tensor:
        for m in layers:
            h = m(h)
        return h

    return MapStream(parent, forward, spec)


class Spills:
    """The spill entries of one NeuroFlux run: written once, held while read, dropped when done."""

    def __init__(
        self,
        catalog: Catalog,
        stage_fingerprint: str,
        config: SpillConfig,
        *,
        prefetch: int,
        keep: bool,
        log: Any,
    ) -> None:
        self.catalog = catalog
        self.stage_fingerprint = stage_fingerprint
        self.config = config
        self.prefetch = prefetch  # chunks read ahead while a block trains
        self.keep = keep  # keep every spill instead of dropping one once the next exists
        self.log = log
        self._held: dict[int, EntryUse] = {}
        self.sizes: dict[int, tuple[int, int]] = {}  # block -> (bytes on disk, samples stored)

    def fingerprint(self, block: int) -> str:
        return derived_fingerprint(self.stage_fingerprint, f"spill-after-block-{block}")

    def exists(self, block: int) -> bool:
        return self.catalog.exists(self.fingerprint(block))

    def _bits_for(self, split: str) -> int:
        """The codec of the quantize stage's defaults: ``bits`` on train, float elsewhere."""
        bits = self.config.bits
        return bits if split == "train" else (32 if bits == 32 else 16)

    def write(self, block: int, outputs: Stream, lineage: dict[str, Any], progress: Any = None) -> None:
        """Store ``outputs`` (the stream after ``block``) unless it is stored; resumes a partial write.

        Goes through the catalog's one look-up-or-build-and-commit sequence, as the runner does; the
        entry stays held (not evictable) from then until :meth:`drop` or :meth:`close`.
        """
        fp = self.fingerprint(block)
        spec = coded_spec(outputs.spec, self._bits_for, self.config.bits, 1, stage=f"spill-{block}")
        coded = encoded(outputs, spec, self._bits_for, 1)
        estimate = sum(s.num_samples * s.sample_bytes() for s in coded.spec.splits.values())

        def build(staging: Staging) -> dict[str, Any]:
            if staging.resumed:
                self.log(f"spill after block {block}: resuming an interrupted write")
            extra = write_stream(
                coded,
                staging.path,
                chunk_bytes=self.config.chunk_bytes,
                compressor=self.config.compressor,
                level=self.config.level,
                attrs={"lineage": lineage},
                progress=progress,
                log=self.log,
            )
            return {**extra, "after_block": block}

        try:
            built = self.catalog.reuse_or_build(fp, SPILL_KIND, lineage, build, resume=True,
                                                estimate_bytes=estimate)
        except BudgetError as exc:
            raise BudgetError(
                f"the spill after block {block} ({estimate / 2**20:.1f} MiB before compression at "
                f"spill.bits: {self.config.bits}) does not fit the store budget; fewer bits shrink "
                f"it. {exc}",
                needed=exc.needed,
                available=exc.available,
                pinned=exc.pinned,
                in_use=exc.in_use,
            ) from None
        old = self._held.pop(block, None)
        if old is not None:
            old.release()
        self._held[block] = built.use

    def open(self, block: int) -> Stream:
        """The spill after ``block`` as a float stream; held (not evictable) until :meth:`drop`."""
        if block not in self._held:
            self._held[block] = self.catalog.use(self.fingerprint(block))
        entry = self._held[block].entry
        stored = StoredStream(
            Path(entry.path),
            size_bytes=entry.size_bytes,
            prefetch_depth=self.prefetch,
            window_chunks=self.config.window_chunks,
        )
        self.sizes[block] = (entry.size_bytes, sum(s.num_samples for s in stored.spec.splits.values()))
        return DequantizedStream(stored, decoded_spec(stored.spec))

    def release(self, block: int) -> None:
        held = self._held.pop(block, None)
        if held is not None:
            held.release()

    def drop(self, block: int) -> None:
        """Release the spill and, unless spills are kept, remove it from the store."""
        self.release(block)
        if not self.keep and self.catalog.remove(self.fingerprint(block)):
            self.log(f"dropped the spill after block {block} (keep_spills: false)")

    def close(self) -> None:
        for block in list(self._held):
            self.release(block)
