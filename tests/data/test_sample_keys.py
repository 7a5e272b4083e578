"""A sample's content key is a function of its own bytes: not of its place, its label or the other samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.data.image_folder import image_folder
from pipeline.data.sampleset import ArraySampleSet, GeneratedSampleSet


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 4, 4), dtype=np.uint8)


def test_array_keys_follow_content_not_position_or_label() -> None:
    x = images(6)
    a = ArraySampleSet(x, [0, 1, 0, 1, 0, 1], ["a", "b"], name="a")
    b = ArraySampleSet(x[::-1].copy(), [1, 1, 1, 0, 0, 0], ["a", "b"], name="b")
    assert a.sample_keys().dtype == np.dtype("S16") and len(set(a.sample_keys())) == 6
    assert list(b.sample_keys()) == list(a.sample_keys()[::-1])  # moved and relabelled: same keys
    grown = ArraySampleSet(np.concatenate([x, images(2, seed=1)]), [0] * 8, ["a"], name="g")
    assert list(grown.sample_keys()[:6]) == list(a.sample_keys())  # others arriving change nothing
    duplicate = ArraySampleSet(np.stack([x[0], x[0]]), [0, 1], ["a", "b"], name="d")
    assert duplicate.sample_keys()[0] == duplicate.sample_keys()[1]


def test_a_reshaped_image_is_another_sample() -> None:
    x = images(1)
    assert (ArraySampleSet(x, [0], ["a"], name="a").sample_keys()[0]
            != ArraySampleSet(x.reshape(1, 2, 8), [0], ["a"], name="b").sample_keys()[0])


def test_subset_keys_are_the_parents() -> None:
    a = ArraySampleSet(images(5), [0] * 5, ["a"], name="a")
    assert list(a.subset([3, 1]).subset([1]).sample_keys()) == [a.sample_keys()[1]]


def test_generated_keys_name_generator_and_index() -> None:
    def make(i: int) -> np.ndarray:
        return np.full((2, 2), i, np.uint8)

    g = GeneratedSampleSet(make, [0] * 3, ["a"], name="g", content_id="gen1")
    h = GeneratedSampleSet(make, [0] * 4, ["a"], name="h", content_id="gen1")
    assert list(h.sample_keys()[:3]) == list(g.sample_keys()) and len(set(h.sample_keys())) == 4


def test_file_keys_are_the_files_content(tmp_path: Path) -> None:
    for cls, seeds in {"cat": [0, 1], "dog": [2]}.items():
        (tmp_path / cls).mkdir()
        for s in seeds:
            Image.fromarray(images(1, seed=s)[0]).save(tmp_path / cls / f"{s}.png")
    before = set(image_folder(tmp_path)["train"].sample_keys())
    (tmp_path / "dog" / "2.png").rename(tmp_path / "dog" / "renamed.png")  # a name is not content
    Image.fromarray(images(1, seed=9)[0]).save(tmp_path / "cat" / "9.png")  # a new sample arrives
    after = image_folder(tmp_path)["train"]
    assert before < set(after.sample_keys())
    assert len(after.sample_keys()) == 4
