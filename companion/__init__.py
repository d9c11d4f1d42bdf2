"""Companion package of the course "PyTorch computational performance and parallel training".

Notebooks import their helpers from here; chapter-specific helpers live in
their own modules (``companion.<module>``). Nothing runs at import time, and
each name is imported from its module only when first used (PEP 562), so
that a process that needs one helper does not pay for matplotlib and the
rest: the course's checks start several processes at a time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# launch is both a module and its main function: bind the function now, so
# that importing the module later cannot shadow it (cheap: no matplotlib).
from companion.launch import LaunchError, LaunchTimeout, launch, script_path

if TYPE_CHECKING:
    from companion.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from companion.data import (
        DataUnavailableError,
        ImageData,
        ToyDataset,
        load_digits,
        load_fashion_mnist,
        load_image_data,
        make_spirals,
        make_toy_data,
    )
    from companion.devices import (
        DeviceError,
        cpu_count,
        describe_hardware,
        get_backend,
        num_gpus,
        try_all_gpus,
        try_gpu,
    )
    from companion.notebook import CourseError, set_seed, setup_notebook
    from companion.plotting import new_axes, plot_history
    from companion.timing import (
        Benchmark,
        OtherLoad,
        Timing,
        benchmark,
        benchmark_interleaved,
        format_ratio,
        format_table,
        format_time,
        median_interval,
        paired_difference,
        synchronize,
    )
    from companion.training import accuracy, evaluate_accuracy, train_classifier
    from companion.verdicts import (
        Verdict,
        check,
        check_close,
        check_faster,
        check_not_faster,
        check_range,
        check_speed_ups_at_most,
        check_unless_loaded,
        compare_speed,
    )

# Where each name lives: imported on first use.
_EXPORTS = {
    "Benchmark": "companion.timing",
    "CheckpointError": "companion.checkpoint",
    "CourseError": "companion.notebook",
    "DataUnavailableError": "companion.data",
    "DeviceError": "companion.devices",
    "ImageData": "companion.data",
    "OtherLoad": "companion.timing",
    "Timing": "companion.timing",
    "ToyDataset": "companion.data",
    "Verdict": "companion.verdicts",
    "accuracy": "companion.training",
    "benchmark": "companion.timing",
    "benchmark_interleaved": "companion.timing",
    "check": "companion.verdicts",
    "check_close": "companion.verdicts",
    "check_faster": "companion.verdicts",
    "check_not_faster": "companion.verdicts",
    "check_range": "companion.verdicts",
    "check_speed_ups_at_most": "companion.verdicts",
    "check_unless_loaded": "companion.verdicts",
    "compare_speed": "companion.verdicts",
    "cpu_count": "companion.devices",
    "describe_hardware": "companion.devices",
    "evaluate_accuracy": "companion.training",
    "format_ratio": "companion.timing",
    "format_table": "companion.timing",
    "format_time": "companion.timing",
    "get_backend": "companion.devices",
    "load_checkpoint": "companion.checkpoint",
    "load_digits": "companion.data",
    "load_fashion_mnist": "companion.data",
    "load_image_data": "companion.data",
    "make_spirals": "companion.data",
    "make_toy_data": "companion.data",
    "median_interval": "companion.timing",
    "new_axes": "companion.plotting",
    "num_gpus": "companion.devices",
    "paired_difference": "companion.timing",
    "plot_history": "companion.plotting",
    "save_checkpoint": "companion.checkpoint",
    "set_seed": "companion.notebook",
    "setup_notebook": "companion.notebook",
    "synchronize": "companion.timing",
    "train_classifier": "companion.training",
    "try_all_gpus": "companion.devices",
    "try_gpu": "companion.devices",
}


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'companion' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "Benchmark",
    "CheckpointError",
    "CourseError",
    "DataUnavailableError",
    "DeviceError",
    "ImageData",
    "LaunchError",
    "LaunchTimeout",
    "OtherLoad",
    "Timing",
    "Verdict",
    "ToyDataset",
    "accuracy",
    "benchmark",
    "benchmark_interleaved",
    "check",
    "check_close",
    "check_faster",
    "check_not_faster",
    "check_range",
    "check_speed_ups_at_most",
    "check_unless_loaded",
    "compare_speed",
    "cpu_count",
    "describe_hardware",
    "evaluate_accuracy",
    "format_ratio",
    "format_table",
    "format_time",
    "get_backend",
    "launch",
    "load_checkpoint",
    "load_digits",
    "load_fashion_mnist",
    "load_image_data",
    "make_spirals",
    "make_toy_data",
    "median_interval",
    "new_axes",
    "num_gpus",
    "paired_difference",
    "plot_history",
    "save_checkpoint",
    "script_path",
    "set_seed",
    "setup_notebook",
    "synchronize",
    "train_classifier",
    "try_all_gpus",
    "try_gpu",
]
