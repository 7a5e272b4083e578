"""Measure a model on labelled images: accuracy, per-class accuracy and a confusion matrix (PNG).

The images come from a class-per-folder tree (its ``test`` split when it has split folders) or
from a recipe's dataset stage (by default the one the model was trained on, ``test`` split), so a
run's model is measured on the very samples its run measured. Classes are matched by name: a
folder may hold a subset of the model's classes, not a class the model does not know.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..context import RunContext
from ..data.dataset import DatasetValue
from ..data.image_folder import (
    FileSampleSet,
    SkippedSamplesWarning,
    _image_files,
    _split_folders,
    _visible_dirs,
    image_folder,
)
from ..data.sampleset import SampleSet
from ..errors import DataError, RecipeError, did_you_mean
from ..spec import DATASET
from ..stage import StageCall
from .model_file import LoadedModel
from .predict import bad_sample_rule

BATCH = 128


@dataclass
class Labelled:
    """Samples to evaluate on, with labels already in the model's class indices."""

    samples: SampleSet
    labels: np.ndarray
    source: str  # what to call them in the output: "folder X (test)", "recipe R, stage S (test)"
    skipped: list[str] = field(default_factory=list)


@dataclass
class Evaluation:
    source: str
    class_names: list[str]
    confusion: np.ndarray  # [true, predicted] counts
    skipped: list[str]
    plot: str | None = None

    @property
    def samples(self) -> int:
        return int(self.confusion.sum())

    @property
    def accuracy(self) -> float:
        return float(np.trace(self.confusion) / max(1, self.samples))

    def per_class(self) -> dict[str, dict[str, Any]]:
        out = {}
        for i, name in enumerate(self.class_names):
            n = int(self.confusion[i].sum())
            correct = int(self.confusion[i, i])
            out[name] = {"samples": n, "correct": correct, "accuracy": correct / n if n else None}
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"data": self.source, "samples": self.samples, "accuracy": self.accuracy,
                "per_class": self.per_class(), "class_names": self.class_names,
                "confusion_matrix": self.confusion.tolist(), "skipped": self.skipped, "plot": self.plot}


def _to_model_classes(names: Sequence[str], labels: np.ndarray, loaded: LoadedModel,
                      where: str) -> np.ndarray:
    index = {name: i for i, name in enumerate(loaded.class_names)}
    unknown = [n for n in names if n not in index]
    if unknown:
        raise DataError(f"{where}: classes {unknown} are not classes of the model ({loaded.class_names}); "
                        "evaluate on images of the classes it was trained on (folder names must match)")
    mapping = np.array([index[n] for n in names], np.int64)
    return mapping[labels]


def _pick_split(splits: Sequence[str], split: str | None, where: str) -> str:
    if split is not None:
        if split not in splits:
            raise DataError(f"{where} has no split {split!r}; it has {list(splits)}")
        return split
    return next(s for s in ("test", "val", "train") if s in splits) if splits else "train"


def folder_samples(loaded: LoadedModel, root: Path, split: str | None, on_bad_sample: str | None) -> Labelled:
    """A class-per-folder tree (``test/`` when it has split folders), under the model's bad-image rule."""
    rule = bad_sample_rule(loaded, on_bad_sample)
    with warnings.catch_warnings():
        # The skipped files are listed in the result instead of a warning.
        warnings.simplefilter("ignore", SkippedSamplesWarning)
        sets = image_folder(root, on_bad_sample=rule)  # type: ignore[arg-type]
    kept = {p for s in sets.values() for p in s.paths}
    skipped = [str(f) for folder in _split_folders(Path(root)).values() for d in _visible_dirs(folder)
               for f in _image_files(d) if f not in kept]
    chosen = _pick_split(list(sets), split, f"image folder {root}")
    samples: FileSampleSet = sets[chosen]
    labels = _to_model_classes(samples.class_names, samples.labels, loaded, f"image folder {root}")
    where = f"folder {root}" + (f" ({chosen})" if chosen != "train" or len(sets) > 1 else "")
    return Labelled(samples, labels, where, skipped)


def _materialize(recipe: Any, name: str, ctx: RunContext, memo: dict[str, DatasetValue]) -> DatasetValue:
    """A dataset stage's value, its dataset inputs first (sources and splits are cheap: no pixels read)."""
    if name not in memo:
        stage = recipe.stages[name]
        inputs = {f: _materialize(recipe, ref, ctx, memo) for f, ref in stage.input_refs().items()}
        memo[name] = stage.run(ctx, inputs, StageCall(name, inputs={f: v.spec for f, v in inputs.items()}))
    return memo[name]


