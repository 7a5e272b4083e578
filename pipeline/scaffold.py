"""``python -m pipeline new NAME [DIR]``: copy the example recipes that ship with the package into a folder.

``python -m pipeline new own-data FOLDER`` instead writes a recipe for the user's own image folder
(``./FOLDER.yaml``): it counts the classes and images and samples image sizes, and picks a resolution,
batch size and epochs that make a first run take minutes on a small CPU, with a ``pretrain`` stage on
the folder itself so that no weights file (no download) is needed.

After a non-editable ``pip install`` there is no repository checkout, so the recipes the README runs travel
inside the package (``pipeline/recipes``; in the repository a symlink to ``recipes/``) and this command
writes them where the user works. Names are the shipped recipes' folders (``neuroflux`` writes
``neuroflux/digits.yaml`` and ``neuroflux/fashion_mnist.yaml``), ``quickstart`` and ``all``; files keep
their paths relative to ``recipes/``. Existing files are never overwritten without ``force``, and the check
covers every file before the first one is written, so a refusal leaves the folder as it was.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from .errors import MissingPathError, PipelineError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable  # 3.11+; only named for the type checker

ALL = "all"


class ScaffoldError(PipelineError, ValueError):
    """The example recipes cannot be written as asked (a file exists, an unknown name, a bad folder)."""


def _root() -> Traversable:
    root = files("pipeline") / "recipes"
    if not root.is_dir():
        raise MissingPathError(
            f"the example recipes are not installed with this copy of the toolkit (expected {root}); "
            "reinstall it (`pip install .` from the repository) or copy recipes/ from the repository"
        )
    return root


def _walk(node: Traversable, prefix: PurePosixPath) -> list[tuple[PurePosixPath, Traversable]]:
    found = []
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.is_dir():
            found += _walk(child, prefix / child.name)
        elif child.name.endswith(".yaml"):
            found.append((prefix / child.name, child))
    return found


def shipped() -> dict[PurePosixPath, Traversable]:
    """Every shipped recipe: its path relative to ``recipes/`` -> the packaged file."""
    return dict(_walk(_root(), PurePosixPath()))


def names() -> list[str]:
    """What ``new`` accepts: each top-level recipe's stem, each folder of recipes, and ``all``."""
    tops = {p.parts[0] if len(p.parts) > 1 else p.stem for p in shipped()}
    return sorted(tops) + [ALL, OWN_DATA]


def selected(name: str) -> dict[PurePosixPath, Traversable]:
    recipes = shipped()
    if name == ALL:
        return recipes
    chosen = {
        p: f for p, f in recipes.items() if (p.parts[0] == name if len(p.parts) > 1 else p.stem == name)
    }
    if not chosen:
        raise ScaffoldError(f"no example recipe called {name!r}; expected one of: {', '.join(names())}")
    return chosen


@dataclass(frozen=True)
class Written:
    path: Path
    action: str  # "written", "overwritten" or "unchanged" (already there with the same bytes)
    note: str = ""  # what the command found and chose, shown after the path


def write(name: str, dest: Path, *, force: bool = False) -> list[Written]:
    """Copy the example recipe(s) ``name`` into ``dest`` (created if missing); see the module docstring.

    ``own-data`` is the exception: ``dest`` is then an image folder, and the recipe written for it goes
    to the current folder (:func:`write_own_data`).
    """
    if name == OWN_DATA:
        return [write_own_data(dest, force=force)]
    chosen = {dest.joinpath(*rel.parts): f.read_bytes() for rel, f in selected(name).items()}
    if dest.exists() and not dest.is_dir():
        raise ScaffoldError(f"{dest} is a file, expected a folder to write the example recipes into")
    clashes = [p for p, data in chosen.items() if p.exists() and (not p.is_file() or p.read_bytes() != data)]
    if clashes and not force:
        listed = ", ".join(str(p) for p in clashes)
        raise ScaffoldError(
            f"{listed} already exist{'s' if len(clashes) == 1 else ''} with other content; nothing was "
            "written (add --force to overwrite, or pick another folder: `python -m pipeline new NAME DIR`)"
        )
    done = []
    for path, data in chosen.items():
        if path.is_file() and path.read_bytes() == data:
            done.append(Written(path, "unchanged"))
            continue
        existed = path.exists()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                raise ScaffoldError(f"{path} is a folder; cannot write a recipe over it, even with --force")
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)  # a reader never sees half a recipe
        except PermissionError as exc:
            raise ScaffoldError(
                f"cannot write {path}: permission denied ({exc.strerror}); pick a folder you can write to"
            ) from None
        except FileExistsError:  # a path component is a file (mkdir refuses)
            raise ScaffoldError(f"cannot create the folder for {path}: a file is in the way") from None
        except NotADirectoryError:
            raise ScaffoldError(f"cannot write {path}: a part of that path is a file, not a folder") from None
        done.append(Written(path, "overwritten" if existed else "written"))
    return done


# --------------------------------------------------------------------------- own-data: a recipe for a folder
OWN_DATA = "own-data"
# How many images' headers are opened to judge the folder's image size (spread over the classes).
SIZE_SAMPLE = 24


