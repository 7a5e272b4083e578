"""Decoded images as a stream: the batches a frozen forward or a trainer reads from a dataset.

Shared by the decode stage and by trainers that read images themselves (pretrain), so
neither imports the other.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import numpy as np
from pydantic import Field

from ..device import pin
from ..lazy import lazy_module
from ..ops.batching import Batch
from ..ops.prefetch import on_prefetch_thread, prefetch
from ..recipe_model import RecipeModel
from ..spec import Spec
from ..stream import Stream, StreamStats
from .dataset import DatasetValue
from .decode import Decoder, InputAugment
from .sampleset import Images, Raw, concat_images

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

#: Where decoding and input augmentation run (see DatasetStream); a recipe may also say "auto".
CpuWork = Literal["background", "between_steps"]
CPU_WORK: tuple[str, ...] = get_args(CpuWork)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class AugmentConfig(RecipeModel):
    """Input-space augmentation; applied to the splits in ``splits`` only."""

    random_resized_crop: tuple[float, float] | None = Field(None, description="scale range, e.g. [0.5, 1.0]")
    crop_padding: int | None = Field(None, ge=0, description="pad then random crop back to size")
    hflip: float = Field(0.0, ge=0.0, le=1.0)
    splits: tuple[str, ...] = ("train",)


class DatasetStream(Stream):
    """Batches of decoded, normalized images of one dataset, read ahead by a background thread.

    Where the CPU half of loading (pixel decoding, input augmentation) runs is ``cpu_work``:

    - ``"background"``: on the prefetch thread with the file reads, concurrently with the
      consumer. Right when the consumer's compute leaves cores idle (an accelerator does the
      math): decoding is then free.
    - ``"between_steps"``: the prefetch thread only reads files (it mostly waits on storage),
      and the consumer decodes each batch on ``threads`` threads when it asks for it. Right when
      compute already fills every core (a CPU device): a decoder running beside it preempts one
      of torch's worker threads, and the others stall at the next barrier until it returns, so a
      background decoder costs more wall time than its own CPU time; spread over all cores
      between steps it costs its CPU time divided by the cores. When the stream is itself pulled
      by a prefetch thread, there are no steps on it to fit between, and it decodes as "background".

    With ``pin_memory`` (the consumer computes on a GPU) the finished images are page-locked, and in
    "background" placement the resize and normalization run on the loader thread too: the GPU does
    the compute, so the CPU threads' only job is to keep it fed, and a pinned batch leaves the
    consumer's thread nothing but issuing an asynchronous copy.
    """

    def __init__(
        self,
        data: DatasetValue,
        spec: Spec,
        decoder: Decoder,
        augment: InputAugment | None,
        augment_splits: tuple[str, ...],
        batch_size: int,
        prefetch_depth: int,
        cpu_work: str = "background",
        threads: int = 1,
        pin_memory: bool = False,
    ) -> None:
        if cpu_work not in CPU_WORK:
            raise ValueError(f"cpu_work must be one of {CPU_WORK}, got {cpu_work!r}")
        self.data = data
        self.spec = spec
        self.decoder = decoder
        self.augment = augment
        self.augment_splits = augment_splits
        self.batch_size = batch_size
        self.prefetch_depth = prefetch_depth
        self.cpu_work = cpu_work
        self.threads = max(1, int(threads))
        # For a GPU consumer: images are made in page-locked memory, so their copy to the device
        # (pipeline.ops.device_feed) is asynchronous and overlaps the forward.
        self.pin_memory = pin_memory
        self.stats = StreamStats()

    def open(
        self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0, start: int = 0
    ) -> Iterator[Batch]:
        samples = self.data.splits[split]
        n = len(samples)
        if shuffle:
            if start:
                raise ValueError("start (resume) is only defined for the unshuffled order")
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).numpy()
        else:
            order = np.arange(start, n)
        n = len(order)
        augment = self.augment if split in self.augment_splits else None
        labels = np.asarray(samples.labels)
        # Nothing to spread when loading is a memory copy and nothing is augmented; and when this
        # stream is itself pulled by a prefetch thread (NeuroFlux, finetune's read-ahead), there are
        # no steps on this thread to fit between: decode on the loader thread, one thread beside compute.
        between = (
            self.cpu_work == "between_steps"
            and (samples.decodes or augment is not None)
            and not on_prefetch_thread()
        )

        def pixels(raw: Raw, idx: np.ndarray) -> Images:
            """The CPU half: decode, then augment (per-sample seeds: any split into parts gives the same)."""
            images = samples.decode(raw)
            return images if augment is None else augment(images, idx, epoch=epoch, seed=seed)

        # GPU consumer, background placement: the whole CPU half, normalization included, on the loader,
        # its decoding spread over ``threads`` threads: a GPU's frozen forward takes thousands of images
        # a second, which one decoding thread cannot supply.
        finished = self.pin_memory and not between
        busy = samples.decodes or augment is not None
        spread = (between or (finished and busy)) and self.threads > 1
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"decode-{split}") if spread else None

        def loaded() -> Iterator[tuple[np.ndarray, Any]]:
            # Background thread: file reads always; decoding and augmentation too unless they run
            # between steps (PIL, OpenCV and albumentations release the GIL in their heavy parts).
            for pos in range(0, n, self.batch_size):
                t0 = time.perf_counter()
                idx = order[pos : pos + self.batch_size]
                raw = samples.read(idx)
                item: Any = raw
                if finished:
                    item = pixels(raw, idx) if pool is None else self._spread(pool, pixels, raw, idx)
                    item = pin(self.decoder(item))
                elif not between:
                    item = pixels(raw, idx)
                self.stats.add(time.perf_counter() - t0, len(idx))
                yield idx, item

        # The consumer's thread: resize + normalize are parallel torch ops. Run from a second
        # thread they start a second OpenMP team that fights the consumer's (frozen forward,
        # training) for the same cores and slows it by more than their own cost; here they run
        # on the consumer's team, between its own ops.
        ready = cast(Generator[tuple[np.ndarray, Any], None, None],
                     prefetch(loaded(), self.prefetch_depth, name=f"decode-{split}"))
        try:
            for idx, item in ready:
                t0 = time.perf_counter()
                if between:
                    item = pixels(item, idx) if pool is None else self._spread(pool, pixels, item, idx)
                x = item if finished else self.decoder(item)
                if self.pin_memory:
                    x = pin(x)
                self.stats.add(time.perf_counter() - t0, batches=0)  # counted by the loader
                yield {
                    "x": x,
                    "y": torch.from_numpy(labels[idx].astype(np.int64)),
                    "id": torch.from_numpy(idx.astype(np.int64)),
                }
        finally:
            ready.close()  # an abandoned stream stops its loader thread now, not at garbage collection
            if pool is not None:
                pool.shutdown(cancel_futures=True)

    def _spread(self, pool: ThreadPoolExecutor, pixels: Any, raw: Raw, idx: np.ndarray) -> Images:
        """``pixels(raw, idx)`` computed as ``threads`` contiguous parts in parallel, joined in order."""
        k = min(self.threads, len(idx))
        if k == 1:
            return pixels(raw, idx)
        bounds = np.linspace(0, len(idx), k + 1).astype(int)
        ends = zip(bounds[:-1], bounds[1:], strict=True)
        parts = [pool.submit(pixels, raw[a:b], idx[a:b]) for a, b in ends]
        return concat_images([part.result() for part in parts])


def placement(cpu_work: str, threads: int | None, device: str | torch.device) -> tuple[str, int]:
    """(placement, threads) for a DatasetStream: ``auto`` is between_steps on a CPU device, whose cores
    the consumer's compute already fills; threads default to torch's (``run.threads``)."""
    if cpu_work == "auto":
        cpu_work = "between_steps" if torch.device(device).type == "cpu" else "background"
    return cpu_work, threads or torch.get_num_threads()
