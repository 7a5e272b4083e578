"""Run a model on image files and folders: the top-k classes of each image, with probabilities.

Unreadable images follow the rule of the data the model was trained on (its recipe's
``on_bad_sample``, recorded in the model file; ``fail`` unless that data was an image folder set
to ``skip``), or the one a caller passes: ``fail`` stops at the first, naming it; ``skip`` leaves
it out and lists it with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.image_folder import IMAGE_SUFFIXES, _image_files
from ..errors import DataError, MissingPathError
from .model_file import LoadedModel, as_pixels

BATCH = 64
BAD_SAMPLE_RULES = ("fail", "skip")


@dataclass
class Prediction:
    file: str
    top: list[tuple[str, float]]  # (class name, probability), most likely first

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "class": self.top[0][0], "probability": self.top[0][1],
                "top": [{"class": c, "probability": p} for c, p in self.top]}


@dataclass
class Predictions:
    predictions: list[Prediction] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"file", "error"}


def image_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files named, and the images under the folders named (recursively, sorted); checked up front."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            found = _image_files(path)
            if not found:
                raise DataError(f"{path}: folder holds no images (expected files ending in "
                                f"{', '.join(sorted(IMAGE_SUFFIXES))})")
            files += found
        elif path.exists():
            files.append(path)
        else:
            raise MissingPathError(f"image not found: {path} (expected an image file or a folder of images)")
    return files


def bad_sample_rule(loaded: LoadedModel, override: str | None) -> str:
    rule = override or str(loaded.metadata.get("produced_by", {}).get("on_bad_sample") or "fail")
    if rule not in BAD_SAMPLE_RULES:
        raise DataError(f"on_bad_sample must be one of {list(BAD_SAMPLE_RULES)}, found {rule!r}")
    return rule


def decoded_batches(loaded: LoadedModel, files: Sequence[Path], rule: str,
                    skipped: list[dict[str, str]]) -> Iterator[tuple[list[Path], torch.Tensor]]:
    """(files, model input) in batches; an unreadable file raises (``fail``) or is listed in ``skipped``."""
    for start in range(0, len(files), BATCH):
        good, pixels = [], []
        for path in files[start:start + BATCH]:
            try:
                pixels.append(as_pixels(path))
            except DataError as exc:
                if rule == "fail":
                    raise DataError(f"{exc} (on_bad_sample: fail; pass --on-bad-sample skip to leave "
                                    "unreadable images out)") from None
                skipped.append({"file": str(path), "error": str(exc)})
                continue
            good.append(path)
        if good:
            yield good, loaded.transform.batch(pixels)


def predict(loaded: LoadedModel, inputs: Sequence[str | Path], *, top_k: int = 1,
            on_bad_sample: str | None = None) -> Predictions:
    if top_k < 1:
        raise DataError(f"--top-k must be >= 1, found {top_k}")
    k = min(top_k, len(loaded.class_names))
    files = image_files(inputs)
    out = Predictions()
    rule = bad_sample_rule(loaded, on_bad_sample)
    with torch.inference_mode():
        for batch_files, x in decoded_batches(loaded, files, rule, out.skipped):
            probs = torch.softmax(loaded(x).float(), dim=1)
            values, indices = probs.topk(k, dim=1)
            for path, vs, ix in zip(batch_files, values.tolist(), indices.tolist(), strict=True):
                top = [(loaded.class_names[i], float(v)) for v, i in zip(vs, ix, strict=True)]
                out.predictions.append(Prediction(str(path), top))
    return out


def render(result: Predictions) -> str:
    """A table: file, class, probability, then the runners-up when top-k > 1."""
    if not result.predictions:
        return "no images could be read"
    width = max(len(p.file) for p in result.predictions)
    rows = []
    for p in result.predictions:
        (name, prob), rest = p.top[0], p.top[1:]
        more = "  (" + ", ".join(f"{c} {v:.3f}" for c, v in rest) + ")" if rest else ""
        rows.append(f"{p.file:<{width}}  {name}  {prob:.3f}{more}")
    return "\n".join(rows)
