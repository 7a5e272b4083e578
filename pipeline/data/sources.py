"""Dataset sources: each returns ``{split: SampleSet}`` with class names shared by all splits.

Nothing here downloads unless asked (``download=True``): the toolkit targets devices
without internet, so a missing dataset is an error that says where we looked and
how to provide the files.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError, MissingPathError
from .identity import hash_array, hash_json
from .idx import idx_sampleset
from .image_folder import image_folder
from .sampleset import ArraySampleSet, GeneratedSampleSet, SampleSet

__all__ = ["cifar10", "cifar100", "digits", "fashion_mnist", "image_folder", "synthetic"]

FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                   "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
FASHION_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                 "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
#: Where distribution packages put Fashion-MNIST
#: (Debian's dataset-fashion-mnist: /usr/share/datasets/fashion-mnist).
FASHION_SYSTEM_GLOBS = ("share/datasets/*ashion*mnist*", "share/*ashion*mnist*")
FASHION_PREFIXES = ("/usr", "/usr/local")


# --------------------------------------------------------------------------- digits
def digits() -> dict[str, SampleSet]:
    """scikit-learn's bundled 8x8 digits (1797 samples, 10 classes); no official test split.

    Pixel values 0..16 are scaled to 0..255 so the set looks like any other uint8 image data.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.rint(np.asarray(bunch.images) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    names = [str(n) for n in bunch.target_names]
    return {"train": ArraySampleSet(images, bunch.target, names, name="digits/train",
                                    content_id=hash_json({"format": "digits", "images": hash_array(images)}))}


# --------------------------------------------------------------------------- fashion-mnist
def _fashion_file(folder: Path, stem: str) -> Path | None:
    """``stem.gz`` or ``stem``; .gz first so identity does not depend on extraction."""
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def _fashion_candidates(root: Path | None) -> list[Path]:
    if root is not None:
        return [root, root / "FashionMNIST" / "raw", root / "fashion-mnist"]
    prefixes = dict.fromkeys([*FASHION_PREFIXES, sys.prefix])
    found: list[Path] = []
    for prefix in prefixes:
        for pattern in FASHION_SYSTEM_GLOBS:
            found += sorted(p for p in Path(prefix).glob(pattern) if p.is_dir())
    return found or [Path(FASHION_PREFIXES[0]) / "share/datasets/fashion-mnist"]


def _find_fashion(root: Path | None) -> tuple[dict[str, tuple[Path, Path]] | None, list[Path], list[str]]:
    """The four files from the first folder that holds them all, plus where we looked and what was missing."""
    candidates = _fashion_candidates(root)
    partial_missing: list[str] = []
    for folder in candidates:
        files = {split: (_fashion_file(folder, img), _fashion_file(folder, lab))
                 for split, (img, lab) in FASHION_FILES.items()}
        missing = [f"{stem}.gz" for split, stems in FASHION_FILES.items()
                   for stem, path in zip(stems, files[split], strict=True) if path is None]
        if not missing:
            return files, candidates, []  # type: ignore[return-value]
        if len(missing) < 4 and not partial_missing:
            partial_missing = [str(folder / m) for m in missing]
    return None, candidates, partial_missing


def fashion_mnist(root: str | Path | None = None, download: bool = False) -> dict[str, SampleSet]:
    """Fashion-MNIST (60000 train / 10000 test, 28x28 grayscale, 10 classes) from its four idx .gz files.

    With ``root=None`` the files of Debian's ``dataset-fashion-mnist`` package (or a
    similar system install) are found automatically; otherwise ``root`` may hold the
    files directly or in torchvision's ``FashionMNIST/raw`` layout. Pixels are read
    on first use; headers, sizes and counts are validated now.
    """
    root_path = Path(root).expanduser() if root is not None else None
    files, looked, partial_missing = _find_fashion(root_path)
    if files is None and download:
        if root_path is None:
            raise MissingPathError("fashion_mnist: `download: true` needs `root:` (where to download to)")
        try:
            from torchvision.datasets import FashionMNIST

            FashionMNIST(str(root_path), train=True, download=True)
        except (OSError, RuntimeError) as exc:
            raise MissingPathError(f"fashion_mnist: download into {root_path} failed: {exc}") from exc
        files, looked, partial_missing = _find_fashion(root_path)
    if files is None:
        where = ", ".join(str(p) for p in looked)
        detail = f"; missing {', '.join(partial_missing)}" if partial_missing else ""
        names = ", ".join(f"{stem}.gz" for pair in FASHION_FILES.values() for stem in pair)
        raise MissingPathError(
            f"fashion_mnist: the idx files ({names}) were not found in {where}{detail}. "
            f"Fix: `apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or set `root:` to a folder "
            f"holding the four files, or set `download: true` with `root:`")
    return {split: idx_sampleset(img, lab, FASHION_CLASSES, name=f"fashion_mnist/{split}",
                                 image_shape=(28, 28))
            for split, (img, lab) in files.items()}


# --------------------------------------------------------------------------- cifar
def _cifar(dataset_cls: Any, label: str, root: str | Path, download: bool) -> dict[str, SampleSet]:
    """Both splits of a torchvision CIFAR dataset as in-memory arrays.

    torchvision verifies every batch file against its published md5 when the dataset
    is constructed, so those checksums are an exact content identity at no extra cost.
    """
    root_path = Path(root).expanduser()
    folder = root_path / dataset_cls.base_folder
    if not download and not folder.is_dir():
        raise MissingPathError(f"{label}: {folder} not found; set `root:` to the folder that contains "
                               f"{dataset_cls.base_folder}/ (the extracted python version), "
                               f"or set `download: true`")
    sets: dict[str, SampleSet] = {}
    for split, train in (("train", True), ("test", False)):
        try:
            ds = dataset_cls(str(root_path), train=train, download=download and train)
        except RuntimeError as exc:
            raise DataError(f"{label}: {folder} is incomplete or corrupt ({exc}); replace its files with the "
                            f"official {dataset_cls.base_folder} release") from exc
        checksums = dataset_cls.train_list if train else dataset_cls.test_list
        sets[split] = ArraySampleSet(np.asarray(ds.data, np.uint8), np.asarray(ds.targets, np.int64),
                                     list(ds.classes), name=f"{label}/{split}",
                                     content_id=hash_json({"format": label, "files": checksums}))
    return sets


def cifar10(root: str | Path, download: bool = False) -> dict[str, SampleSet]:
    """CIFAR-10 (50000 train / 10000 test, 32x32 RGB) via torchvision; downloads only if asked."""
    from torchvision.datasets import CIFAR10

    return _cifar(CIFAR10, "cifar10", root, download)


def cifar100(root: str | Path, download: bool = False) -> dict[str, SampleSet]:
    """CIFAR-100 (fine labels, 100 classes) via torchvision; downloads only if asked."""
    from torchvision.datasets import CIFAR100

    return _cifar(CIFAR100, "cifar100", root, download)


# --------------------------------------------------------------------------- synthetic
SYNTHETIC_VERSION = 1  # bump when the generator changes, so cached results are not reused


def _synthetic_image(index: int, *, labels: np.ndarray, size: int, channels: int, seed: int,
                     colors: np.ndarray, angles: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """One image: the class's colour and stripe orientation/frequency, a random phase, plus noise.

    Depends only on (seed, index), so it is the same whichever batch or thread asks.
    """
    c = int(labels[index])
    rng = np.random.default_rng([seed, 2, index])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    direction = xx * np.cos(angles[c]) + yy * np.sin(angles[c])
    wave = np.sin(2 * np.pi * freqs[c] * direction + rng.uniform(0, 2 * np.pi))
    image = colors[c][None, None, :] + 50.0 * wave[:, :, None]
    image = image + rng.normal(0.0, 20.0, size=(size, size, 3))
    if channels == 1:
        image = image.mean(axis=2, keepdims=True)
    return np.clip(image, 0, 255).astype(np.uint8)


def synthetic(num_samples: int, num_classes: int, size: int, channels: int = 3,
              seed: int = 0) -> dict[str, SampleSet]:
    """Random but learnable class-dependent images of any size, generated on demand (benchmarks, tests).

    Classes differ in base colour and in the orientation and frequency of a stripe
    pattern; samples add a random phase and pixel noise. Identity is the parameters.
    """
    if num_samples < 1 or num_classes < 1 or size < 1 or channels not in (1, 3):
        raise DataError(f"synthetic: need num_samples, num_classes, size >= 1 and channels in (1, 3); "
                        f"got num_samples={num_samples}, num_classes={num_classes}, size={size}, "
                        f"channels={channels}")
    class_rng = np.random.default_rng([seed, 1])
    colors = class_rng.uniform(50, 205, size=(num_classes, 3))
    angles = class_rng.uniform(0, np.pi, size=num_classes)
    freqs = class_rng.uniform(1.0, 4.0, size=num_classes)
    labels = np.random.default_rng([seed, 0]).permutation(np.arange(num_samples) % num_classes)
    generate = partial(_synthetic_image, labels=labels, size=size, channels=channels, seed=seed,
                       colors=colors, angles=angles, freqs=freqs)
    params = {"format": "synthetic", "version": SYNTHETIC_VERSION, "num_samples": num_samples,
              "num_classes": num_classes, "size": size, "channels": channels, "seed": seed}
    return {"train": GeneratedSampleSet(generate, labels, [f"class_{c}" for c in range(num_classes)],
                                        name="synthetic/train", content_id=hash_json(params))}
