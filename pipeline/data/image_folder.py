"""Class-per-folder trees of JPEG/PNG files as sample sets.

Layout: ``root/<class>/**/<image>``, or ``root/{train,val,test}/<class>/...`` for
official splits. Class names are the sorted folder names (shared by all splits),
samples are ordered by class then relative path, so the same tree always gives the
same indices, wherever it lives.

Bad files are handled by policy. Every file's header is opened when indexing (cheap,
and it catches non-images and unreadable files up front). With ``"skip"`` every
image is also fully decoded at indexing, so the sample counts that plans, splits
and step counts rely on are final before training starts; with ``"fail"`` a file
whose pixel data is broken raises when it is first loaded, naming the file.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from ..errors import DataError, MissingPathError
from ..lazy import lazy_module
from .identity import file_identity, hash_json
from .sampleset import Images, Raw, SampleSet, as_batch, content_key, keys_array

if TYPE_CHECKING:
    import simplejpeg
    from PIL import ExifTags, Image, ImageOps
else:
    ExifTags = lazy_module("PIL.ExifTags")
    Image = lazy_module("PIL.Image")
    ImageOps = lazy_module("PIL.ImageOps")
    simplejpeg = lazy_module("simplejpeg")

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png"})
SPLIT_NAMES = ("train", "val", "test")
#: How many skipped files the warning lists by name.
SHOWN_SKIPS = 5

BadSamplePolicy = Literal["fail", "skip"]


class SkippedSamplesWarning(UserWarning):
    """Some images could not be read and were left out of the dataset (``on_bad_sample: skip``).

    Carries what it says as data (``source``, ``skipped``: one reason per file) so a run record
    can count the skipped samples, not only print them.
    """

    def __init__(self, message: str, *, source: str = "", skipped: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.source = source
        self.skipped = list(skipped)


def _to_array(im: Image.Image) -> np.ndarray:
    """A PIL image as uint8 HWC with 1 (grayscale) or 3 (colour) channels."""
    if im.mode.startswith("I;16"):
        return (np.asarray(im).astype(np.uint16) >> 8).astype(np.uint8)[:, :, None]
    if im.mode == "I":  # 16-bit grayscale PNGs on some Pillow versions
        return np.clip(np.asarray(im) / 257.0, 0, 255).round().astype(np.uint8)[:, :, None]
    if im.mode == "F":
        return np.clip(np.asarray(im), 0, 255).round().astype(np.uint8)[:, :, None]
    if im.mode in ("1", "L", "LA", "La"):
        return np.asarray(im if im.mode == "L" else im.convert("L"))[:, :, None]
    return np.asarray(im if im.mode == "RGB" else im.convert("RGB"))


def read_bytes(path: Path) -> bytes:
    """The bytes of an image file; DataError naming the file when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read image file: {type(exc).__name__}: {exc}") from exc


_JPEG_START = b"\xff\xd8\xff"
# JPEG colour spaces libjpeg-turbo converts exactly as PIL does (CMYK/YCCK: PIL's Adobe handling).
_DIRECT_JPEG = {"YCbCr": "RGB", "RGB": "RGB", "Gray": "GRAY"}
# EXIF lives in an APP1 segment, which precedes the image data: searching the head is enough.
_EXIF_HEAD = 1 << 16


def _rotated(im: Image.Image) -> bool:
    """True when the image's EXIF orientation asks for a rotation or flip before display."""
    return im.getexif().get(ExifTags.Base.Orientation, 1) != 1


def _exif_rotated(data: bytes) -> bool:
    if data.find(b"Exif\x00\x00", 0, _EXIF_HEAD) < 0:  # find with bounds: no copy of the head
        return False
    with Image.open(io.BytesIO(data)) as im:  # header only, no pixels
        return _rotated(im)


def _decode_jpeg(data: bytes) -> np.ndarray | None:
    """A JPEG straight from libjpeg-turbo into numpy (simplejpeg), or None to leave it to PIL.

    Why not PIL for everything: this takes less CPU, and it holds the GIL only around one call,
    so a decode pool scales across cores (PIL's Python-side work serializes the threads). The pixels
    are the same as PIL's (the same library with the same accurate IDCT and upsampling;
    tests/data/test_image_folder.py checks it), so cached features do not depend on which
    path decoded them. Left to PIL: CMYK/YCCK files, EXIF-rotated ones, and anything
    simplejpeg rejects (strict: truncated data too), so PIL reports the error as before.
    """
    try:
        _, _, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        target = _DIRECT_JPEG.get(colorspace)
        if target is None or _exif_rotated(data):
            return None
        return simplejpeg.decode_jpeg(data, colorspace=target)
    except Exception:  # ValueError from libjpeg-turbo, PIL errors from the EXIF check: PIL decides
        return None


def decode_image(path: Path, data: bytes) -> np.ndarray:
    """Decode the bytes of image file ``path`` to uint8 HWC (EXIF orientation applied)."""
    if data[:3] == _JPEG_START and (pixels := _decode_jpeg(data)) is not None:
        return pixels
    try:
        with Image.open(io.BytesIO(data)) as im:
            if _rotated(im):
                return _to_array(ImageOps.exif_transpose(im))
            return _to_array(im)
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, ... for broken files
        raise DataError(f"{path}: cannot decode image: {type(exc).__name__}: {exc}") from exc