def recipe_samples(loaded: LoadedModel, recipe_path: Path, overrides: list[str], data: str | None,
                   split: str | None) -> Labelled:
    """A split of a recipe's dataset stage: by default the one the model was trained on."""
    import tempfile

    from stores.catalog import Catalog

    from ..recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    datasets = [n for n, s in recipe.stages.items() if s.kind == DATASET]
    name = data or loaded.metadata.get("produced_by", {}).get("dataset_stage")
    if name is None:
        raise RecipeError(f"{recipe_path}: the model does not record which dataset stage it was trained on; "
                          f"pass --data STAGE (one of {datasets})")
    if name not in recipe.stages or recipe.stages[name].kind != DATASET:
        raise RecipeError(f"{recipe_path}: no dataset stage {name!r}{did_you_mean(name, datasets)}; dataset "
                          f"stages: {', '.join(datasets)} (pick one with --data STAGE)")
    with tempfile.TemporaryDirectory(prefix="evaluate-") as scratch:  # dataset stages store nothing
        ctx = RunContext(catalog=Catalog(scratch), seed=recipe.seed, recipe_name=recipe.name,
                         recipe_path=str(recipe_path))
        value = _materialize(recipe, name, ctx, {})
    where = f"recipe {recipe_path}, stage {name}"
    chosen = _pick_split(list(value.splits), split, where)
    samples = value.splits[chosen]
    labels = _to_model_classes(value.class_names, samples.labels, loaded, where)
    return Labelled(samples, labels, f"{where} ({chosen})")


def evaluate(loaded: LoadedModel, data: Labelled) -> Evaluation:
    n = len(data.labels)
    if n == 0:
        raise DataError(f"{data.source}: no images to evaluate on")
    k = len(loaded.class_names)
    confusion = np.zeros((k, k), np.int64)
    with torch.inference_mode():
        for start in range(0, n, BATCH):
            idx = np.arange(start, min(n, start + BATCH))
            images = data.samples.load(idx)
            x = loaded.transform.batch(list(images))
            predicted = loaded(x).argmax(1).numpy()
            np.add.at(confusion, (data.labels[idx], predicted), 1)
    return Evaluation(data.source, list(loaded.class_names), confusion, list(data.skipped))


# Class names longer than this are shortened on the plot's axes (the text output and JSON keep them whole).
LABEL_CHARS = 14


def tick_labels(names: Sequence[str]) -> list[str]:
    """Axis labels for the classes: long names cut to ``LABEL_CHARS`` with an ellipsis, kept distinct."""
    labels: list[str] = []
    for name in names:
        label = name if len(name) <= LABEL_CHARS else name[: LABEL_CHARS - 1] + "\u2026"
        if label in labels:  # two names with the same start: number them rather than print the same label
            label = f"{label[: LABEL_CHARS - 3]}\u2026{len(labels)}"
        labels.append(label)
    return labels


def confusion_figure(result: Evaluation) -> Any:
    """The confusion-matrix figure: rows normalized, counts written in, class names laid out by count.

    Names along the x axis are level while they fit beside each other, slanted at 45 degrees when
    they do not, upright at 90 when the classes are many; the font shrinks with the count, so no two
    names overlap (tests/deploy/test_confusion_plot.py measures their boxes).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    k = len(result.class_names)
    counts = result.confusion
    rates = counts / np.maximum(1, counts.sum(axis=1, keepdims=True))
    labels = tick_labels(result.class_names)
    longest = max((len(label) for label in labels), default=1)
    fontsize = 10 if k <= 10 else 8 if k <= 20 else 6 if k <= 40 else 4
    size = min(14.0, 3.0 + 0.45 * k + 0.06 * longest)
    fig = Figure(figsize=(size, size))
    FigureCanvasAgg(fig)  # the Agg canvas, without choosing a process-wide backend
    ax = fig.add_subplot()
    image = ax.imshow(rates, vmin=0, vmax=1, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    # The width one class has on the x axis, in characters of the chosen font (about 0.6 em each).
    per_class = (size * 0.7 / max(1, k)) * 72 / (0.6 * fontsize)
    rotation = 0 if longest <= per_class * 0.9 else 45 if k <= 20 else 90
    ax.set_xticks(range(k), labels, rotation=rotation, fontsize=fontsize,
                  ha={0: "center", 45: "right", 90: "center"}[rotation],
                  rotation_mode="anchor" if rotation == 45 else "default")
    ax.set_yticks(range(k), labels, fontsize=fontsize)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"accuracy {result.accuracy:.3f} on {result.samples} images")
    if k <= 30:
        for i in range(k):
            for j in range(k):
                if counts[i, j]:
                    ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=min(8, fontsize),
                            color="white" if rates[i, j] > 0.5 else "black")
    fig.tight_layout()
    return fig


def plot_confusion(result: Evaluation, path: Path) -> Path:
    """The confusion matrix (:func:`confusion_figure`) as a PNG at ``path``."""
    fig = confusion_figure(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Title": f"confusion matrix: {result.source}"})
    return path


def render(result: Evaluation) -> str:
    lines = [f"{result.source}: {result.samples} images, accuracy {result.accuracy:.4f}"]
    width = max(5, *(len(c) for c in result.class_names))
    lines.append(f"  {'class':<{width}}  samples  accuracy")
    for name, row in result.per_class().items():
        acc = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
        lines.append(f"  {name:<{width}}  {row['samples']:>7}  {acc:>8}")
    if result.skipped:
        lines.append(f"  skipped {len(result.skipped)} unreadable image(s) (on_bad_sample: skip)")
    if result.plot:
        lines.append(f"  confusion matrix: {result.plot}")
    return "\n".join(lines)
