"""companion.data: the offline data sets, Fashion-MNIST's failure modes, and the fallback."""

import pytest
import torch
from torch.utils.data import DataLoader

from companion import data
from companion.data import (
    DataUnavailableError,
    ToyDataset,
    load_digits,
    load_fashion_mnist,
    load_image_data,
    make_spirals,
    make_toy_data,
)


def test_toy_data_is_the_appendix_data():
    X_train, y_train, X_test, y_test = make_toy_data()
    assert X_train.shape == (5, 2) and X_test.shape == (2, 2)
    assert y_train.tolist() == [0, 0, 0, 1, 1] and y_test.tolist() == [0, 1]


def test_toy_dataset_in_a_loader():
    X, y, _, _ = make_toy_data()
    loader = DataLoader(ToyDataset(X, y), batch_size=2, shuffle=False, drop_last=True)
    batches = list(loader)
    assert len(batches) == 2  # 5 items, batches of 2, the last one dropped
    assert torch.equal(batches[0][0], X[:2])


def test_toy_dataset_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        ToyDataset(torch.zeros(3, 2), torch.zeros(2))


def test_spirals_shape_labels_and_determinism():
    g = torch.Generator().manual_seed(1)
    points, labels = make_spirals(200, noise_std=0.05, generator=g)
    again, labels2 = make_spirals(200, noise_std=0.05, generator=torch.Generator().manual_seed(1))
    assert points.shape == (200, 2) and labels.shape == (200,)
    assert set(labels.tolist()) == {0, 1}
    assert torch.equal(points, again) and torch.equal(labels, labels2)
    # Without noise every point lies within the unit disc (radius sqrt(t) <= 1).
    clean, _ = make_spirals(200, generator=g)
    assert clean.norm(dim=1).max() <= 1 + 1e-6


def test_digits_look_like_fashion_mnist():
    digits = load_digits()
    images, labels = digits.train.tensors
    assert images.shape[1:] == (1, 28, 28)
    assert images.dtype == torch.float32 and 0 <= images.min() and images.max() <= 1
    assert len(digits.train) + len(digits.test) == 1797
    assert set(labels.tolist()) == set(range(10))
    assert len(digits.classes) == 10


def test_fashion_mnist_missing_is_one_sentence(tmp_path):
    with pytest.raises(DataUnavailableError) as info:
        load_fashion_mnist(tmp_path, download=False)
    message = str(info.value)
    assert str(tmp_path) in message and "\n" not in message


def test_fallback_says_which_data_set(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data, "_online", lambda *a, **k: False)
    result = load_image_data(tmp_path, max_train=100, max_test=50)
    out = capsys.readouterr().out
    assert out.startswith("Data set: scikit-learn digits")
    assert len(result.train) == 100 and len(result.test) == 50


def test_local_fashion_mnist_is_used(tmp_path, capsys):
    # Write a tiny Fashion-MNIST in its raw IDX format: 3 training, 2 test images.
    import numpy as np

    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)

    def write_idx(name, array):
        header = b"\x00\x00\x08" + bytes([array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
        (raw / name).write_bytes(header + array.astype(np.uint8).tobytes())

    rng = np.random.default_rng(0)
    write_idx("train-images-idx3-ubyte", rng.integers(0, 256, (3, 28, 28)))
    write_idx("train-labels-idx1-ubyte", np.array([1, 2, 3]))
    write_idx("t10k-images-idx3-ubyte", rng.integers(0, 256, (2, 28, 28)))
    write_idx("t10k-labels-idx1-ubyte", np.array([4, 5]))

    result = load_image_data(tmp_path, download=False)
    assert "Data set: Fashion-MNIST" in capsys.readouterr().out
    assert result.train.tensors[0].shape == (3, 1, 28, 28)
    assert result.test.tensors[1].tolist() == [4, 5]
