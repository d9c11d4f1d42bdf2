"""Data sets that need no download, and Fashion-MNIST when it can be had.

- ``make_toy_data``: five training and two test points, small enough to print.
- ``make_spirals``: two interleaved 2-D spirals (chapter 10).
- ``load_digits``: scikit-learn's 1,797 real 8x8 handwritten digits, upscaled
  to 28x28 so that models written for Fashion-MNIST take them unchanged.
- ``load_fashion_mnist``: from a local folder, or downloaded when allowed.
- ``load_image_data``: Fashion-MNIST when it is there or can be fetched,
  the digits otherwise; it always prints which one it used.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

__all__ = [
    "DataUnavailableError",
    "ImageData",
    "ToyDataset",
    "make_toy_data",
    "make_spirals",
    "default_data_root",
    "load_digits",
    "load_fashion_mnist",
    "load_image_data",
]

FASHION_MNIST_CLASSES = [
    "t-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
]
FASHION_MNIST_HOST = ("fashion-mnist.s3-website.eu-central-1.amazonaws.com", 80)


class DataUnavailableError(FileNotFoundError):
    """A data set is neither on disk nor downloadable."""


class ToyDataset(Dataset):
    """Features and labels held in two tensors; item ``i`` is ``(x[i], y[i])``.

    It lives in a module, not in a notebook, so that ``DataLoader`` worker
    processes can import it on every operating system. Used in chapter 03.
    """

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        if len(features) != len(labels):
            raise ValueError(
                f"features and labels differ in length ({len(features)} vs "
                f"{len(labels)})."
            )
        self.features = features
        self.labels = labels

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[index], self.labels[index]

    def __len__(self) -> int:
        return len(self.labels)


def make_toy_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``X_train, y_train, X_test, y_test``: two well separated classes in 2-D."""
    X_train = torch.tensor(
        [[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]]
    )
    y_train = torch.tensor([0, 0, 0, 1, 1])
    X_test = torch.tensor([[-0.8, 2.8], [2.6, -1.6]])
    y_test = torch.tensor([0, 1])
    return X_train, y_train, X_test, y_test


def make_spirals(
    n_samples: int,
    noise_std: float = 0.0,
    rotations: float = 1.0,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``points`` of shape ``(n_samples, 2)`` and ``labels`` in ``{0, 1}``.

    Each point sits on one of two spirals that wind ``rotations`` times around
    the origin; its label says which. Used in chapter 10.
    """
    ts = torch.linspace(0, 1, n_samples, device=device)
    rs = ts.sqrt()
    thetas = rs * rotations * 2 * math.pi
    signs = torch.randint(0, 2, (n_samples,), generator=generator).to(device) * 2 - 1
    noise = torch.randn(2, n_samples, generator=generator).to(device) * noise_std
    xs = rs * signs * torch.cos(thetas) + noise[0]
    ys = rs * signs * torch.sin(thetas) + noise[1]
    return torch.stack([xs, ys], dim=1), (signs > 0).long()


@dataclass
class ImageData:
    """An image-classification data set: images ``(N, 1, 28, 28)`` in [0, 1]."""

    name: str
    train: TensorDataset
    test: TensorDataset
    classes: list[str]

    def __str__(self) -> str:
        shape = " x ".join(str(n) for n in self.train.tensors[0].shape[1:])
        return (
            f"{self.name}, {len(self.train):,} training and {len(self.test):,} test "
            f"images of {shape}, {len(self.classes)} classes"
        )


def default_data_root() -> Path:
    """Return the data folder: ``$COURSE_DATA``, else ``~/data``."""
    return Path(os.environ.get("COURSE_DATA", "~/data")).expanduser()


def _subset(dataset: TensorDataset, limit: int | None) -> TensorDataset:
    if limit is None or limit >= len(dataset):
        return dataset
    return TensorDataset(*(t[:limit] for t in dataset.tensors))


def load_digits(size: int = 28, test_fraction: float = 0.2, seed: int = 0) -> ImageData:
    """Return scikit-learn's handwritten digits as 28x28 images (no download).

    The 1,797 8x8 images ship with scikit-learn. They are scaled to [0, 1],
    upscaled bilinearly to ``size`` x ``size`` and split into train and test
    sets with a fixed seed.
    """
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(
        images, size=(size, size), mode="bilinear", align_corners=False
    )
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return ImageData(
        name="scikit-learn's digits",
        train=TensorDataset(images[train], labels[train]),
        test=TensorDataset(images[test], labels[test]),
        classes=[str(d) for d in range(10)],
    )


def load_fashion_mnist(
    root: str | Path | None = None, download: bool = False
) -> ImageData:
    """Return Fashion-MNIST from ``root`` (default ``default_data_root()``).

    Raises:
        DataUnavailableError: the files are not in ``root`` and ``download`` is
            False, or the download failed.
    """
    from torchvision import datasets

    root = Path(root).expanduser() if root is not None else default_data_root()
    try:
        # torchvision prints download progress and mirror failures: keep them
        # out of the notebook; the exception below says what went wrong.
        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            train = datasets.FashionMNIST(root, train=True, download=download)
            test = datasets.FashionMNIST(root, train=False, download=download)
    except (RuntimeError, OSError) as exc:
        how = (
            "and the download failed" if download else "and downloading was not allowed"
        )
        raise DataUnavailableError(
            f"Fashion-MNIST is not in {root} {how}; put the four *-ubyte files in "
            f"{root}/FashionMNIST/raw or call load_image_data() to use the offline "
            "digits."
        ) from exc

    def to_tensors(ds) -> TensorDataset:
        return TensorDataset(ds.data.unsqueeze(1).float() / 255.0, ds.targets.long())

    return ImageData(
        "Fashion-MNIST", to_tensors(train), to_tensors(test), FASHION_MNIST_CLASSES
    )


def _online(
    address: tuple[str, int] = FASHION_MNIST_HOST, timeout: float = 2.0
) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


FALLBACK_NOTE = (
    "(Where Fashion-MNIST is on disk or can be downloaded, the same code uses it "
    "instead.)"
)


def load_image_data(
    root: str | Path | None = None,
    *,
    download: bool = True,
    max_train: int | None = None,
    max_test: int | None = None,
) -> ImageData:
    """Return Fashion-MNIST if it is on disk or can be downloaded, else the digits.

    Prints which data set is used (and, for the digits, that Fashion-MNIST is
    used where it can be had). ``max_train`` and ``max_test`` keep only the
    first images, for quick runs.
    """
    folder = Path(root).expanduser() if root is not None else default_data_root()
    offline = os.environ.get("COURSE_OFFLINE", "") not in ("", "0")
    try:
        data = load_fashion_mnist(folder, download=False)
        reason = "found on disk"
    except DataUnavailableError:
        data = None
        if download and not offline and _online():
            with contextlib.suppress(DataUnavailableError):
                data = load_fashion_mnist(folder, download=True)
                reason = "downloaded"
    if data is None:
        data = load_digits()
        reason = ""
    data.train = _subset(data.train, max_train)
    data.test = _subset(data.test, max_test)
    if reason:
        print(f"Data: {data} ({reason}).")
    else:
        print(f"Data: {data}.\n{FALLBACK_NOTE}")
    return data
