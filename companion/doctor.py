"""``python -m companion.doctor``: what this machine offers the course.

Prints the versions, devices, distributed backends and thread settings that
decide how the chapters run here, and what that means. Used in the set-up page.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import torch
import torch.distributed as dist

from companion.harness.devices import cpu_count, cpu_name, get_backend, num_gpus

__all__ = ["PYTHON_FLOOR", "TORCH_TESTED", "collect_report", "main", "version_warnings"]

# The range the course is tested with: the oldest torch (make test-oldest)
# and the pinned one (requirements.txt); pyproject.toml declares the floor.
TORCH_TESTED = ((2, 10), (2, 14))
PYTHON_FLOOR = (3, 11)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def collect_report() -> dict[str, str]:
    """Return the report as ordered ``name: value`` pairs."""
    gpus = num_gpus()
    report = {
        "Python": platform.python_version(),
        "Platform": platform.platform(),
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "d2l": _version("d2l"),
        "CUDA (built with)": torch.version.cuda or "none (CPU build)",
        "cuDNN": str(torch.backends.cudnn.version()) if gpus else "n/a",
        "GPUs": str(gpus),
    }
    for i in range(gpus):
        props = torch.cuda.get_device_properties(i)
        report[f"  cuda:{i}"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    report["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)")
    report["CPU"] = f"{cpu_name()} ({cpu_count()} cores available)"
    report["CPU vector ISA"] = torch.backends.cpu.get_cpu_capability()
    report["Intra-op threads"] = str(torch.get_num_threads())
    report["Inter-op threads"] = str(torch.get_num_interop_threads())
    report["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "(not set)")
    if dist.is_available():
        backends = [
            name
            for name, ok in [
                ("gloo", dist.is_gloo_available()),
                ("nccl", dist.is_nccl_available()),
                ("mpi", dist.is_mpi_available()),
            ]
            if ok
        ]
        report["Distributed backends"] = ", ".join(backends) or "none"
    else:
        report["Distributed backends"] = "torch.distributed unavailable"
    report["Default backend here"] = get_backend()
    return report


def version_warnings(
    torch_version: str = torch.__version__, python: tuple = sys.version_info[:2]
) -> list[str]:
    """One sentence per version outside the range the course is tested with."""
    ours = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2])
    low, high = TORCH_TESTED
    said = []
    if not low <= ours <= high:
        said.append(
            f"Warning: torch {torch_version} is outside the range the course is tested "
            f"with ({low[0]}.{low[1]} to {high[0]}.{high[1]}); "
            + (
                "install a newer one (pip install -r requirements.txt)."
                if ours < low
                else "chapters may print what their stored outputs do not."
            )
        )
    if tuple(python) < PYTHON_FLOOR:
        said.append(
            f"Warning: Python {python[0]}.{python[1]} is older than the "
            f"{PYTHON_FLOOR[0]}.{PYTHON_FLOOR[1]} the course needs."
        )
    return said


def _advice(report: dict[str, str]) -> list[str]:
    gpus = int(report["GPUs"])
    if gpus == 0:
        lines = [
            (
                "No GPU: every chapter runs on the CPU; multi-device chapters use "
                "CPU replicas or gloo processes, which show the algorithms but not "
                "speed-ups."
            ),
        ]
    elif gpus == 1:
        lines = [
            (
                "One GPU: chapters run on cuda:0; runs of several processes use the "
                "CPU and gloo (nccl needs a GPU per process)."
            )
        ]
    else:
        lines = [f"{gpus} GPUs: multi-device chapters use real GPUs and nccl."]
    if cpu_count() < 4:
        lines.append(
            f"Only {cpu_count()} CPU cores: run at most {cpu_count()} processes at "
            "once, "
            "one thread each (torchrun sets OMP_NUM_THREADS=1)."
        )
    return lines


def main() -> None:
    """Print the report."""
    report = collect_report()
    width = max(len(k) for k in report)
    print("companion doctor: what this machine offers the course")
    for key, value in report.items():
        print(f"  {key:<{width}}  {value}")
    for line in version_warnings() + _advice(report):
        print(f"- {line}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
