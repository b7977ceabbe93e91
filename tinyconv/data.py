"""Datasets, normalisation and augmentation.

Images stay uint8 NCHW (N, 3, H, W) until a batch is drawn (``tinyconv/trainer.py``); then

    xb = augment(xb, rng)                                    # training only
    xb = normalizer(xb)                                      # uint8 (B, 3, H, W) -> float32

so a 50000-image training set costs 150 MB, not 600 MB of float32. Randomness always
comes from an explicit ``numpy.random.Generator``: nothing here touches global state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tinyconv.cifar10 import LABEL_NAMES, load_cifar10

DATASETS = ("cifar10", "synthetic")


@dataclass
class Dataset:
    """A train/test split: uint8 images (N, 3, H, W) and int64 labels (N,) in [0, len(classes))."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    name: str
    classes: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def load_dataset(
    name: str,
    data_dir: Path | str | None = None,
    download: bool = True,
    seed: int = 0,
    progress: bool = True,
) -> Dataset:
    """``"cifar10"`` (tinyconv/cifar10.py: ``data_dir``, ``download``, ``progress``; ``DataError`` if it cannot
    be had) or ``"synthetic"`` (seeded by ``seed``, offline)."""
    if name == "cifar10":
        return Dataset(*load_cifar10(data_dir, download=download, progress=progress), "cifar10", list(LABEL_NAMES))
    if name == "synthetic":
        return synthetic_dataset(seed=seed)
    raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")


# ---- synthetic data ---------------------------------------------------------------
def _class_templates(rng: np.random.Generator, num_classes: int, size: int, waves: int = 3) -> np.ndarray:
    """One smooth coloured pattern per class: float64 (num_classes, 3, size, size) in ~[0, 255]. Each channel
    is a base colour plus a few low-frequency plane waves: classes differ in colour and texture, and a
    shifted copy still looks like its class."""
    yy, xx = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    base = rng.uniform(60, 196, size=(num_classes, 3, 1, 1))
    freq = rng.uniform(-2.0, 2.0, size=(num_classes, 3, waves, 2)) * (2 * np.pi / size)  # <= 2 cycles
    phase = rng.uniform(0, 2 * np.pi, size=(num_classes, 3, waves))
    angle = freq[..., 0, None, None] * yy + freq[..., 1, None, None] * xx + phase[..., None, None]
    return base + (50.0 / np.sqrt(waves)) * np.sin(angle).sum(axis=2)


def _draw_samples(
    rng: np.random.Generator, canvas: np.ndarray, n: int, size: int, noise: float
) -> tuple[np.ndarray, np.ndarray]:
    """n balanced labels, and for each a randomly shifted window of its class canvas plus noise:
    canvas float32 (K, 3, size + 2 * shift, size + 2 * shift) -> uint8 (n, 3, size, size), int64 (n,)."""
    num_classes, max_shift = canvas.shape[0], (canvas.shape[-1] - size) // 2
    labels = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
    oy, ox = rng.integers(0, 2 * max_shift + 1, size=(2, n))
    windows = sliding_window_view(canvas, (size, size), axis=(2, 3))  # (K, 3, 2s+1, 2s+1, size, size)
    images = windows[labels, :, oy, ox]  # (n, 3, size, size) float32, a fresh array
    images += noise * rng.standard_normal(size=images.shape, dtype=np.float32)
    np.clip(images, 0, 255, out=images)
    return np.rint(images, out=images).astype(np.uint8), labels


def synthetic_dataset(
    n_train: int = 2048,
    n_test: int = 512,
    seed: int = 0,
    num_classes: int = 10,
    image_size: int = 32,
    max_shift: int = 4,
    noise: float = 24.0,
) -> Dataset:
    """A CIFAR-shaped, offline stand-in: uint8 (N, 3, image_size, image_size), balanced labels. Class k is its
    template shifted by up to ``max_shift`` pixels, plus Gaussian noise of std ``noise`` (in 0..255 units).
    A small CNN learns it in a few dozen SGD steps. Same seed, same data, whatever ``n_train``."""
    if n_train < 1 or n_test < 1 or num_classes < 2 or image_size < 1 or max_shift < 0 or noise < 0:
        raise ValueError(
            f"synthetic_dataset needs n_train, n_test >= 1, num_classes >= 2, image_size >= 1, "
            f"max_shift >= 0 and noise >= 0; got n_train={n_train}, n_test={n_test}, "
            f"num_classes={num_classes}, image_size={image_size}, max_shift={max_shift}, noise={noise}"
        )
    template_rng, train_rng, test_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    canvas = _class_templates(template_rng, num_classes, image_size + 2 * max_shift).astype(np.float32)
    x_train, y_train = _draw_samples(train_rng, canvas, n_train, image_size, noise)
    x_test, y_test = _draw_samples(test_rng, canvas, n_test, image_size, noise)
    classes = [f"class_{k}" for k in range(num_classes)]
    return Dataset(x_train, y_train, x_test, y_test, name="synthetic", classes=classes)


