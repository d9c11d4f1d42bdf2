"""companion.data: the offline data sets, Fashion-MNIST's failure modes, and the fallback."""

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

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
    # the numbers chapter 03 prints and the appendix uses
    expected = torch.tensor(
        [[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]]
    )
    torch.testing.assert_close(X_train, expected)
    torch.testing.assert_close(X_test, torch.tensor([[-0.8, 2.8], [2.6, -1.6]]))
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
    again, labels2 = make_spirals(
        200, noise_std=0.05, generator=torch.Generator().manual_seed(1)
    )
    assert points.shape == (200, 2) and labels.shape == (200,)
    assert set(labels.tolist()) == {0, 1}
    assert torch.equal(points, again) and torch.equal(labels, labels2)
    # Without noise every point lies within the unit disc (radius sqrt(t) <= 1).
    clean, _ = make_spirals(200, generator=g)
    assert clean.norm(dim=1).max() <= 1 + 1e-6


def test_spirals_wind_as_promised():
    # Five points at t = 0, 1/4, 1/2, 3/4, 1: radius sqrt(t), angle 2 pi x radius
    # x rotations,
    # mirrored through the origin for label 0.
    points, labels = make_spirals(5, generator=torch.Generator().manual_seed(0))
    side = (2 * labels - 1).float()
    torch.testing.assert_close(
        points.norm(dim=1), torch.tensor([0.0, 0.5, 0.5**0.5, 0.75**0.5, 1.0])
    )
    torch.testing.assert_close(
        points[1], torch.tensor([-0.5, 0.0]) * side[1], atol=1e-6, rtol=0
    )  # half a turn
    torch.testing.assert_close(
        points[4], torch.tensor([1.0, 0.0]) * side[4], atol=1e-6, rtol=0
    )  # a whole turn
    half, labels = make_spirals(
        5, rotations=0.5, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(
        half[4], torch.tensor([-1.0, 0.0]) * (2 * labels[4] - 1), atol=1e-6, rtol=0
    )
    noisy, _ = make_spirals(
        2000, noise_std=0.1, generator=torch.Generator().manual_seed(0)
    )
    clean, _ = make_spirals(2000, generator=torch.Generator().manual_seed(0))
    # the same labels come first from the generator; the noise is what differs
    assert 0.08 < (noisy - clean).std().item() < 0.12


def test_digits_look_like_fashion_mnist():
    torch.manual_seed(123)  # the split must not depend on the global generator
    digits = load_digits()
    images, labels = digits.train.tensors
    assert images.shape[1:] == (1, 28, 28)
    assert images.dtype == torch.float32 and 0 <= images.min() and images.max() <= 1
    assert len(digits.train) + len(digits.test) == 1797
    assert set(labels.tolist()) == set(range(10)) and labels.dtype == torch.long
    assert digits.classes == ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
    assert images.max() == 1.0  # the 16 grey levels are scaled to [0, 1]
    test_images, test_labels = digits.test.tensors
    assert test_images.shape == (359, 1, 28, 28)  # 20 % of 1,797
    # the split is fixed by the seed: the same first test labels on every machine
    assert test_labels[:10].tolist() == [6, 5, 5, 7, 9, 9, 8, 4, 6, 8]


def test_fashion_mnist_missing_is_one_sentence(tmp_path):
    with pytest.raises(DataUnavailableError) as info:
        load_fashion_mnist(tmp_path)  # downloading is opt-in
    assert str(info.value) == (
        f"Fashion-MNIST is not in {tmp_path} and downloading was not allowed; put the "
        "four "
        f"*-ubyte files in {tmp_path}/FashionMNIST/raw or call load_image_data() to "
        "use the offline digits."
    )


def test_fallback_says_which_data_set(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data, "_online", lambda *a, **k: False)
    result = load_image_data(tmp_path, max_train=100, max_test=50)
    out = capsys.readouterr().out
    assert out.startswith(
        "Data: scikit-learn's digits, 100 training and 50 test images"
    )
    assert out.endswith(f"\n{data.FALLBACK_NOTE}\n")
    assert len(result.train) == 100 and len(result.test) == 50


def write_fashion_mnist(root):
    """Write a tiny Fashion-MNIST in its raw IDX format: 3 training and 2 test images."""
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)

    def write_idx(name, array):
        header = (
            b"\x00\x00\x08"
            + bytes([array.ndim])
            + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
        )
        (raw / name).write_bytes(header + array.astype(np.uint8).tobytes())

    rng = np.random.default_rng(0)
    train_images = rng.integers(0, 255, (3, 28, 28))
    train_images[0, 0, 0] = 255  # the brightest pixel becomes 1.0
    write_idx("train-images-idx3-ubyte", train_images)
    write_idx("train-labels-idx1-ubyte", np.array([1, 2, 3]))
    write_idx("t10k-images-idx3-ubyte", rng.integers(0, 256, (2, 28, 28)))
    write_idx("t10k-labels-idx1-ubyte", np.array([4, 5]))


FASHION_LINE = (
    "Data: Fashion-MNIST, 3 training and 2 test images of 1 x 28 x 28, 10 classes"
)


