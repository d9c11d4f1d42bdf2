"""A data set whose items cost real CPU work, for measuring ``DataLoader`` workers.

Real image pipelines keep pictures compressed and decode and augment each one
when it is read; that per-item work is what ``num_workers > 0`` spreads over
processes. ``JpegImageDataset`` does the same with small images held as JPEG
bytes in memory (no files, no download), decoded with Pillow as torchvision's
``ImageFolder`` does.

The class lives in a module, not in a notebook: worker processes started with
the ``spawn`` method (the default on macOS and Windows) import it by name,
which they cannot do for a class defined in a notebook's ``__main__``.

``measure_loading_cpu`` reports the CPU time an epoch of loading costs each
process. Unlike wall-clock time, it barely changes when other programs compete
for the cores, so it shows what workers do even on a busy machine.

Used in chapter 03.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

__all__ = ["JpegImageDataset", "LoadingCpu", "measure_loading_cpu"]


class JpegImageDataset(Dataset):
    """Images stored as JPEG bytes; each item is decoded and augmented when read.

    Reading item ``i`` decodes its JPEG, takes a random crop of random size
    and aspect ratio resized to ``crop_size`` x ``crop_size``, flips it
    horizontally half of the time and scales it to floats in [0, 1].

    Args:
        images: ``(N, C, H, W)`` floats in [0, 1], with 1 or 3 channels.
        labels: ``N`` class labels.
        stored_size: side of the stored (upscaled) JPEG images, in pixels.
        crop_size: side of the images the data set returns, in pixels.
        quality: JPEG quality, 1 to 100.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        stored_size: int = 192,
        crop_size: int = 128,
        quality: int = 90,
    ) -> None:
        if images.ndim != 4 or images.shape[1] not in (1, 3):
            raise ValueError(
                f"images must have shape (N, 1 or 3, H, W), not {tuple(images.shape)}."
            )
        if len(images) != len(labels):
            raise ValueError(
                f"images and labels differ in length ({len(images)} vs {len(labels)})."
            )
        resized = F.interpolate(
            images,
            size=(stored_size, stored_size),
            mode="bilinear",
            align_corners=False,
        )
        pixels = (resized.clamp(0, 1) * 255).round().to(torch.uint8)
        pixels = (
            pixels.permute(0, 2, 3, 1).squeeze(-1).numpy()
        )  # (N, H, W[, 3]) for Pillow
        encoded = [_encode_jpeg(image, quality) for image in pixels]
        # One bytes object plus offsets, rather than N small ones: cheap to
        # pickle for a worker started with "spawn".
        self.jpeg_bytes = b"".join(encoded)
        self.offsets = [0]
        for blob in encoded:
            self.offsets.append(self.offsets[-1] + len(blob))
        self.labels = labels
        # v2 transforms are plain picklable objects, so workers receive copies.
        self.augment = v2.Compose(
            [
                v2.RandomResizedCrop(crop_size, antialias=True),
                v2.RandomHorizontalFlip(),
                v2.PILToTensor(),
                v2.ToDtype(torch.float32, scale=True),
            ]
        )

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.offsets[index], self.offsets[index + 1]
        with Image.open(io.BytesIO(self.jpeg_bytes[start:end])) as image:
            image.load()  # decode now
            return self.augment(image), self.labels[index]

    def __len__(self) -> int:
        return len(self.labels)


def _encode_jpeg(pixels: np.ndarray, quality: int) -> bytes:
    """Return the JPEG encoding of one ``(H, W)`` or ``(H, W, 3)`` uint8 image."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


@dataclass(frozen=True)
class LoadingCpu:
    """CPU seconds that one epoch of loading cost, by process."""

    main: float  # the process that iterates over the loader
    workers: tuple[float, ...]  # each worker process (empty with num_workers=0)


def measure_loading_cpu(
    dataset: Dataset, *, num_workers: int, batch_size: int = 64, epochs: int = 2
) -> LoadingCpu:
    """Return the CPU time one epoch of ``DataLoader(dataset, ...)`` costs each process.

    The loader shuffles, keeps its workers alive between epochs, and is read
    once before measuring (which starts the workers), so the numbers are the
    steady state, averaged over ``epochs`` epochs. The workers are the
    loader's own processes, not every new child: under ``spawn`` or
    ``forkserver`` multiprocessing also starts helper processes (its resource
    tracker, the fork server). Used in chapter 03.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, not {epochs}.")
    me = psutil.Process()
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
    for _ in loader:  # starts the workers
        pass
    # The persistent iterator's worker processes (a private attribute of
    # PyTorch's DataLoader, present from 1.x to 2.14).
    workers = (
        [psutil.Process(w.pid) for w in loader._iterator._workers]
        if num_workers > 0
        else []
    )
    processes = [me, *workers]
    start = [_cpu_seconds(p) for p in processes]
    for _ in range(epochs):
        for _ in loader:
            pass
    used = [(_cpu_seconds(p) - s) / epochs for p, s in zip(processes, start)]
    del loader  # stops the workers
    return LoadingCpu(main=used[0], workers=tuple(used[1:]))


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system
