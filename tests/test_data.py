"""Datasets, normalisation and augmentation, on tiny seeded arrays."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from float32_expected import Expected, assert_close

from tinyconv import cifar10
from tinyconv.data import (
    Dataset,
    Normalizer,
    augment,
    channel_stats,
    load_dataset,
    synthetic_dataset,
)


def _images(n: int = 6, c: int = 3, h: int = 8, w: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, c, h, w), dtype=np.uint8)


# ---- datasets -----------------------------------------------------------------------


def test_synthetic_shapes_dtypes_and_balance():
    ds = synthetic_dataset(n_train=200, n_test=50, seed=0)
    assert isinstance(ds, Dataset) and ds.name == "synthetic" and ds.num_classes == 10
    assert ds.x_train.shape == (200, 3, 32, 32) and ds.x_train.dtype == np.uint8
    assert ds.x_test.shape == (50, 3, 32, 32) and ds.x_test.dtype == np.uint8
    assert ds.y_train.shape == (200,) and ds.y_train.dtype == np.int64
    assert np.bincount(ds.y_train, minlength=10).tolist() == [20] * 10
    assert np.bincount(ds.y_test, minlength=10).tolist() == [5] * 10
    assert ds.x_train.std() > 20  # real contrast, not a flat grey


def test_synthetic_is_deterministic_per_seed_and_differs_across_seeds():
    a, b = synthetic_dataset(64, 32, seed=7), synthetic_dataset(64, 32, seed=7)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    c = synthetic_dataset(64, 32, seed=8)
    assert not np.array_equal(a.x_train, c.x_train)
    # the test set does not depend on how many training images were drawn
    np.testing.assert_array_equal(synthetic_dataset(16, 32, seed=7).x_test, a.x_test)


def test_synthetic_other_sizes_and_bad_arguments():
    ds = synthetic_dataset(n_train=12, n_test=6, num_classes=3, image_size=16)
    assert ds.x_train.shape == (12, 3, 16, 16) and ds.classes == ["class_0", "class_1", "class_2"]
    with pytest.raises(ValueError, match="num_classes >= 2"):
        synthetic_dataset(num_classes=1)


def test_synthetic_test_set_is_predictable_from_the_training_set():
    """Nearest class mean on normalised pixels: far above the 10% of chance if the classes are learnable."""
    ds = synthetic_dataset(n_train=300, n_test=100, seed=1)
    norm = Normalizer(*channel_stats(ds.x_train))
    x_train = norm(ds.x_train).reshape(len(ds.x_train), -1)
    x_test = norm(ds.x_test).reshape(len(ds.x_test), -1)
    centroids = np.stack([x_train[ds.y_train == k].mean(axis=0) for k in range(10)])
    pred = ((x_test[:, None, :] - centroids[None]) ** 2).sum(axis=-1).argmin(axis=1)
    assert (pred == ds.y_test).mean() > 0.8


def test_load_dataset_dispatches_and_rejects_unknown_names(tmp_path):
    ds = load_dataset("synthetic", seed=3)
    np.testing.assert_array_equal(ds.x_train, synthetic_dataset(seed=3).x_train)
    with pytest.raises(ValueError, match="unknown dataset 'mnist'; choose one of: cifar10, synthetic"):
        load_dataset("mnist")
    with pytest.raises(cifar10.DataError, match="not found"):
        load_dataset("cifar10", data_dir=tmp_path, download=False)


def test_load_dataset_cifar10_from_a_folder(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / cifar10.BATCHES_DIRNAME
    folder.mkdir()
    for name in cifar10.REQUIRED_FILES:
        batch = {b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), b"labels": [1, 9]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    ds = load_dataset("cifar10", data_dir=tmp_path, download=False)
    assert ds.name == "cifar10" and ds.classes == cifar10.LABEL_NAMES
    assert ds.x_train.shape == (10, 3, 32, 32) and ds.x_test.shape == (2, 3, 32, 32)
    assert ds.y_train.tolist() == [1, 9] * 5


# ---- statistics and normalisation ---------------------------------------------------


def test_channel_stats_matches_numpy_across_chunks():
    x = _images(n=7)
    mean, std = channel_stats(x, chunk=3)
    as_float = x.astype(np.float64) / 255
    np.testing.assert_allclose(mean, as_float.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(std, as_float.std(axis=(0, 2, 3)), rtol=1e-9)
    flat_mean, flat_std = channel_stats(np.full((2, 3, 4, 4), 51, dtype=np.uint8))
    np.testing.assert_allclose(flat_mean, [0.2] * 3)
    np.testing.assert_array_equal(flat_std, [0.0] * 3)
    with pytest.raises(ValueError, match="uint8 images"):
        channel_stats(x.astype(np.float32))


def test_normalizer_matches_the_formula():
    x = _images()
    mean, std = np.array([0.49, 0.48, 0.45]), np.array([0.25, 0.24, 0.26])
    out = Normalizer(mean, std)(x)
    assert out.dtype == np.float32 and out.shape == x.shape
    expected = (x / 255.0 - mean[:, None, None]) / std[:, None, None]
    # x * scale + shift in float32, scale and shift rounded: k = 3, terms |x * scale| + |shift|
    terms = (x / 255.0 + mean[:, None, None]) / std[:, None, None]
    assert_close(out.astype(np.float64), Expected(expected, 3, terms))


def test_normalizer_rejects_bad_input():
    norm = Normalizer([0.5, 0.5, 0.5], [0.2, 0.2, 0.2])
    with pytest.raises(ValueError, match="uint8 images of shape"):
        norm(np.zeros((2, 3, 4, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="3 channels, the images have 1"):
        norm(np.zeros((2, 1, 4, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="std must be positive"):
        Normalizer([0.5, 0.5, 0.5], [0.2, 0.0, 0.2])


# ---- augmentation -------------------------------------------------------------------


def _allowed_transforms(img: np.ndarray, pad: int) -> list[np.ndarray]:
    """Every crop (and its mirror) augment may produce from one image (C, H, W)."""
    _, h, w = img.shape
    padded = np.pad(img, ((0, 0), (pad, pad), (pad, pad)))
    crops = [padded[:, dy : dy + h, dx : dx + w] for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)]
    return crops + [crop[:, :, ::-1] for crop in crops]


def test_augment_without_crop_or_flip_is_identity():
    x = _images()
    out = augment(x, np.random.default_rng(0), crop_pad=0, flip=False)
    assert out.dtype == x.dtype and out.shape == x.shape
    np.testing.assert_array_equal(out, x)
    assert out is not x


def test_augment_flip_only_mirrors_the_width_axis():
    x = _images(n=64)
    out = augment(x, np.random.default_rng(0), crop_pad=0, flip=True)
    flipped = [not np.array_equal(o, i) for o, i in zip(out, x, strict=True)]
    for o, i, f in zip(out, x, flipped, strict=True):
        np.testing.assert_array_equal(o, i[:, :, ::-1] if f else i)
    assert 10 < sum(flipped) < 54  # about half


def test_augment_outputs_are_allowed_transforms_of_their_inputs():
    pad, x = 2, _images(n=40, h=6, w=5)
    out = augment(x, np.random.default_rng(1), crop_pad=pad, flip=True)
    assert out.dtype == np.uint8 and out.shape == x.shape
    used = set()
    for o, i in zip(out, x, strict=True):
        matches = [k for k, t in enumerate(_allowed_transforms(i, pad)) if np.array_equal(o, t)]
        assert matches, "an output is not a crop/flip of its input"
        used.add(matches[0])
    assert len(used) > 10  # offsets and flips vary across images
    np.testing.assert_array_equal(out, augment(x, np.random.default_rng(1), crop_pad=pad))  # seeded


def test_augment_rejects_bad_arguments():
    with pytest.raises(ValueError, match="crop_pad must be an int >= 0"):
        augment(_images(), np.random.default_rng(0), crop_pad=-1)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        augment(np.zeros((3, 8, 8), np.uint8), np.random.default_rng(0))
