"""Tests of companion.loaders: a data set with per-item work that workers can load."""

from __future__ import annotations

import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from companion.loaders import JpegImageDataset, _cpu_seconds, measure_loading_cpu


def make_dataset(n: int = 12, channels: int = 1) -> JpegImageDataset:
    g = torch.Generator().manual_seed(0)
    images = torch.rand(n, channels, 28, 28, generator=g)
    labels = torch.arange(n) % 10
    return JpegImageDataset(images, labels, stored_size=48, crop_size=32)


@pytest.mark.parametrize("channels", [1, 3])
def test_items_are_augmented_float_images(channels: int) -> None:
    ds = make_dataset(channels=channels)
    image, label = ds[5]
    assert len(ds) == 12
    assert image.shape == (channels, 32, 32) and image.dtype == torch.float32
    assert 0.0 <= image.min() and image.max() <= 1.0
    assert label.item() == 5


def test_reads_are_random_but_seedable() -> None:
    ds = make_dataset()
    torch.manual_seed(1)
    first = ds[0][0]
    second = ds[0][0]
    torch.manual_seed(1)
    again = ds[0][0]
    assert not torch.equal(first, second)  # a new crop at every read
    assert torch.equal(first, again)


def test_survives_pickling_as_workers_receive_it() -> None:
    ds = make_dataset()
    copy = pickle.loads(pickle.dumps(ds))
    torch.manual_seed(2)
    expected = ds[3][0]
    torch.manual_seed(2)
    assert torch.equal(copy[3][0], expected)


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="shape"):
        JpegImageDataset(torch.rand(4, 28, 28), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="differ in length"):
        JpegImageDataset(torch.rand(4, 1, 28, 28), torch.zeros(3, dtype=torch.long))


@pytest.mark.timeout(180)
def test_spawned_workers_can_import_it() -> None:
    # "spawn" is the default on macOS and Windows: the worker re-imports the
    # class by name, which works because it lives in a module.
    ds = make_dataset()
    loader = DataLoader(
        ds, batch_size=4, num_workers=1, multiprocessing_context="spawn"
    )
    batches = list(loader)
    assert [tuple(images.shape) for images, _ in batches] == [(4, 1, 32, 32)] * 3
    assert torch.cat([labels for _, labels in batches]).tolist() == ds.labels.tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_measure_loading_cpu_finds_the_workers(num_workers: int) -> None:
    # 256 full-size images: enough work to register on a 10 ms CPU clock
    images, labels = torch.rand(256, 1, 28, 28), torch.zeros(256, dtype=torch.long)
    cpu = measure_loading_cpu(
        JpegImageDataset(images, labels), num_workers=num_workers, epochs=1
    )
    assert len(cpu.workers) == num_workers
    if num_workers:
        assert all(seconds > 0 for seconds in cpu.workers)
        assert sum(cpu.workers) > cpu.main  # workers decode; the main process receives
    else:
        assert cpu.main > 0


class StartsAHelper(Dataset):
    """Items of ``inner``; the first item a process reads also starts a short-lived helper process."""

    def __init__(self, inner: Dataset) -> None:
        self.inner, self.started = inner, False

    def __getitem__(self, index: int):
        if not self.started:  # like multiprocessing's resource tracker, a stray process
            self.started = True
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
        return self.inner[index]

    def __len__(self) -> int:
        return len(self.inner)


def test_measure_loading_cpu_counts_only_the_loaders_workers() -> None:
    images, labels = torch.rand(16, 1, 28, 28), torch.zeros(16, dtype=torch.long)
    dataset = StartsAHelper(
        JpegImageDataset(images, labels, stored_size=48, crop_size=32)
    )
    cpu = measure_loading_cpu(dataset, num_workers=1, batch_size=8, epochs=1)
    assert len(cpu.workers) == 1  # the helper, a new descendant too, is not a worker


def test_cpu_seconds_are_user_plus_system_time() -> None:
    process = SimpleNamespace(cpu_times=lambda: SimpleNamespace(user=1.5, system=0.25))
    assert _cpu_seconds(process) == 1.75


def test_each_item_decodes_its_own_image() -> None:
    # black, white, mid-grey: after any crop and flip each stays one colour
    images = torch.tensor([0.0, 1.0, 0.5]).view(3, 1, 1, 1).expand(3, 1, 28, 28)
    ds = JpegImageDataset(images, torch.arange(3), stored_size=48, crop_size=32)
    means = [ds[i][0].mean().item() for i in range(3)]
    assert means == pytest.approx([0.0, 1.0, 0.5], abs=0.02)