def test_local_fashion_mnist_is_used(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        data, "_online", lambda *a, **k: pytest.fail("files on disk need no network")
    )
    write_fashion_mnist(tmp_path)
    result = load_image_data(tmp_path, download=False)
    assert capsys.readouterr().out == f"{FASHION_LINE} (found on disk).\n"
    assert result.train.tensors[0].shape == (3, 1, 28, 28)
    assert result.test.tensors[1].tolist() == [4, 5]
    images = result.train.tensors[0]
    assert images.dtype == torch.float32 and images.max() == 1.0  # bytes / 255
    assert result.classes[9] == "ankle boot"
    one = load_image_data(tmp_path, download=False, max_train=1, max_test=5)
    assert (len(one.train), len(one.test)) == (1, 2)
    monkeypatch.setenv("COURSE_DATA", str(tmp_path))  # the default folder
    assert len(load_image_data(download=False).train) == 3
    assert len(load_fashion_mnist().test) == 2


@pytest.fixture
def network(monkeypatch):
    """No network in tests: stub the reachability check and torchvision's downloader.

    The "download" writes the tiny data set; ``calls`` records what was asked.
    """
    from torchvision import datasets

    calls = {"online": [], "download": 0}

    def online(*args, **kwargs):
        calls["online"].append(args)
        return True

    def download(dataset):
        calls["download"] += 1
        print(
            "Downloading https://fashion-mnist.example/train-images-idx3-ubyte.gz"
        )  # as torchvision does
        print("Failed to download (trying next)", file=sys.stderr)
        write_fashion_mnist(Path(dataset.root))

    monkeypatch.setattr(data, "_online", online)
    monkeypatch.setattr(datasets.FashionMNIST, "download", download)
    monkeypatch.delenv("COURSE_OFFLINE", raising=False)
    return calls


@pytest.fixture
def stand_in(monkeypatch):
    """A small stand-in for the digits (scikit-learn's take a second to load)."""
    fake = data.ImageData(
        "scikit-learn's digits",
        TensorDataset(torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long)),
        TensorDataset(torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long)),
        [str(d) for d in range(10)],
    )
    monkeypatch.setattr(data, "load_digits", lambda: fake)
    return fake


@pytest.mark.parametrize("switch", [None, "", "0"], ids=["unset", "empty", "zero"])
def test_download_when_online(tmp_path, network, monkeypatch, capsys, switch):
    if switch is not None:
        monkeypatch.setenv("COURSE_OFFLINE", switch)
    result = load_image_data(tmp_path)
    assert capsys.readouterr() == (
        f"{FASHION_LINE} (downloaded).\n",
        "",
    )  # torchvision's chatter is hidden
    assert (
        network["online"] == [()] and network["download"] == 2
    )  # training and test set
    assert (tmp_path / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte").exists()
    assert result.test.tensors[1].tolist() == [4, 5]


@pytest.mark.parametrize("switch", ["1", "yes"])
def test_offline_switch_never_downloads(
    tmp_path, network, stand_in, monkeypatch, capsys, switch
):
    monkeypatch.setenv("COURSE_OFFLINE", switch)
    result = load_image_data(tmp_path)
    assert result is stand_in
    assert network == {"online": [], "download": 0}  # not even a connection attempt
    assert capsys.readouterr().out == (
        "Data: scikit-learn's digits, 4 training and 2 test images of 1 x 28 x 28, "
        "10 classes.\n(Where Fashion-MNIST is on disk or can be downloaded, the same "
        "code uses it instead.)\n"
    )


def test_download_not_allowed(tmp_path, network, stand_in):
    assert load_image_data(tmp_path, download=False) is stand_in
    assert network == {"online": [], "download": 0}


def test_unreachable_host_means_no_download(tmp_path, network, stand_in, monkeypatch):
    monkeypatch.setattr(data, "_online", lambda *a, **k: False)
    assert load_image_data(tmp_path) is stand_in
    assert network["download"] == 0


def test_failed_download_is_one_sentence_then_the_fallback(
    tmp_path, network, stand_in, monkeypatch, capsys
):
    from torchvision import datasets

    def broken(dataset):
        raise RuntimeError(
            "Error downloading train-images-idx3-ubyte.gz: every mirror failed"
        )

    monkeypatch.setattr(datasets.FashionMNIST, "download", broken)
    with pytest.raises(
        DataUnavailableError,
        match=r"^Fashion-MNIST is not in \S+ and the download failed; put",
    ) as info:
        load_fashion_mnist(tmp_path, download=True)
    assert isinstance(info.value.__cause__, RuntimeError) and "\n" not in str(
        info.value
    )
    assert f"{tmp_path}/FashionMNIST/raw" in str(info.value)
    assert load_image_data(tmp_path) is stand_in
    assert capsys.readouterr().out.endswith(f"\n{data.FALLBACK_NOTE}\n")


@pytest.mark.parametrize("reachable", [True, False])
def test_online_tries_one_connection(monkeypatch, reachable):
    attempts = []

    def create_connection(address, timeout):
        attempts.append((address, timeout))
        if not reachable:
            raise OSError("Network is unreachable")
        return contextlib.nullcontext()

    monkeypatch.setattr(data.socket, "create_connection", create_connection)
    assert data._online() is reachable
    assert attempts == [(data.FASHION_MNIST_HOST, 2.0)]


def test_default_data_root(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_DATA", str(tmp_path / "course"))
    assert data.default_data_root() == tmp_path / "course"
    monkeypatch.delenv("COURSE_DATA")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert data.default_data_root() == tmp_path / "data"