def check_image(path: Path, *, full: bool) -> None:
    """Raise DataError if ``path`` is not a readable image: header only, or a full (reduced-size) decode."""
    try:
        with Image.open(path) as im:
            if full:
                if im.format == "JPEG":
                    im.draft(im.mode, (1, 1))  # decode at 1/8 scale: every byte is still parsed
                im.load()
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, ... for broken files
        raise DataError(f"{path}: cannot decode image: {type(exc).__name__}: {exc}") from exc


class FileSampleSet(SampleSet):
    """Samples stored as image files, decoded on every load; identity is the files' content."""

    def __init__(self, paths: Sequence[Path], labels: np.ndarray | Sequence[int], class_names: Sequence[str],
                 *, name: str) -> None:
        super().__init__(labels, class_names, name=name)
        if len(paths) != len(self.labels):
            raise DataError(f"{name}: {len(paths)} files but {len(self.labels)} labels")
        self.paths = list(paths)
        self._file_ids: list[str] | None = None

    decodes = True

    def file_identities(self) -> list[str]:
        """Each file's content identity (read once: the set's identity and the samples' keys share it)."""
        if self._file_ids is None:
            self._file_ids = [file_identity(p) for p in self.paths]
        return self._file_ids

    def _read(self, idx: np.ndarray) -> Raw:
        return [(self.paths[i], read_bytes(self.paths[i])) for i in idx]

    def _decode(self, raw: Raw) -> Images:
        # what _read returned: (path, bytes) per sample
        return as_batch([decode_image(path, data) for path, data in raw])

    def _content_identity(self) -> str:
        # as files_identity(self.paths) computes it, from the identities read once
        return hash_json({"format": "image-files", "files": hash_json(self.file_identities())})

    def _sample_keys(self) -> np.ndarray:
        return keys_array([content_key(i.encode()) for i in self.file_identities()])


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_files(folder: Path) -> list[Path]:
    """Image files under ``folder`` (recursively, following links), sorted by relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath) / f for f in filenames
                  if not f.startswith(".") and Path(f).suffix.lower() in IMAGE_SUFFIXES]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _split_folders(root: Path) -> dict[str, Path]:
    """``{split: folder}``: the split folders if root holds only those (train required), else root."""
    subdirs = {p.name: p for p in _visible_dirs(root)}
    if "train" in subdirs and set(subdirs) <= set(SPLIT_NAMES):
        return {name: subdirs[name] for name in SPLIT_NAMES if name in subdirs}
    return {"train": root}


def image_folder(root: str | Path, *, on_bad_sample: BadSamplePolicy = "fail") -> dict[str, FileSampleSet]:
    """Index a class-per-folder image tree into ``{split: FileSampleSet}`` (see module docstring)."""
    if on_bad_sample not in ("fail", "skip"):
        raise DataError(f"on_bad_sample must be 'fail' or 'skip', got {on_bad_sample!r}")
    root = Path(root).expanduser()
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise MissingPathError(f"image_folder root {root} {what}; set `root:` to a folder holding one "
                               f"subfolder of images per class (optionally under train/, val/, test/)")
    splits = _split_folders(root)
    class_dirs = {split: {d.name: d for d in _visible_dirs(folder)} for split, folder in splits.items()}
    class_names = sorted(set().union(*class_dirs.values()))
    if not class_names:
        raise DataError(f"{root}: no class folders found; expected one subfolder of JPEG/PNG images "
                        f"per class")

    skipped: list[str] = []
    sets: dict[str, FileSampleSet] = {}
    for split, folders in class_dirs.items():
        paths: list[Path] = []
        labels: list[int] = []
        for label, cls in enumerate(class_names):
            if cls not in folders:
                continue
            files = _image_files(folders[cls])
            if not files:
                raise DataError(f"{folders[cls]}: class folder holds no images "
                                f"(expected files ending in {', '.join(sorted(IMAGE_SUFFIXES))})")
            good = []
            for path in files:
                try:
                    check_image(path, full=on_bad_sample == "skip")
                except DataError as exc:
                    if on_bad_sample == "fail":
                        raise
                    skipped.append(str(exc))
                    continue
                good.append(path)
            if not good:
                raise DataError(f"{folders[cls]}: none of the {len(files)} images in this class folder "
                                f"could be read")
            paths += good
            labels += [label] * len(good)
        sets[split] = FileSampleSet(paths, np.asarray(labels, np.int64), class_names,
                                    name=f"image_folder {splits[split]}")
    if skipped:
        shown = "; ".join(skipped[:SHOWN_SKIPS]) + ("; ..." if len(skipped) > SHOWN_SKIPS else "")
        message = (f"image_folder {root}: skipped {len(skipped)} unreadable image(s) "
                   f"(on_bad_sample: skip): {shown}")
        warnings.warn(SkippedSamplesWarning(message, source=f"image_folder {root}", skipped=skipped),
                      stacklevel=2)
    return sets
