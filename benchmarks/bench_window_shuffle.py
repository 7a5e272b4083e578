"""Accuracy effect of the cache reader's shuffle window, ``window_chunks`` (issue: SD-card storage).

The cache stage reads whole chunks (large sequential reads for slow storage), shuffles
the chunk order every epoch and the samples only within a window of ``window_chunks``
chunks. How random that is depends on the order the samples were *stored* in:

- Fashion-MNIST and digits come in their files' order, which is already mixed across
  classes: any window gives well-mixed batches;
- an ``image_folder`` source lists files class by class: stored in that order
  (``split`` with ``shuffle_train: false``) a cache is **class-sorted**, a chunk holds one
  or two classes, and a small window gives batches of one or two classes, which SGD with
  momentum handles badly;
- the ``split`` stage's default (``shuffle_train: true``) stores the train split in a
  seeded random order, so even a class-sorted source reaches the cache mixed.

This script measures all three: real Fashion-MNIST images (the first ``--train`` training
images, official test set), cached with the real writer (zarr, ``--chunk-samples`` per
chunk) in the source order, class-sorted, and in the order the real ``make_splits`` gives
the class-sorted images, read with the real ``StoredStream`` for
``window_chunks`` in {1, 4, 16, all chunks (a full shuffle each epoch)}, and a small top
(MLP 784-256-10 on the pixels as the "cached features", SGD + momentum) trained for a
few epochs, several seeds. Reports test accuracy (mean, std) and the mean number of
distinct classes per training batch. CPU only, about a minute on 2 cores.

Usage: python -m benchmarks.bench_window_shuffle [--seeds 0 1 2] [--root /usr/share/datasets/fashion-mnist]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks._meta import write_result
from pipeline.data.idx import read_idx
from pipeline.data.sampleset import ArraySampleSet
from pipeline.data.splits import make_splits
from pipeline.ops.batching import Batch, rechunk
from pipeline.ops.cache import StoredStream, write_stream
from pipeline.spec import STREAM, FieldSpec, Spec, SplitSpec
from pipeline.stream import Stream, StreamStats

DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")


class ArrayStream(Stream):
    """Fixed arrays as a stream, in the given order (what stage A would hand to the cache)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        fields = {"x": FieldSpec(tuple(x.shape[1:]), "float16"), "y": FieldSpec((), "int64")}
        self.spec = Spec(STREAM, int(y.max()) + 1, {"train": SplitSpec(len(x), fields)}, {})
        self.stats = StreamStats()
        self.x, self.y = x, y

    def open(
        self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0, start: int = 0
    ) -> Iterator[Batch]:
        for lo in range(start, len(self.x), 500):
            yield {
                "x": torch.from_numpy(self.x[lo : lo + 500]),
                "y": torch.from_numpy(self.y[lo : lo + 500]),
            }


