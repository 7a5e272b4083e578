"""Dataset sources: digits, Fashion-MNIST (Debian package or root), CIFAR errors, synthetic data."""

from __future__ import annotations

import gzip
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pipeline.data import sources
from pipeline.data.sources import cifar10, cifar100, digits, fashion_mnist, synthetic
from pipeline.errors import DataError, MissingPathError
from tests.data.test_idx import idx_bytes

DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")


def test_digits_counts_classes_and_pixel_range() -> None:
    sets = digits()
    assert list(sets) == ["train"]
    s = sets["train"]
    assert len(s) == 1797 and s.class_names == [str(i) for i in range(10)]
    assert s.labels.dtype == np.int64 and np.bincount(s.labels).sum() == 1797
    assert np.bincount(s.labels).min() >= 170
    images = s.load(np.arange(len(s)))
    assert images.shape == (1797, 8, 8, 1) and images.dtype == np.uint8
    assert images.max() == 255 and images.min() == 0
    assert s.identity() == digits()["train"].identity()


@pytest.mark.skipif(not (DEBIAN_FASHION / "train-images-idx3-ubyte.gz").is_file(),
                    reason="Debian package dataset-fashion-mnist not installed "
                           "(apt-get install dataset-fashion-mnist)")
def test_fashion_mnist_from_debian_package() -> None:
    sets = fashion_mnist()
    assert {k: len(v) for k, v in sets.items()} == {"train": 60000, "test": 10000}
    assert sets["train"].class_names[0] == "T-shirt/top" and len(sets["train"].class_names) == 10
    assert np.bincount(sets["train"].labels).tolist() == [6000] * 10
    assert np.bincount(sets["test"].labels).tolist() == [1000] * 10
    batch = sets["test"].load(np.array([0, 9999]))
    assert batch.shape == (2, 28, 28, 1) and batch.dtype == np.uint8 and batch.max() > 0
    assert sets["train"].identity() != sets["test"].identity()
    assert fashion_mnist(root=DEBIAN_FASHION)["train"].identity() == sets["train"].identity()


def _fake_fashion(folder: Path, n_train: int = 12, n_test: int = 6) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(idx_bytes(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))))
        (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(idx_bytes((np.arange(n) % 10).astype(np.uint8))))


@pytest.mark.parametrize("layout", ["", "FashionMNIST/raw"])
def test_fashion_mnist_from_root(tmp_path: Path, layout: str) -> None:
    _fake_fashion(tmp_path / layout)
    sets = fashion_mnist(root=tmp_path)
    assert {k: len(v) for k, v in sets.items()} == {"train": 12, "test": 6}
    assert sets["train"].load(np.arange(12)).shape == (12, 28, 28, 1)


def test_fashion_mnist_missing_says_where_and_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "FASHION_PREFIXES", (str(tmp_path / "usr"),))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    with pytest.raises(MissingPathError, match=r"apt-get install dataset-fashion-mnist.*`root:`") as err:
        fashion_mnist()
    assert str(tmp_path / "usr") in str(err.value)
    with pytest.raises(MissingPathError, match=str(tmp_path / "nowhere")):
        fashion_mnist(root=tmp_path / "nowhere")


def test_fashion_mnist_found_under_a_system_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_fashion(tmp_path / "usr/share/datasets/fashion-mnist")
    monkeypatch.setattr(sources, "FASHION_PREFIXES", (str(tmp_path / "usr"),))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    assert len(fashion_mnist()["train"]) == 12


def test_fashion_mnist_partial_install_names_missing_file(tmp_path: Path) -> None:
    _fake_fashion(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(MissingPathError, match=r"missing .*t10k-labels-idx1-ubyte\.gz"):
        fashion_mnist(root=tmp_path)


def test_fashion_mnist_count_mismatch_names_files(tmp_path: Path) -> None:
    _fake_fashion(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros(5, np.uint8))))
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte\.gz holds 5 labels but .*t10k-images"):
        fashion_mnist(root=tmp_path)


@pytest.mark.parametrize(("loader", "folder"),
                         [(cifar10, "cifar-10-batches-py"), (cifar100, "cifar-100-python")])
def test_cifar_missing_names_root_without_downloading(tmp_path: Path, loader: Callable[..., object],
                                                      folder: str) -> None:
    with pytest.raises(MissingPathError, match=rf"{tmp_path}/{folder} not found.*`root:`"):
        loader(tmp_path)


def test_synthetic_is_deterministic_per_index_and_learnable() -> None:
    s = synthetic(200, 4, 16, seed=3)["train"]
    assert len(s) == 200 and s.class_names == ["class_0", "class_1", "class_2", "class_3"]
    assert np.bincount(s.labels).tolist() == [50] * 4
    whole = s.load(np.arange(200))
    assert whole.shape == (200, 16, 16, 3) and whole.dtype == np.uint8
    np.testing.assert_array_equal(s.load(np.array([7, 3]))[0], whole[7])  # independent of batch
    np.testing.assert_array_equal(synthetic(200, 4, 16, seed=3)["train"].load(np.array([5]))[0], whole[5])
    assert s.identity() == synthetic(200, 4, 16, seed=3)["train"].identity()
    assert s.identity() != synthetic(200, 4, 16, seed=4)["train"].identity()
    # Learnable: nearest class mean colour on held-out half beats chance by far.
    feats = whole.reshape(200, -1, 3).mean(axis=1)
    means = np.stack([feats[:100][s.labels[:100] == c].mean(axis=0) for c in range(4)])
    pred = np.argmin(((feats[100:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (pred == s.labels[100:]).mean() > 0.9
    gray = synthetic(10, 2, 8, channels=1)["train"].load(np.arange(10))
    assert gray.shape == (10, 8, 8, 1)
    with pytest.raises(DataError, match="channels"):
        synthetic(10, 2, 8, channels=2)


def test_in_memory_and_generated_sets_split_loading_into_read_and_decode() -> None:
    mem = digits()["train"]
    assert not mem.decodes  # a memory copy: nothing worth spreading over threads
    idx = np.array([5, 1, 9])
    assert np.array_equal(mem.decode(mem.read(idx)), mem.load(idx))
    gen = synthetic(12, 3, 10, seed=1)["train"].subset(np.array([11, 2, 7, 4]))
    assert gen.decodes
    raw = gen.read(np.array([3, 0, 2]))
    assert np.array_equal(gen.decode(raw), gen.load(np.array([3, 0, 2])))