@dataclass(frozen=True)
class FolderSurvey:
    """What ``new own-data`` learns from an image folder before choosing the recipe's settings."""

    root: Path
    class_names: list[str]
    images: dict[str, int]  # split folder ("train", or train/val/test when the folder has them) -> images
    short_side: int  # median shorter side of the sampled images, in pixels

    @property
    def total(self) -> int:
        return sum(self.images.values())


def survey(root: Path) -> FolderSurvey:
    """Count classes and images the way ``image_folder`` will index them, and sample image sizes."""
    from .data.image_folder import _image_files, _split_folders, _visible_dirs

    if not root.is_dir():
        what = "is a file" if root.exists() else "does not exist"
        raise ScaffoldError(f"{root} {what}: `new {OWN_DATA}` takes a folder holding one subfolder of "
                            "JPEG/PNG images per class (photos/daisy/*.jpg, photos/rose/*.png, ...)")
    splits = _split_folders(root)
    per_class: dict[str, list[Path]] = {}
    images: dict[str, int] = {}
    for split, folder in splits.items():
        images[split] = 0
        for cls in _visible_dirs(folder):
            files = _image_files(cls)
            per_class.setdefault(cls.name, []).extend(files)
            images[split] += len(files)
    empty = sorted(name for name, files in per_class.items() if not files)
    if empty:
        raise ScaffoldError(f"{root}: class folder{'s' if len(empty) > 1 else ''} {', '.join(empty)} "
                            "hold no .jpg/.jpeg/.png images; add images or remove the folder")
    if len(per_class) < 2:
        found = f"only {next(iter(per_class))!r}" if per_class else "none"
        raise ScaffoldError(f"{root}: a classifier needs at least two class folders (one per class, holding "
                            f"its images), found {found}")
    names = sorted(per_class)
    # Judge the size from images of every class, not just the first folder's.
    picked = [per_class[names[i % len(names)]][i // len(names)] for i in range(SIZE_SAMPLE)
              if i // len(names) < len(per_class[names[i % len(names)]])]
    return FolderSurvey(root, names, images, _median_short_side(picked))


def _median_short_side(paths: list[Path]) -> int:
    from PIL import Image, UnidentifiedImageError

    sides = []
    for path in paths:
        try:
            with Image.open(path) as im:  # reads the header only
                sides.append(min(im.size))
        except (OSError, UnidentifiedImageError):
            continue  # a bad file is the run's to report (on_bad_sample); it says nothing about sizes
    if not sides:
        raise ScaffoldError(f"none of the {len(paths)} images sampled ({paths[0]}, ...) could be opened; "
                            "check that they are JPEG or PNG files")
    return sorted(sides)[len(sides) // 2]


@dataclass(frozen=True)
class OwnDataSettings:
    """The recipe's settings for a surveyed folder, and why (written into the recipe as comments)."""

    resolution: int
    small_input: bool
    width_mult: float
    batch_size: int
    pretrain_epochs: int
    transfer_epochs: int
    transfer_lr: float
    crop_padding: int  # of the cached feature maps (0 where the maps are too small to shift)


def choose_settings(found: FolderSurvey) -> OwnDataSettings:
    """Settings that make a first run finish in minutes on a 2-core CPU and still learn the folder.

    The backbone trains from scratch, so its cost is what matters: images at most 32 px keep 32 px
    with the first convolution's stride off (``small_input``), as the quickstart does; up to 72 px get
    64 px likewise; larger images are shrunk to 128 px with the stride kept, which costs as much as
    64 px without it. Epochs are set so the backbone sees about 8000 images whatever the folder's size
    (between 5 and 30 passes), with batches of 32 (16 for a folder of under 320 training images, so
    an epoch is still several steps).
    """
    train = found.images.get("train", 0) * (0.7 if set(found.images) == {"train"} else 1.0)
    side = found.short_side
    resolution, small = (32, True) if side <= 40 else (64, True) if side <= 72 else (128, False)
    return OwnDataSettings(
        resolution=resolution,
        small_input=small,
        width_mult=0.5 if train >= 2000 else 0.35,
        batch_size=32 if train >= 320 else 16,
        pretrain_epochs=max(5, min(30, round(8000 / max(1.0, train)))),
        transfer_epochs=15,
        transfer_lr=0.01,
        # At 32 px the cut's maps are 4x4, where a one-cell shift changes the image (recipes/quickstart.yaml).
        crop_padding=0 if resolution == 32 else 1,
    )


def _slug(name: str) -> str:
    slug = "".join(c if c.isalnum() or c in "-_" else "_" for c in name).strip("_")
    return slug or "own_data"


def own_data_recipe(found: FolderSurvey, root_text: str, name: str) -> str:
    """The recipe text for the folder: YAML with comments that say what was found and chosen."""
    s = choose_settings(found)
    counts = (f"{found.total}, split 70/15/15 below" if set(found.images) == {"train"} else
              ", ".join(f"{split} {n}" for split, n in found.images.items()))
    why = ("first convolution's stride off, as for small images" if s.small_input else
           "larger images shrunk: from scratch, more pixels cost time and add little")
    pad = max(2, s.resolution // 16)
    return f"""\
# Transfer learning on your own image folder, no download needed. Written by
# `python -m pipeline new {OWN_DATA}` for {root_text}: {len(found.class_names)} classes; images: {counts};
# median shorter side {found.short_side} px.
#
# 1. backbone: a small MobileNetV2 trains from scratch on the folder's own training images, so no weights
#    file is needed (stored, and reused by every later run);
# 2. stage A, once: the frozen bottom of that network runs over the images; its outputs are cached at
#    4 bits per value;
# 3. stage B, every epoch: the top trains from the cache (two_stage), then is tested on the test images.
#
# Chosen for this folder: {s.resolution} px ({why}); batch {s.batch_size};
# {s.pretrain_epochs} backbone epochs (about 8000 images seen). Change any of it here or with --set, e.g.
# --set stages.backbone.train.epochs=5.
#
#   python -m pipeline run {name}.yaml
#   python -m pipeline predict runs/{name}/<time> --stage two_stage IMAGE_OR_FOLDER
name: {name}
seed: 0
run:
  threads: auto                # device: cuda (or auto) on a machine with a GPU

stages:
  photos:
    type: image_folder
    root: {json.dumps(root_text)}   # relative to the folder you run from; moving it keeps the cache
    on_bad_sample: skip        # an unreadable file is skipped and counted (fail: stop, naming it)
  split:                       # the folder's own train/, val/ and test/ folders are used where it has them
    type: split
    input: photos
    val_fraction: 0.15
    test_fraction: 0.15

  # With a pretrained weights file (torchvision's mobilenet_v2-b0353104.pth, say, copied from a machine
  # with internet), replace this stage by
  #   backbone: {{type: backbone, arch: mobilenet_v2, weights: mobilenet_v2-b0353104.pth}}
  # and set images.resolution to 224: transfer from ImageNet features is more accurate than from these.
  backbone:
    type: pretrain
    input: split
    arch: mobilenet_v2
    width_mult: {s.width_mult}
    small_input: {"true" if s.small_input else "false"}
    resolution: {s.resolution}
    batch_size: {s.batch_size}
    augment: {{crop_padding: {pad}, hflip: 0.5}}   # hflip: 0.0 where a mirror image is another class
    train: {{epochs: {s.pretrain_epochs}, lr: 0.01, optimizer: adamw, schedule: cosine}}

  images:
    type: decode
    input: split
    resolution: {s.resolution}
  features:
    type: frozen_forward
    input: images
    model: backbone
    train_last_blocks: 7       # the cut: the last 7 blocks and the head train, the rest runs once
  quantized:
    type: quantize
    input: features
    bits: 4
  cache:
    type: cache
    input: quantized
  read:
    type: dequantize
    input: cache
  augmented:
    type: feature_aug
    input: read
    crop_padding: {s.crop_padding}
    hflip: 0.5

  two_stage:
    type: finetune
    mode: two_stage
    model: backbone
    features: augmented
    batch_size: {s.batch_size}
    train: {{epochs: {s.transfer_epochs}, lr: {s.transfer_lr}, optimizer: adamw, schedule: cosine,
            label_smoothing: 0.1}}

targets: [two_stage]
"""


def write_own_data(folder: Path, dest: Path | None = None, *, force: bool = False) -> Written:
    """Survey the image ``folder`` and write a recipe for it as ``dest`` (default ``./<folder name>.yaml``).

    The recipe goes beside the folder's users, never inside the folder: anything in it that is a folder
    would be read as a class (the run directory ``runs/`` included).
    """
    if folder.resolve() == Path.cwd().resolve() and dest is None:
        raise ScaffoldError(f"`new {OWN_DATA}` needs the image folder as its argument, from outside it: "
                            f"cd ..; python -m pipeline new {OWN_DATA} {folder.resolve().name} (the recipe "
                            "and the runs go beside the folder, where they are not taken for classes)")
    found = survey(folder)
    name = _slug(folder.resolve().name)
    path = dest if dest is not None else Path(f"{name}.yaml")
    text = own_data_recipe(found, folder.as_posix(), name).encode()
    if path.exists() and not force and not (path.is_file() and path.read_bytes() == text):
        raise ScaffoldError(f"{path} already exists with other content; nothing was written (add --force to "
                            "overwrite it, or move it away)")
    if path.is_dir():
        raise ScaffoldError(f"{path} is a folder; cannot write a recipe over it, even with --force")
    s = choose_settings(found)
    note = (f"{folder}: {len(found.class_names)} classes, {found.total} images, median shorter side "
            f"{found.short_side} px -> {s.resolution} px, batch {s.batch_size}, {s.pretrain_epochs} backbone "
            f"epochs on the folder itself (no weights file needed)")
    if path.is_file() and path.read_bytes() == text:
        return Written(path, "unchanged", note)
    existed = path.exists()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(text)
    os.replace(tmp, path)
    return Written(path, "overwritten" if existed else "written", note)
