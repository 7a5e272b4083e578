"""The block loop of a NeuroFlux run: which block trains from which stored input.

For block ``k`` (in order): if its trained weights are a committed store entry, load them; else
find what it reads — the images for block 0, else the spill after block ``k-1`` (written now from
the newest stored spill before it, or from the images, through the trained blocks in between) —
and train it with local learning, checkpointing every epoch in its staging directory, then commit
it. Spills older than the one being read are dropped once the newer one exists, unless kept.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stores.catalog import Catalog, Staging

from ...device import out_of_memory
from ...fingerprint import derived_fingerprint
from ...models.weights import load_weights, save_weights
from ...stream import Stream
from .. import build_record
from .aux import LocalLayer
from .local import BlockState, train_block
from .models import LayerNet
from .partition import Block
from .spill import Spills, block_output_stream

if TYPE_CHECKING:
    from ...context import RunContext
    from .stage import NeuroFlux

BLOCK_KIND = "neuroflux-block"
# What later blocks read: they train on train and validate on val (test is evaluated from images).
SPILLED_SPLITS = ("train", "val")


class BlockRun:
    """One NeuroFlux run's block loop: which block trains from which stored input."""

    def __init__(
        self,
        stage: NeuroFlux,
        ctx: RunContext,
        name: str,
        catalog: Catalog,
        fingerprint: str,
        net: LayerNet,
        local: list[LocalLayer],
        blocks: list[Block],
        images: Stream,
        spills: Spills,
        started: float,
    ) -> None:
        self.stage, self.ctx, self.name, self.catalog = stage, ctx, name, catalog
        self.fingerprint, self.net, self.local, self.blocks = fingerprint, net, local, blocks
        self.images, self.spills, self.started = images, spills, started
        self.source: Stream = images
        self.source_after = -1  # the block whose outputs ``source`` holds (-1: the images)
        self.val_acc: dict[int, float] = {}
        self.curve: list[tuple[float, float]] = []
        self.status: dict[int, str] = {}
        self.spill_seconds = 0.0
        self.spilled: list[int] = []

    def log(self, message: str) -> None:
        self.ctx.progress.log(f"[{self.name}] {message}")

    # ------------------------------------------------------------------ inputs
    def _input_for(self, block: int) -> Stream:
        """The stream block ``block`` trains from: the images or the spill after ``block - 1``."""
        want = block - 1
        if self.source_after == want:
            return self.source
        if want < 0:
            return self.images
        # Newest stored spill at or before ``want`` (a resumed run may find one), else the images.
        newest = max((i for i in range(want + 1) if self.spills.exists(i)), default=-1)
        if newest != want:
            base = self.images if newest < 0 else self.spills.open(newest)
            layer_ids = [i for b in self.blocks[newest + 1 : want + 1] for i in b.layers]
            last = layer_ids[-1]
            outputs = block_output_stream(
                base,
                [self.net.layers[i] for i in layer_ids],
                self.net.info[last].out_shape,
                last,
                splits=SPILLED_SPLITS,
            )
            lineage = {
                "recipe": self.ctx.recipe_name,
                "stage": self.name,
                "type": f"{self.stage.type_name}@{self.stage.version}",
                "spill_after_block": want,
                "layers": [0, layer_ids[-1]],
            }
            total = sum(s.num_samples for s in outputs.spec.splits.values())
            t0 = time.perf_counter()
            with self.ctx.progress.bar(total, f"{self.name}: spill after block {want}", unit="img") as bar:
                self.spills.write(want, outputs, lineage, progress=bar)
            self.spill_seconds += time.perf_counter() - t0
            self.spilled.append(want)
        for older in range(want):  # the block after them is trained and its spill stored
            if self.spills.exists(older):
                self.spills.drop(older)
        self.source, self.source_after = self.spills.open(want), want
        return self.source

    # ------------------------------------------------------------------ blocks
    def train(self, block: Block) -> None:
        layers = [self.local[i] for i in block.layers]
        fp = derived_fingerprint(self.fingerprint, f"block-{block.index}")
        held = self.catalog.try_use(fp)
        if held is not None:
            with held as entry:
                history = self._load(entry.path, layers)
            self.status[block.index] = "reused"
            self.log(f"block {block.index}: reusing the stored trained block {fp[:12]}")
        else:
            history = self._train(block, layers, fp)
        for i, acc in zip(block.layers, history[-1]["val_acc"], strict=True):
            self.val_acc[i] = acc

    def _load(self, path: Path, layers: list[LocalLayer]) -> list[dict[str, Any]]:
        state, _ = load_weights(Path(path) / "weights.pt")
        nn.ModuleList(layers).load_state_dict(state)
        return list(build_record.read(Path(path), "history.json"))

    def _train(self, block: Block, layers: list[LocalLayer], fp: str) -> list[dict[str, Any]]:
        cfg = self.stage.train
        lineage = {
            "recipe": self.ctx.recipe_name,
            "stage": self.name,
            "type": f"{self.stage.type_name}@{self.stage.version}",
            "block": block.index,
            "layers": list(block.layers),
            "batch_size": block.batch_size,
        }
        source = self._input_for(block.index)
        n_train = source.spec.splits["train"].num_samples
        trained: list[list[dict[str, Any]]] = []

        def build(staging: Staging) -> dict[str, Any]:
            state = BlockState.create(layers, cfg)
            checkpoint = staging.path / "state.pt"
            if checkpoint.exists():
                state.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
                self.log(f"block {block.index}: resuming local learning after epoch {state.epoch}")
            names = [self.net.info[i].name for i in block.layers]

            def on_epoch(state: BlockState, record: dict[str, Any]) -> None:
                save_atomic(state.state_dict(), checkpoint)  # a crash resumes after this epoch
                best = max([*self.val_acc.values(), *record["val_acc"]])
                self.curve.append((time.perf_counter() - self.started, best))
                self.ctx.metrics_log({"stage": self.name, "block": block.index, "layers": names, **record})
                accs = " ".join(f"{a:.3f}" for a in record["val_acc"])
                self.log(
                    f"block {block.index} epoch {record['epoch']}: val acc per layer {accs} "
                    f"({record['epoch_seconds']:.2f}s)"
                )

            steps = -(-n_train // block.batch_size)
            with self.ctx.progress.bar(
                (cfg.epochs - state.epoch) * n_train, f"{self.name}: block {block.index}", unit="img"
            ) as bar, out_of_memory_named(self.name, block, self.ctx.torch_device):
                train_block(
                    state,
                    self.stage._train_batches(source, block.batch_size),
                    lambda: self.stage._eval_batches(source, per_epoch=True),
                    cfg,
                    steps_per_epoch=steps,
                    layer_names=names,
                    on_epoch=on_epoch,
                    progress=bar.update,
                )
            save_weights(nn.ModuleList(layers), staging.path / "weights.pt", {"block": block.index})
            build_record.write(staging.path, "history.json", state.history)  # epoch times to build.json
            checkpoint.unlink()
            trained.append(state.history)
            return {"block": block.index, "layers": list(block.layers), "batch_size": block.batch_size}

        # The catalog's one look-up-or-build-and-commit sequence, as the runner's: another run may
        # have trained this block meanwhile, and then its entry is taken instead.
        built = self.catalog.reuse_or_build(fp, BLOCK_KIND, lineage, build, resume=True)
        with built.use as entry:
            if built.reused:
                self.status[block.index] = "reused"
                return self._load(entry.path, layers)
        self.status[block.index] = "trained"
        return trained[0]

    def finish(self) -> None:
        """The last block is trained: the spill it read from is no longer needed."""
        if self.source_after >= 0:
            self.spills.drop(self.source_after)

    def spill_report(self) -> list[dict[str, Any]]:
        """Spill sizes against the dataset's: stored bytes per sample over the input image's."""
        c, h, w = self.net.in_shape
        rows = []
        for block, (size, samples) in sorted(self.spills.sizes.items()):
            layer = self.blocks[block].layers[-1]
            rows.append(
                {
                    "after_block": block,
                    "after_layer": layer,
                    "shape": list(self.net.info[layer].out_shape),
                    "bits": self.stage.spill.bits,
                    "bytes": size,
                    "samples": samples,
                    "bytes_per_sample": size / samples,
                    # The paper compares with the dataset as stored: 8-bit images at the model's input size.
                    "over_dataset_uint8": size / (samples * c * h * w),
                    "over_input_float32": size / (samples * 4 * c * h * w),
                }
            )
        return rows


@contextmanager
def out_of_memory_named(stage: str, block: Block, device: torch.device) -> Iterator[None]:
    """Out of memory while block ``block`` trains: the error names it and its batch size (the trained
    epochs stay checkpointed; a rerun continues after the last one)."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(exc, stage=f"{stage} (block {block.index})", batch_size=block.batch_size,
                            setting=f"stages.{stage}.memory_budget_mib (it sets the block's batch) or "
                            f"stages.{stage}.batch_cap", device=device,
                            during=f"local learning of layers {block.layers[0]}-{block.layers[-1]}",
                            resumes="A rerun continues after the last trained block") from None


def save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    tmp.replace(path)
