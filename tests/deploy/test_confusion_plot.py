"""The confusion matrix's class names never overlap and stay inside the picture, for few or many classes and
short or long names: their boxes are measured on the rendered figure."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pipeline.deploy.evaluate import LABEL_CHARS, Evaluation, confusion_figure, plot_confusion, tick_labels

FASHION = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
           "Ankle boot"]
LONG = [f"{kind}_photographed_in_the_garden" for kind in ("daisy", "dandelion", "rose", "sunflower", "tulip")]


def _evaluation(names: list[str]) -> Evaluation:
    rng = np.random.default_rng(0)
    k = len(names)
    confusion = rng.integers(0, 5, (k, k)) + np.diag(rng.integers(5, 40, k))
    return Evaluation("folder photos (test)", names, confusion, [])


def _separated(fig: object, labels: list, axis: str) -> None:
    """No two neighbouring labels share ink: level ones by their boxes, slanted ones by the distance
    between their parallel baselines against the height of a line of that text."""
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    boxes = [t.get_window_extent(renderer) for t in labels]
    figure = fig.bbox  # type: ignore[attr-defined]
    for box, label in zip(boxes, labels, strict=True):  # nothing cut off at the edge of the picture
        assert box.x0 >= -1 and box.y0 >= -1 and box.x1 <= figure.x1 + 1 and box.y1 <= figure.y1 + 1, (
            label.get_text(), box, figure)
    angle = labels[0].get_rotation() if axis == "x" else 0.0
    if angle == 0:
        for a, b in zip(boxes, boxes[1:], strict=False):
            if axis == "x":
                assert a.x1 <= b.x0 + 0.5, (a, b)
            else:  # y labels run downwards, one per row
                assert min(a.y0, b.y0) + min(a.height, b.height) <= max(a.y0, b.y0) + 0.5, (a, b)
        return
    ticks = [box.x1 if angle == 45 else (box.x0 + box.x1) / 2 for box in boxes]  # right-anchored at 45
    spacing = min(abs(b - a) for a, b in zip(ticks, ticks[1:], strict=False))
    probe = fig.text(0, 0, "Ag", fontsize=labels[0].get_fontsize())  # type: ignore[attr-defined]
    line = probe.get_window_extent(renderer).height
    probe.remove()
    assert spacing * math.sin(math.radians(angle)) >= line * 0.95, (angle, spacing, line)


@pytest.mark.parametrize(
    "names",
    [FASHION, LONG, ["a", "b"], [f"class_{i:03d}" for i in range(25)],
     [f"species {i} of 60" for i in range(60)]],
    ids=["fashion-10", "5-long-names", "2-short", "25-classes", "60-classes"],
)
def test_class_names_do_not_overlap(names: list[str]) -> None:
    fig = confusion_figure(_evaluation(names))
    (ax, _colorbar) = fig.axes
    fig.canvas.draw()
    _separated(fig, ax.get_xticklabels(), "x")
    _separated(fig, ax.get_yticklabels(), "y")


def test_long_names_are_shortened_on_the_plot_only(tmp_path: Path) -> None:
    labels = tick_labels(LONG + ["daisy_photographed_elsewhere"])
    assert all(len(label) <= LABEL_CHARS for label in labels)
    assert len(set(labels)) == len(labels)  # two names with the same start stay two labels
    assert labels[2] == "rose_photogra\u2026"
    result = _evaluation(LONG)
    assert plot_confusion(result, tmp_path / "cm.png").is_file()
    assert list(result.per_class()) == LONG  # the text and JSON keep the names whole
