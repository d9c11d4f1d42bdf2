"""Companion package of the course "PyTorch computational performance and parallel training".

Notebooks import their helpers from here. The package has two kinds of
module: the helpers chapters teach with, a module per topic
(``companion.memory``, ``companion.gpt``, ``companion.comm_costs``, ...), and
the course's harness in ``companion.harness`` (timing, verdicts, launching,
devices, notebook set-up, plots); ``companion.doctor`` is a reader's tool. ``companion/scripts`` holds the
standalone scripts a reader copies, ``companion/checks`` the course's
measurements around them. Nothing runs at import time, and
each name is imported from its module only when first used (PEP 562), so
that a process that needs one helper does not pay for matplotlib and the
rest: the course's checks start several processes at a time.
"""

from __future__ import annotations

import importlib

# What the package exports, by module: each name is imported on first use.
_MODULES = {
    "companion.checkpoint": ("CheckpointError", "load_checkpoint", "save_checkpoint"),
    "companion.data": (
        "DataUnavailableError",
        "ImageData",
        "ToyDataset",
        "load_digits",
        "load_fashion_mnist",
        "load_image_data",
        "make_spirals",
        "make_toy_data",
    ),
    "companion.harness.devices": (
        "DeviceError",
        "cpu_count",
        "describe_hardware",
        "get_backend",
        "num_gpus",
        "try_all_gpus",
        "try_gpu",
    ),
    "companion.harness.launch": (
        "LaunchError",
        "LaunchTimeout",
        "gpus_for",
        "launch",
        "script_path",
    ),
    "companion.harness.notebook": ("CourseError", "set_seed", "setup_notebook"),
    "companion.harness.plotting": ("new_axes", "plot_history"),
    "companion.harness.timing": (
        "Benchmark",
        "OtherLoad",
        "Timing",
        "benchmark",
        "benchmark_interleaved",
        "format_ratio",
        "format_table",
        "format_time",
        "median_interval",
        "paired_difference",
        "synchronize",
    ),
    "companion.training": ("accuracy", "evaluate_accuracy", "train_classifier"),
    "companion.harness.verdicts": (
        "Verdict",
        "check",
        "check_close",
        "check_faster",
        "check_not_faster",
        "check_range",
        "check_speed_ups_at_most",
        "check_unless_loaded",
        "compare_speed",
    ),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'companion' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