# ---- normalisation ------------------------------------------------------------------
def _check_images(x: np.ndarray, what: str) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 4:
        desc = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"{what} expects uint8 images of shape (N, C, H, W), got {desc}")


def channel_stats(x: np.ndarray, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of uint8 images (N, C, H, W), in [0, 1] units: two float64 (C,).

    A uint8 channel takes only 256 values, so this counts them (``chunk`` images at a time,
    exact integers) and takes the mean and variance of that histogram in float64: no big
    float copy of the 50000 CIFAR images, and no cancellation in the variance.
    """
    _check_images(x, "channel_stats")
    if len(x) == 0:
        raise ValueError("channel_stats needs at least one image, got an empty array")
    channels = x.shape[1]
    counts = np.zeros((channels, 256), dtype=np.int64)
    for start in range(0, len(x), chunk):
        part = x[start : start + chunk]
        for c in range(channels):
            counts[c] += np.bincount(part[:, c].ravel(), minlength=256)
    values = np.arange(256, dtype=np.float64) / 255.0
    total = counts.sum(axis=1)
    mean = counts @ values / total
    var = (counts * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / total
    return mean, np.sqrt(var)


class Normalizer:
    """uint8 (N, C, H, W) -> float32 (N, C, H, W) = (x / 255 - mean) / std, per channel; ``mean`` and ``std``
    (C,) in [0, 1] units, as from ``channel_stats``. One cast, then an in-place multiply-add."""

    def __init__(self, mean: np.ndarray, std: np.ndarray) -> None:
        mean, std = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
        if mean.ndim != 1 or mean.shape != std.shape:
            raise ValueError(f"mean and std must be 1-D of the same length, got {mean.shape} and {std.shape}")
        if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std > 0)):
            raise ValueError(f"std must be positive and mean, std finite; got mean={mean}, std={std}")
        self.mean, self.std = mean, std
        self._scale = (1.0 / (255.0 * std)).astype(np.float32)[:, None, None]
        self._shift = (-mean / std).astype(np.float32)[:, None, None]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        _check_images(x, "Normalizer")
        if x.shape[1] != len(self.mean):
            raise ValueError(f"Normalizer has {len(self.mean)} channels, the images have {x.shape[1]}")
        out = x.astype(np.float32)
        out *= self._scale
        out += self._shift
        return out


# ---- augmentation -------------------------------------------------------------------
def augment(x: np.ndarray, rng: np.random.Generator, crop_pad: int = 4, flip: bool = True) -> np.ndarray:
    """Random crop after zero padding, and random horizontal flip; (N, C, H, W) -> same shape/dtype.

    Each image is padded by ``crop_pad`` zeros on every side, a random H x W window cut from it, and with
    ``flip`` mirrored left-right with probability 1/2: one pad, then one gather over a sliding-window view.
    """
    if not isinstance(x, np.ndarray) or x.ndim != 4:
        raise ValueError(f"augment expects images of shape (N, C, H, W), got {getattr(x, 'shape', type(x))}")
    if not isinstance(crop_pad, (int, np.integer)) or crop_pad < 0:
        raise ValueError(f"crop_pad must be an int >= 0, got {crop_pad!r}")
    n, _, h, w = x.shape
    oy = rng.integers(0, 2 * crop_pad + 1, size=n)
    ox = rng.integers(0, 2 * crop_pad + 1, size=n)
    mirror = rng.random(n) < 0.5 if flip else np.zeros(n, dtype=bool)

    padded = np.pad(x, ((0, 0), (0, 0), (crop_pad, crop_pad), (crop_pad, crop_pad)))
    windows = sliding_window_view(padded, (h, w), axis=(2, 3))  # (N, C, 2p+1, 2p+1, H, W), no copy
    out = windows[np.arange(n), :, oy, ox]  # (N, C, H, W), a fresh array
    out[mirror] = out[mirror, :, :, ::-1]
    return out
