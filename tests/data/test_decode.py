"""Decoder (resize + normalize to RGB tensors) and InputAugment (deterministic per sample)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.data.decode import Decoder, InputAugment
from pipeline.errors import DataError

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def expected_constant(value: int) -> torch.Tensor:
    return (value / 255.0 - torch.tensor(MEAN)) / torch.tensor(STD)


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("size", [8, 16, 40])
def test_constant_images_normalize_exactly(channels: int, size: int) -> None:
    images = np.full((4, size, size, channels), 77, np.uint8)
    out = Decoder(16, mean=MEAN, std=STD)(images)
    assert out.shape == (4, 3, 16, 16) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out[2, :, 5, 7], expected_constant(77), atol=1e-5, rtol=0)


def test_grayscale_is_replicated_and_matches_reference_resize() -> None:
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 256, (3, 28, 28, 1), dtype=np.uint8)
    out = Decoder(64, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))(gray)
    torch.testing.assert_close(out[:, 0], out[:, 2])
    ref = F.interpolate(torch.from_numpy(gray).permute(0, 3, 1, 2).float() / 255, size=(64, 64),
                        mode="bilinear", align_corners=False, antialias=True)
    torch.testing.assert_close(out[:, :1], (ref - 0.5) / 0.5, atol=1e-4, rtol=0)


@pytest.mark.parametrize("size", [20, 48])  # up- and downscaling
def test_rgb_matches_reference_resize(size: int) -> None:
    rgb = np.random.default_rng(1).integers(0, 256, (2, size, size, 3), dtype=np.uint8)
    out = Decoder(32, mean=MEAN, std=STD)(rgb)
    ref = F.interpolate(torch.from_numpy(rgb).permute(0, 3, 1, 2).float() / 255, size=(32, 32),
                        mode="bilinear", align_corners=False, antialias=True)
    ref = (ref - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_mixed_sizes_and_channels_keep_order() -> None:
    images = [np.full((10, 12, 3), 10, np.uint8), np.full((28, 28, 1), 200, np.uint8),
              np.full((10, 12, 3), 90, np.uint8), np.full((5, 5), 30, np.uint8)]
    out = Decoder(24, mean=MEAN, std=STD)(images)
    assert out.shape == (4, 3, 24, 24)
    for i, v in enumerate([10, 200, 90, 30]):
        torch.testing.assert_close(out[i, :, 12, 12], expected_constant(v), atol=1e-5, rtol=0)


def test_decoder_rejects_bad_input() -> None:
    with pytest.raises(DataError, match="uint8"):
        Decoder(8, mean=MEAN, std=STD)(np.zeros((1, 8, 8, 3), np.float32))
    with pytest.raises(DataError, match="C = 1 or 3"):
        Decoder(8, mean=MEAN, std=STD)(np.zeros((1, 8, 8, 4), np.uint8))
    with pytest.raises(DataError, match="std > 0"):
        Decoder(8, mean=MEAN, std=(1.0, 0.0, 1.0))


@pytest.fixture
def batch() -> np.ndarray:
    return np.random.default_rng(2).integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)


FULL = {"random_resized_crop": (0.3, 1.0), "crop_padding": 4, "hflip": 0.5}


def test_augment_same_per_sample_whatever_the_batching(batch: np.ndarray) -> None:
    aug = InputAugment(**FULL)
    idx = np.arange(100, 112)
    whole = aug(batch, idx, epoch=3, seed=7)
    assert whole.shape == batch.shape and whole.dtype == np.uint8
    order = np.random.default_rng(0).permutation(12)
    parts = [aug(batch[order[i:i + 5]], idx[order[i:i + 5]], epoch=3, seed=7) for i in range(0, 12, 5)]
    np.testing.assert_array_equal(np.concatenate(parts), whole[order])
    fresh = InputAugment(**FULL)(batch, idx, epoch=3, seed=7)
    np.testing.assert_array_equal(fresh, whole)
    as_list = aug(list(batch), idx, epoch=3, seed=7)
    assert isinstance(as_list, list)
    np.testing.assert_array_equal(np.stack(as_list), whole)


def test_augment_changes_with_epoch_seed_and_index(batch: np.ndarray) -> None:
    aug = InputAugment(**FULL)
    idx = np.arange(12)
    base = aug(batch, idx, epoch=0, seed=0)
    assert not np.array_equal(base, batch)
    assert not np.array_equal(aug(batch, idx, epoch=1, seed=0), base)
    assert not np.array_equal(aug(batch, idx, epoch=0, seed=1), base)
    same_image = np.repeat(batch[:1], 12, axis=0)
    outs = aug(same_image, idx, epoch=0, seed=0)
    assert len({o.tobytes() for o in outs}) > 6  # different indices, different augmentations


def test_augment_is_thread_safe(batch: np.ndarray) -> None:
    aug = InputAugment(**FULL)
    idx = np.arange(12)
    expected = aug(batch, idx, epoch=2, seed=5)
    results: list[np.ndarray] = []

    def work() -> None:
        for _ in range(20):
            results.append(aug(batch, idx, epoch=2, seed=5))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 60 and all(np.array_equal(r, expected) for r in results)


def test_individual_transforms() -> None:
    image = np.arange(8 * 8, dtype=np.uint8).reshape(1, 8, 8, 1)
    flipped = InputAugment(hflip=1.0)(image, np.array([0]), epoch=0, seed=0)
    np.testing.assert_array_equal(flipped, image[:, :, ::-1])
    ones = np.full((50, 8, 8, 1), 255, np.uint8)
    padded = InputAugment(crop_padding=2)(ones, np.arange(50), epoch=0, seed=0)
    assert padded.shape == ones.shape
    zero_cols = (padded[:, :, :, 0] == 0).all(axis=1).sum(axis=1)
    assert zero_cols.max() <= 2 and zero_cols.sum() > 0  # zero padding shifts in, at most p columns
    rrc = InputAugment(random_resized_crop=(0.2, 0.5))(np.zeros((3, 20, 30, 3), np.uint8), np.arange(3),
                                                        epoch=0, seed=0)
    assert rrc.shape == (3, 20, 30, 3)
    mixed = [np.zeros((10, 12, 3), np.uint8), np.zeros((7, 7, 1), np.uint8)]
    out = InputAugment(**FULL)(mixed, np.arange(2), epoch=0, seed=0)
    assert [o.shape for o in out] == [(10, 12, 3), (7, 7, 1)]


def test_disabled_augment_is_identity_and_args_are_checked(batch: np.ndarray) -> None:
    assert InputAugment()(batch, np.arange(12), epoch=0, seed=0) is batch
    with pytest.raises(DataError, match="one index per image"):
        InputAugment(hflip=0.5)(batch, np.arange(3), epoch=0, seed=0)
    with pytest.raises(DataError, match="0 < lo <= hi <= 1"):
        InputAugment(random_resized_crop=(0.8, 0.2))
    with pytest.raises(DataError, match="probability"):
        InputAugment(hflip=1.5)
