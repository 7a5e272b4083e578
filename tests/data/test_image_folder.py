"""image_folder on real PNG/JPEG files: layout, bad files (fail/skip), content identity."""

from __future__ import annotations

import io
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from pipeline.data.image_folder import SkippedSamplesWarning, _decode_jpeg, decode_image
from pipeline.data.sources import image_folder
from pipeline.errors import DataError, MissingPathError


def save(path: Path, array: np.ndarray, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array.squeeze()).save(path, format=fmt)
    return path


def make_tree(root: Path, classes: dict[str, int], size: int = 12, seed: int = 0) -> Path:
    """Classes with alternating PNG/JPEG files; pixel colour encodes the class."""
    rng = np.random.default_rng(seed)
    for c, (name, count) in enumerate(classes.items()):
        for i in range(count):
            noise = rng.integers(0, 10, (size, size, 3), dtype=np.uint8)
            img = np.full((size, size, 3), 40 * c, np.uint8) + noise
            save(root / name / f"img{i:02d}.{'png' if i % 2 else 'jpg'}", img)
    return root


def test_classes_sorted_counts_and_loading(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", {"zebra": 3, "apple": 2, "mango": 4})
    (root / "apple" / "notes.txt").write_text("not an image")
    (root / "apple" / ".hidden.png").write_bytes(b"ignored")
    sets = image_folder(root)
    assert list(sets) == ["train"]
    s = sets["train"]
    assert s.class_names == ["apple", "mango", "zebra"]
    assert np.bincount(s.labels).tolist() == [2, 4, 3]
    batch = s.load(np.arange(len(s)))
    assert isinstance(batch, np.ndarray) and batch.shape == (9, 12, 12, 3) and batch.dtype == np.uint8
    # Pixels follow the files: apple was written with colour 40, zebra with colour 0.
    assert batch[s.labels == 0].mean() > batch[s.labels == 2].mean()


def test_split_folders_become_splits(tmp_path: Path) -> None:
    make_tree(tmp_path / "train", {"a": 3, "b": 3})
    make_tree(tmp_path / "test", {"a": 2, "b": 1})
    make_tree(tmp_path / "val", {"b": 2})
    sets = image_folder(tmp_path)
    assert {k: len(v) for k, v in sets.items()} == {"train": 6, "val": 2, "test": 3}
    assert all(v.class_names == ["a", "b"] for v in sets.values())
    assert sets["val"].labels.tolist() == [1, 1]


def test_grayscale_rgba_and_mixed_sizes(tmp_path: Path) -> None:
    save(tmp_path / "g" / "gray.png", np.full((10, 8), 200, np.uint8))
    save(tmp_path / "g" / "rgba.png", np.full((6, 6, 4), 100, np.uint8))
    s = image_folder(tmp_path)["train"]
    images = s.load(np.array([0, 1]))
    assert isinstance(images, list)
    assert images[0].shape == (10, 8, 1) and images[0][0, 0, 0] == 200
    assert images[1].shape == (6, 6, 3) and images[1][0, 0, 0] == 100


def test_corrupt_file_fail_names_path(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"a": 2, "b": 2})
    bad = root / "b" / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match=rf"{bad}: cannot decode image"):
        image_folder(root, on_bad_sample="fail")


def test_truncated_file_fail_raises_at_load_naming_path(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"a": 2}, size=256)  # large enough that the header survives the cut
    good = root / "a" / "img00.jpg"
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 2])
    s = image_folder(root, on_bad_sample="fail")["train"]  # header is fine, so indexing succeeds
    assert len(s) == 2
    with pytest.raises(DataError, match=rf"{good}: cannot decode image"):
        s.load(np.array([0]))


def test_skip_drops_counts_and_warns_once(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"a": 3, "b": 3}, size=64)
    (root / "a" / "zz_garbage.png").write_bytes(b"garbage")
    truncated = root / "b" / "img00.jpg"
    truncated.write_bytes(truncated.read_bytes()[:300])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = image_folder(root, on_bad_sample="skip")["train"]
    skips = [w for w in caught if issubclass(w.category, SkippedSamplesWarning)]
    assert len(skips) == 1
    message = str(skips[0].message)
    assert "skipped 2 unreadable image(s)" in message
    assert "zz_garbage.png" in message and "img00.jpg" in message
    assert np.bincount(s.labels).tolist() == [3, 2]
    assert len(s.load(np.arange(len(s)))) == len(s)  # every kept file decodes


def test_empty_or_missing_folders(tmp_path: Path) -> None:
    with pytest.raises(MissingPathError, match=str(tmp_path / "nope")):
        image_folder(tmp_path / "nope")
    make_tree(tmp_path / "d", {"a": 1})
    (tmp_path / "d" / "empty").mkdir()
    with pytest.raises(DataError, match=rf"{tmp_path / 'd' / 'empty'}: class folder holds no images"):
        image_folder(tmp_path / "d")
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match="no class folders"):
        image_folder(tmp_path / "none")
    with pytest.raises(DataError, match="on_bad_sample"):
        image_folder(tmp_path / "d", on_bad_sample="ignore")  # type: ignore[arg-type]