def load(root: Path, n_train: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    def images(stem: str) -> np.ndarray:
        raw = read_idx(root / f"{stem}-images-idx3-ubyte.gz", ndim=3).reshape(-1, 784)
        return ((raw.astype(np.float32) / 255.0 - 0.2860) / 0.3530).astype(np.float16)

    def labels(stem: str) -> np.ndarray:
        return read_idx(root / f"{stem}-labels-idx1-ubyte.gz", ndim=1).astype(np.int64)

    return images("train")[:n_train], labels("train")[:n_train], images("t10k"), labels("t10k")


def train_top(
    stream: StoredStream,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    *,
    seed: int,
    epochs: int,
    batch: int,
    lr: float,
) -> tuple[float, float]:
    """Test accuracy of an MLP trained from ``stream``, and the mean number of classes per batch."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    classes_per_batch: list[int] = []
    for epoch in range(epochs):
        model.train()
        for b in rechunk(stream.open("train", epoch=epoch, shuffle=True, seed=seed), batch):
            classes_per_batch.append(int(torch.unique(b["y"]).numel()))
            opt.zero_grad()
            loss_fn(model(b["x"].float()), b["y"]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    return accuracy, float(np.mean(classes_per_batch))


def split_order(labels: np.ndarray) -> np.ndarray:
    """The train order the real split stage stores for samples given in this order (seed 0, no held-out)."""
    names = [str(c) for c in range(int(labels.max()) + 1)]
    source = ArraySampleSet(np.zeros((len(labels), 1, 1), np.uint8), labels, names, name="order-probe")
    train = make_splits(
        {"train": source}, classes=None, per_class=None, val_fraction=0.0, test_fraction=0.0, seed=0,
        use_official_test=False,
    )["train"]
    subset: Any = train  # the split's subset of the dataset: it has the indices
    return np.asarray(subset.indices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--train", type=int, default=10000)
    ap.add_argument("--chunk-samples", type=int, default=100)
    ap.add_argument(
        "--windows", type=int, nargs="+", default=[1, 4, 16], help="window_chunks; all chunks is added"
    )
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.02)
    args = ap.parse_args()
    torch.set_num_threads(2)
    x, y, x_test, y_test = load(args.root, args.train)
    xt, yt = torch.from_numpy(x_test.astype(np.float32)), torch.from_numpy(y_test)
    sample_bytes = 784 * 2 + 8
    class_sorted = np.argsort(y, kind="stable")  # how an image_folder source lists its samples
    orders = {
        "source_order": np.arange(len(x)),  # Fashion-MNIST's own (mixed) order
        "class_sorted": class_sorted,  # split with shuffle_train: false on an image_folder source
        "split_of_class_sorted": class_sorted[split_order(y[class_sorted])],  # the split stage's default
    }
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="window-") as tmp:
        for order_name, order in orders.items():
            entry = Path(tmp) / order_name
            entry.mkdir()
            write_stream(
                ArrayStream(x[order], y[order]),
                entry,
                chunk_bytes=args.chunk_samples * sample_bytes,
                compressor="zstd",
                level=3,
                attrs={},
            )
            probe = StoredStream(entry)
            n_chunks = probe.reader.num_chunks("train")
            stored_y = np.concatenate([probe.reader.read_chunk("train", i)["y"] for i in range(n_chunks)])
            classes_per_chunk = float(
                np.mean(
                    [
                        len(np.unique(stored_y[i : i + args.chunk_samples]))
                        for i in range(0, len(stored_y), args.chunk_samples)
                    ]
                )
            )
            for window in [*args.windows, n_chunks]:
                stream = StoredStream(entry, prefetch_depth=2, window_chunks=window)
                accs, mixes = [], []
                for seed in args.seeds:
                    acc, mix = train_top(
                        stream, xt, yt, seed=seed, epochs=args.epochs, batch=args.batch, lr=args.lr
                    )
                    accs.append(acc)
                    mixes.append(mix)
                row = {
                    "stored_order": order_name,
                    "window_chunks": window,
                    "full_shuffle": window >= n_chunks,
                    "window_samples": window * probe.reader.chunk_samples("train"),
                    "classes_per_chunk": classes_per_chunk,
                    "classes_per_batch": statistics.mean(mixes),
                    "accuracy_mean": statistics.mean(accs),
                    "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                    "accuracy_per_seed": accs,
                }
                rows.append(row)
                print(
                    f"{order_name:<21} window {window:>4} chunks"
                    f"{' (full)' if row['full_shuffle'] else '       '} "
                    f"classes/batch {row['classes_per_batch']:4.1f}  "
                    f"accuracy {100 * row['accuracy_mean']:5.2f} +- {100 * row['accuracy_std']:4.2f} %"
                )
    seconds = time.perf_counter() - start
    path = write_result(
        "window_shuffle_accuracy",
        {
            "question": "accuracy effect of the cache reader's shuffle window (window_chunks), "
            "for the stored orders the pipeline produces",
            "settings": {
                **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "data": "Fashion-MNIST (Debian dataset-fashion-mnist): first --train training images, "
                "official test set",
                "features": "normalised pixels (784, float16) standing in for cached features",
                "top": "MLP 784-256-10, SGD momentum 0.9, constant lr",
                "cache": "zarr via pipeline.ops.cache.write_stream, zstd 3, "
                "read with StoredStream (prefetch 2)",
                "stored_order_meaning": {
                    "source_order": "Fashion-MNIST/digits in their files' (mixed) order",
                    "class_sorted": "an image_folder source stored in its own order (split shuffle_train: "
                    "false): class by class",
                    "split_of_class_sorted": "the class-sorted samples after the split stage's default "
                    "(shuffle_train: true, seed 0): a seeded random order",
                },
                "seconds": seconds,
            },
            "rows": rows,
        },
    )
    print(f"wrote {path} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
