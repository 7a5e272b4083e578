"""Write a class-per-folder tree of PNG images from Fashion-MNIST: a stand-in for "your own image folder".

    python examples/fashion_mnist_folder.py fashion            # 5 classes x 200 images, 28x28 grayscale PNG
    python examples/fashion_mnist_folder.py fashion --classes 10 --per-class 500

Reads Debian's dataset-fashion-mnist package (`apt-get install dataset-fashion-mnist`), or the four idx
.gz files in the folder given with --source. The README's "Your own data" section times
`python -m pipeline new own-data fashion` and its run on the folder this writes.
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import numpy as np
from PIL import Image

NAMES = ["t-shirt_top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
         "ankle_boot"]
DEBIAN = Path("/usr/share/datasets/fashion-mnist")


def _idx(path: Path, offset: int) -> np.ndarray:
    with gzip.open(path) as fh:
        return np.frombuffer(fh.read(), np.uint8, offset=offset)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write (out/<class>/<index>.png)")
    parser.add_argument("--classes", type=int, default=5, help="the first N of the 10 classes (default 5)")
    parser.add_argument("--per-class", type=int, default=200, help="images per class (default 200)")
    parser.add_argument("--source", type=Path, default=DEBIAN, help=f"the idx .gz files (default {DEBIAN})")
    args = parser.parse_args(argv)
    images_file = args.source / "train-images-idx3-ubyte.gz"
    labels_file = args.source / "train-labels-idx1-ubyte.gz"
    if not images_file.is_file() or not labels_file.is_file():
        parser.error(f"{images_file} not found: apt-get install dataset-fashion-mnist, or pass --source DIR")
    images = _idx(images_file, 16).reshape(-1, 28, 28)
    labels = _idx(labels_file, 8)
    for label in range(args.classes):
        folder = args.out / NAMES[label]
        folder.mkdir(parents=True, exist_ok=True)
        for i in np.flatnonzero(labels == label)[: args.per_class]:  # the first N, so a rerun writes the same
            Image.fromarray(images[i], mode="L").save(folder / f"{i:05d}.png")
    print(f"{args.classes} classes x {args.per_class} images in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
