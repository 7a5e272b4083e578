"""Train a classifier head of your own on the quickstart's cached features, with a plain PyTorch loop.

    python examples/train_own_head.py [--store DIR] [--epochs N] [--workers N] [--set KEY=VALUE ...]

1. Builds the quickstart's feature cache through the Python API, or reuses it when it is stored
   (after `python -m pipeline run recipes/quickstart.yaml`, training starts at once): the frozen
   bottom of the pretrained backbone runs once, its outputs are stored at 2 bits per value.
2. Reads the cache with ``pipeline.cache_dataset`` through a ``DataLoader`` with worker processes:
   dequantized, augmented in feature space as the recipe's two_stage trainer augments them, each
   sample once per epoch whatever the number of workers.
3. Trains a small convolutional head (yours: not the backbone's top blocks) and reports its accuracy
   on the test split.

``--set`` takes the CLI's recipe overrides, e.g. ``--set stages.quantized.bits=4`` (a new cache).
Exit codes as the CLI's: 0 done, 1 a failure while working (a damaged cache), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import pipeline
from pipeline.errors import PipelineError
from pipeline.recipe import Recipe

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"


def arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--recipe", default=str(QUICKSTART), help="a recipe with a cache stage (the quickstart)")
    p.add_argument("--stage", default="cache", help="its cache stage (default: cache)")
    p.add_argument("--store", help="store directory (default: the recipe's, $ONDEVICE_TL_STORE or per-user)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, as `python -m pipeline run --set` does (repeatable)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def cached_recipe(args: argparse.Namespace) -> Recipe:
    """The recipe, its cache stage built first if the store does not hold it yet."""
    recipe = pipeline.load_recipe(args.recipe, args.overrides)
    stage = recipe.stages.get(args.stage)
    if stage is None or not stage.cacheable or stage.kind != "stream":
        cached = [name for name, s in recipe.stages.items() if s.cacheable and s.kind == "stream"]
        raise PipelineError(
            f"{args.recipe}: {args.stage!r} is not a cache stage of the recipe; its cache stages: "
            f"{', '.join(cached) or 'none'}"
        )
    only_cache = recipe.model_copy(update={"targets": (args.stage,)})
    row = next(r for r in pipeline.plan(only_cache, store=args.store) if r.name == args.stage)
    if row.action == "reuse":
        print(f"reusing the stored cache {row.fingerprint[:12]} of {recipe.name}:{args.stage}")
    else:
        print(f"building the cache {recipe.name}:{args.stage} once (what it needs upstream too) ...")
        result = pipeline.run(recipe, {"targets": [args.stage]}, store=args.store)
        print(result.summary_line)
    return recipe


def make_head(channels: int, num_classes: int) -> nn.Module:
    """Your own head over (C, H, W) feature maps: two 3x3 convolutions, pooling, a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(channels, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(64, num_classes),
    )


@torch.no_grad()
def accuracy(head: nn.Module, loader: DataLoader) -> float:
    head.eval()
    correct = total = 0
    for x, y in loader:
        correct += int((head(x).argmax(1) == y).sum())
        total += len(y)
    return correct / max(1, total)


def train(args: argparse.Namespace) -> float:
    recipe = cached_recipe(args)
    read = {"stage": args.stage, "store": args.store}
    # Training batches come out of the dataset already formed: the DataLoader gets batch_size=None.
    train_set = pipeline.cache_dataset(recipe, "train", batch_size=args.batch_size, shuffle=True,
                                       augment=True, seed=args.seed, **read)
    val_set = pipeline.cache_dataset(recipe, "val", batch_size=256, **read)
    test_set = pipeline.cache_dataset(recipe, "test", batch_size=256, **read)
    train_loader = DataLoader(train_set, batch_size=None, num_workers=args.workers)
    val_loader, test_loader = DataLoader(val_set, batch_size=None), DataLoader(test_set, batch_size=None)

    torch.manual_seed(args.seed)
    head = make_head(train_set.feature_shape[0], train_set.num_classes)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    print(f"training a {sum(p.numel() for p in head.parameters())}-parameter head on {train_set.num_samples} "
          f"cached samples of shape {train_set.feature_shape}, {train_set.num_classes} classes, "
          f"{args.workers} loader workers")
    for epoch in range(args.epochs):
        start = time.perf_counter()
        train_set.set_epoch(epoch)  # a new shuffle and new augmentation draws in every worker
        head.train()
        total_loss, seen = 0.0, 0
        for x, y in train_loader:
            loss = loss_fn(head(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(y)
            seen += len(y)
        schedule.step()
        print(f"epoch {epoch}: loss {total_loss / seen:.3f} val acc {accuracy(head, val_loader):.3f} "
              f"({time.perf_counter() - start:.2f}s)")
    test = accuracy(head, test_loader)
    for dataset in (train_set, val_set, test_set):
        dataset.close()  # the entry may be evicted again
    print(f"own head on cache {train_set.fingerprint[:12]}: test accuracy {test:.3f}")
    return test


def _message(exc: BaseException) -> str:
    """The error's own message (a DataLoader worker's error carries the worker's traceback before it)."""
    text = str(exc)
    if "Original Traceback" in text:
        last = text.strip().splitlines()[-1]
        return last.split(": ", 1)[-1]
    return text


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    try:
        train(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a missing path is bad input; anything else, storage failing while working
        print(f"error: {_message(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, FileNotFoundError) else 1
    except (PipelineError, ValueError) as exc:  # the recipe, the store or an argument
        print(f"error: {_message(exc)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
