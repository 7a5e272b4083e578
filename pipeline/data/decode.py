"""From uint8 images to model input: resize + normalize (Decoder), and input-space augmentation.

``Decoder`` works on whole batches with torch: one interpolate call per distinct
image size and one fused multiply-add that normalizes and, for grayscale, broadcasts
to three channels. That keeps decoding of small images (MNIST-like) far from being
the bottleneck on a CPU-only device.

``InputAugment`` uses albumentations per image, reseeded per sample from a hash of
``(seed, epoch, sample index)``: the augmentation a sample gets never depends on
which batch or thread it lands in, so runs are reproducible with any batch size,
prefetch depth or worker count.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import DataError
from ..lazy import lazy_module
from .sampleset import Images

if TYPE_CHECKING:
    import albumentations as A
    import cv2
    import torch
    import torch.nn.functional as F
else:
    A = lazy_module("albumentations")
    cv2 = lazy_module("cv2")
    torch = lazy_module("torch")
    F = lazy_module("torch.nn.functional")

_MASK64 = (1 << 64) - 1


def _images_list(images: Images) -> list[np.ndarray]:
    return list(images) if isinstance(images, np.ndarray) else images


def _check_batch(array: np.ndarray) -> np.ndarray:
    """(N, H, W[, C]) uint8 with C in {1, 3} as (N, H, W, C)."""
    if array.ndim == 3:
        array = array[:, :, :, None]
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[3] not in (1, 3):
        raise DataError(f"decode: expected uint8 images (N, H, W, C) with C = 1 or 3, "
                        f"got dtype {array.dtype} shape {array.shape}")
    return array


# How ``Decoder`` resizes, in words a device's own preprocessing can follow (an exported model's
# description carries it): a different resize (a centre crop, another filter) gives other pixels.
RESIZE = {
    "method": "bilinear",
    "antialias": "when shrinking (torch.nn.functional.interpolate antialias=True); none when enlarging",
    "align_corners": False,
    "aspect": "not kept: the whole image is stretched to resolution x resolution (no crop, no padding)",
    "orientation": "EXIF orientation applied first (a rotated phone photo is turned upright)",
    "grayscale": "one channel, repeated to three",
    "order": "resize the pixels (as float), then (pixel / 255 - mean) / std",
}


class Decoder:
    """Images -> float32 tensor (N, 3, R, R): resized (antialiased bilinear) and normalized with mean/std.

    Grayscale is replicated to three channels so pretrained RGB backbones apply.
    Normalization is folded into one affine step, ``x * 1/(255 std) - mean/std``.
    Resizing is linear with weights summing to one, so normalizing before or after
    it gives the same result; the order is chosen to touch the large tensor once
    (grayscale is resized as one channel and broadcast to three while normalizing).
    """

    def __init__(self, resolution: int, *, mean: Sequence[float], std: Sequence[float]) -> None:
        if resolution < 1:
            raise DataError(f"decode: resolution must be >= 1, got {resolution}")
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise DataError(f"decode: mean and std need 3 values each (RGB) with std > 0, "
                            f"got mean={tuple(mean)}, std={tuple(std)}")
        self.resolution = int(resolution)
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self._scale = torch.tensor([1.0 / (255.0 * s) for s in self.std]).view(1, 3, 1, 1)
        self._shift = torch.tensor([-m / s for m, s in zip(self.mean, self.std, strict=True)])
        self._shift = self._shift.view(1, 3, 1, 1)

    def __repr__(self) -> str:
        return f"Decoder(resolution={self.resolution}, mean={self.mean}, std={self.std})"

    def __call__(self, images: Images) -> torch.Tensor:
        if isinstance(images, np.ndarray):
            return self._decode(_check_batch(images))
        r = self.resolution
        out = torch.empty((len(images), 3, r, r), dtype=torch.float32)
        arrays = [np.asarray(im) for im in images]
        arrays = [a[:, :, None] if a.ndim == 2 else a for a in arrays]
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, a in enumerate(arrays):
            groups.setdefault(a.shape, []).append(i)
        for positions in groups.values():
            batch = _check_batch(np.stack([arrays[i] for i in positions]))
            out[torch.as_tensor(positions)] = self._decode(batch)
        return out

    def _decode(self, array: np.ndarray) -> torch.Tensor:
        n, h, w, c = array.shape
        r = self.resolution
        x = torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2)  # NHWC memory
        if (h, w) == (r, r):
            # One pass from uint8 NHWC to normalized float NCHW; ``out`` makes the result contiguous
            # (left to itself it would follow the input's channels-last strides). (N, C, R, R) *
            # (1, 3, 1, 1): grayscale broadcasts to 3 channels in the same step.
            out = torch.empty((n, 3, r, r), dtype=torch.float32)
            return torch.addcmul(self._shift, x, self._scale, out=out)
        x = x.contiguous()
        size = (r, r)
        # Antialiasing only changes downscaling; upward it is plain bilinear, which is faster.
        antialias = h > r or w > r
        if c == 3 and h * w <= r * r:
            # Normalize the smaller (input) side, then resize: one pass over the large output.
            x = torch.addcmul(self._shift, x, self._scale)
            return F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=antialias)
        x = F.interpolate(x.to(torch.float32), size=size, mode="bilinear", align_corners=False,
                          antialias=antialias)
        if c == 3:
            return torch.addcmul(self._shift, x, self._scale, out=x)
        return torch.addcmul(self._shift, x, self._scale)  # resize one channel, broadcast to three here


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, vectorized: a cheap, well-mixed 64-bit hash (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_seeds(seed: int, epoch: int, idx: np.ndarray, streams: int) -> np.ndarray:
    """(N, streams) independent 63-bit seeds per sample, a pure function of (seed, epoch, index, stream)."""
    with np.errstate(over="ignore"):
        base = _splitmix64(np.array([seed & _MASK64], np.uint64))
        base = _splitmix64(base ^ np.uint64(epoch & _MASK64))
        per_sample = _splitmix64(base ^ np.asarray(idx).astype(np.int64).astype(np.uint64))
        stream = np.arange(1, streams + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        seeds = _splitmix64(per_sample[:, None] ^ stream[None, :])
    return (seeds >> np.uint64(1)).astype(np.int64)


class InputAugment:
    """Input-space augmentation with albumentations, deterministic per (seed, epoch, sample index).

    - ``random_resized_crop=(lo, hi)``: crop a random area fraction in [lo, hi] (aspect 3/4..4/3)
      and resize it back to the image's own size;
    - ``crop_padding=p``: zero-pad by ``p`` on each side, then crop back at a random offset;
    - ``hflip``: flip horizontally with this probability.

    Each random transform is reseeded per sample with its own seed stream: giving all
    of them one seed (what ``Compose.set_random_seed`` does) would correlate their
    draws, e.g. flip only ever paired with crops from the top half.
    """

    def __init__(self, *, random_resized_crop: tuple[float, float] | None = None,
                 crop_padding: int | None = None, hflip: float = 0.0) -> None:
        if random_resized_crop is not None:
            lo, hi = (float(v) for v in random_resized_crop)
            if not 0.0 < lo <= hi <= 1.0:
                raise DataError(f"augment: random_resized_crop scale range must satisfy 0 < lo <= hi <= 1, "
                                f"got {tuple(random_resized_crop)}")
            random_resized_crop = (lo, hi)
        if crop_padding is not None and crop_padding < 0:
            raise DataError(f"augment: crop_padding must be >= 0, got {crop_padding}")
        if not 0.0 <= hflip <= 1.0:
            raise DataError(f"augment: hflip is a probability in [0, 1], got {hflip}")
        self.random_resized_crop = random_resized_crop
        self.crop_padding = crop_padding or 0
        self.hflip = float(hflip)
        self._local = threading.local()  # albumentations transforms carry RNG state: one set per thread

    def __repr__(self) -> str:
        return (f"InputAugment(random_resized_crop={self.random_resized_crop}, "
                f"crop_padding={self.crop_padding}, hflip={self.hflip})")

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    @property
    def enabled(self) -> bool:
        return self.random_resized_crop is not None or self.crop_padding > 0 or self.hflip > 0

    def _pipeline(self, h: int, w: int) -> tuple[A.Compose, list[A.BasicTransform]]:
        """The (cached, per-thread) transforms for one image size, and those that draw random numbers."""
        cache: dict[tuple[int, int], tuple[A.Compose, list[A.BasicTransform]]]
        cache = self._local.__dict__.setdefault("pipelines", {})
        if (h, w) not in cache:
            steps: list[A.BasicTransform] = []
            random_steps: list[A.BasicTransform] = []
            if self.random_resized_crop is not None:
                rrc = A.RandomResizedCrop(size=(h, w), scale=self.random_resized_crop, p=1.0)
                steps.append(rrc)
                random_steps.append(rrc)
            if self.crop_padding > 0:
                p = self.crop_padding
                crop = A.RandomCrop(height=h, width=w, p=1.0)
                steps += [A.PadIfNeeded(min_height=h + 2 * p, min_width=w + 2 * p, position="center",
                                        border_mode=cv2.BORDER_CONSTANT, fill=0, p=1.0), crop]
                random_steps.append(crop)
            if self.hflip > 0:
                flip = A.HorizontalFlip(p=self.hflip)
                steps.append(flip)
                random_steps.append(flip)
            cache[(h, w)] = (A.Compose(steps, p=1.0), random_steps)
        return cache[(h, w)]

    def __call__(self, images: Images, idx: np.ndarray, *, epoch: int, seed: int) -> Images:
        """Augmented copies of ``images`` (same form and sizes); ``idx``: sample indices within the split."""
        if not self.enabled:
            return images
        idx = np.asarray(idx)
        if idx.shape != (len(images),):
            raise DataError(f"augment: got {len(images)} images but {idx.shape} sample indices; "
                            f"need one index per image")
        seeds = sample_seeds(seed, epoch, idx, 3)
        out: list[np.ndarray] = []
        for image, row in zip(_images_list(images), seeds, strict=True):
            image = np.asarray(image)
            compose, random_steps = self._pipeline(image.shape[0], image.shape[1])
            for transform, s in zip(random_steps, row, strict=False):
                transform.set_random_seed(int(s))
            result = compose(image=image)["image"]
            out.append(result.reshape(image.shape))
        if isinstance(images, np.ndarray):
            return np.stack(out) if out else images.copy()
        return out