def test_identity_survives_move_but_not_edits(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "original", {"a": 2, "b": 2})
    before = image_folder(root)["train"].identity()
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    shutil.move(root, moved)
    assert image_folder(moved)["train"].identity() == before
    target = moved / "b" / "img01.png"
    pixels = np.array(Image.open(target))
    pixels[0, 0, 0] ^= 1
    save(target, pixels)
    assert image_folder(moved)["train"].identity() != before


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    path = tmp_path / "a" / "phone.jpg"
    path.parent.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display", as phones write it
    Image.fromarray(np.zeros((10, 30, 3), np.uint8)).save(path, exif=exif)
    assert image_folder(tmp_path)["train"].load(np.array([0]))[0].shape == (30, 10, 3)


def test_read_then_decode_equals_load_for_any_split_of_the_batch(tmp_path: Path) -> None:
    # The decode stage reads files on one thread and decodes parts of the batch on others.
    from pipeline.data.sampleset import concat_images

    root = make_tree(tmp_path, {"a": 4, "b": 3})
    s = image_folder(root)["train"].subset(np.array([6, 0, 3, 5, 1]))
    assert s.decodes
    idx = np.array([4, 0, 2, 3])
    raw = s.read(idx)
    assert len(raw) == 4 and all(isinstance(data, bytes) for _path, data in raw)
    whole = s.load(idx)
    assert np.array_equal(s.decode(raw), whole)
    assert np.array_equal(concat_images([s.decode(raw[:1]), s.decode(raw[1:])]), whole)


def test_mixed_sizes_survive_decoding_in_parts(tmp_path: Path) -> None:
    from pipeline.data.sampleset import concat_images

    save(tmp_path / "g" / "a.png", np.full((10, 8), 200, np.uint8))
    save(tmp_path / "g" / "b.png", np.full((6, 6, 3), 100, np.uint8))
    save(tmp_path / "g" / "c.png", np.full((6, 6, 3), 50, np.uint8))
    s = image_folder(tmp_path)["train"]
    raw = s.read(np.arange(3))
    parts = concat_images([s.decode(raw[:1]), s.decode(raw[1:])])
    assert isinstance(parts, list) and [p.shape for p in parts] == [(10, 8, 1), (6, 6, 3), (6, 6, 3)]
    same = concat_images([s.decode(raw[1:2]), s.decode(raw[2:])])
    assert isinstance(same, np.ndarray) and same.shape == (2, 6, 6, 3)


def test_file_gone_after_indexing_is_named_at_read(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"a": 2})
    s = image_folder(root)["train"]
    gone = root / "a" / "img01.png"
    gone.unlink()
    with pytest.raises(DataError, match=rf"{gone}: cannot read image file: FileNotFoundError"):
        s.read(np.array([1]))


def _pil_pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        im = ImageOps.exif_transpose(im)
        return np.asarray(im.convert("L"))[:, :, None] if im.mode == "L" else np.asarray(im.convert("RGB"))


JPEG_VARIANTS = {
    "4:2:0": dict(subsampling=2),
    "4:2:2": dict(subsampling=1),
    "4:4:4": dict(subsampling=0),
    "progressive": dict(progressive=True),
    "restart markers, odd size": dict(restart_marker_blocks=1),
    "grayscale": dict(mode="L"),
    "cmyk": dict(mode="CMYK"),
    "exif rotated": dict(exif_orientation=8),
    "exif upright": dict(exif_orientation=1),
}


@pytest.mark.parametrize("variant", list(JPEG_VARIANTS))
def test_jpeg_pixels_equal_pils_whichever_path_decodes(variant: str) -> None:
    """The fast JPEG path must give PIL's exact pixels: cached features must not depend on the decoder."""
    opts = dict(JPEG_VARIANTS[variant])
    mode = opts.pop("mode", "RGB")
    orientation = opts.pop("exif_orientation", None)
    rng = np.random.default_rng(1)
    size = (37, 53) if "odd" in variant else (48, 64)
    smooth = np.linspace(0, 255, size[0] * size[1] * 3).reshape(*size, 3)
    array = np.clip(smooth + rng.normal(0, 30, smooth.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        opts["exif"] = exif
    Image.fromarray(array).convert(mode).save(buf, format="JPEG", quality=90, **opts)
    data = buf.getvalue()
    fast = _decode_jpeg(data)
    # Which path decodes: colour spaces PIL converts itself and rotated images stay with PIL.
    assert (fast is None) == (variant in ("cmyk", "exif rotated"))
    pixels = decode_image(Path(f"{variant}.jpg"), data)
    np.testing.assert_array_equal(pixels, _pil_pixels(data))
    assert pixels.dtype == np.uint8 and pixels.shape[2] == (1 if mode == "L" else 3)
