"""Devices and distributed backends, with honest fallbacks on a CPU-only machine.

On a machine without GPUs, "k devices" means k replicas on the CPU: the code
runs the same algorithm, but nothing gets faster. Used in every chapter.
"""

from __future__ import annotations

import os
import platform

import torch
import torch.distributed as dist

__all__ = [
    "DeviceError",
    "num_gpus",
    "try_gpu",
    "try_all_gpus",
    "get_backend",
    "cpu_count",
    "cpu_name",
    "describe_hardware",
]


class DeviceError(ValueError):
    """More devices were asked for than the machine has."""


def num_gpus() -> int:
    """Return the number of usable CUDA GPUs (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def try_gpu(i: int = 0) -> torch.device:
    """Return GPU ``i`` if it exists, else the CPU."""
    return torch.device(f"cuda:{i}") if i < num_gpus() else torch.device("cpu")


def try_all_gpus(k: int | None = None) -> list[torch.device]:
    """Return ``k`` devices to train on.

    With at least ``k`` GPUs: the first ``k`` of them (all of them when ``k``
    is None). With fewer GPUs than ``k``: ``k`` replicas spread over the GPUs
    there are, in turn (one GPU, ``k = 2``: ``cuda:0`` twice). Without GPUs:
    ``k`` simulated devices, all of them the CPU (one when ``k`` is None).
    Unlike ``d2l.try_all_gpus``, which returns ``[]`` on a CPU, the list is
    never empty. Replicas that share a device run one after the other.

    Raises:
        DeviceError: ``k`` is not a positive number.
    """
    if k is not None and k < 1:
        raise DeviceError(f"Ask for at least one device, not {k}.")
    gpus = num_gpus()
    if gpus == 0:
        return [torch.device("cpu")] * (k or 1)
    return [torch.device(f"cuda:{i % gpus}") for i in range(k or gpus)]


def get_backend(device_type: str | None = None) -> str:
    """Return the collective-communication backend for ``device_type``.

    ``nccl`` for CUDA devices (when PyTorch was built with it), ``gloo``
    otherwise. With no argument, decide for this machine.
    """
    if device_type is None:
        device_type = "cuda" if num_gpus() > 0 else "cpu"
    if device_type == "cuda" and dist.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def cpu_count() -> int:
    """Return the number of CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def cpu_name() -> str:
    """Return the CPU's model name, as the operating system reports it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_hardware(threads: int | str | None = None) -> str:
    """Return a one-line description of the hardware measurements run on.

    Args:
        threads: the intra-op threads the measurement used (default: the
            current ``torch.get_num_threads()``); a string such as ``"1 and 2"``
            when a table mixes settings.
    """
    gpus = num_gpus()
    if gpus:
        names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
        accel = f"{gpus} x GPU ({', '.join(names)})"
    else:
        accel = "no GPU"
    return (
        f"{cpu_name()}, {cpu_count()} cores, {accel}, "
        f"torch {torch.__version__.split('+')[0]}, {_threads_text(threads)}"
    )


def _threads_text(threads: int | str | None) -> str:
    if threads is None:
        threads = torch.get_num_threads()
    return f"{threads} thread" + ("" if threads in (1, "1") else "s")
