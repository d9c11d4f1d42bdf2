"""Companion package of the course "PyTorch computational performance and parallel training".

Notebooks import their helpers from here; chapter-specific helpers live in
their own modules (``companion.<module>``). Nothing runs at import time.
"""

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
from companion.launch import LaunchError, LaunchTimeout, launch, script_path
from companion.notebook import CourseError, set_seed, setup_notebook
from companion.plotting import new_axes, plot_history
from companion.training import accuracy, evaluate_accuracy, train_classifier
from companion.timing import (
    Benchmark,
    Timing,
    benchmark,
    benchmark_interleaved,
    format_ratio,
    format_table,
    format_time,
    synchronize,
)
from companion.verdicts import (
    Verdict,
    check,
    check_close,
    check_faster,
    check_not_faster,
    check_range,
    check_speed_ups_at_most,
    compare_speed,
)

__all__ = [
    "Benchmark",
    "CheckpointError",
    "CourseError",
    "DataUnavailableError",
    "DeviceError",
    "ImageData",
    "LaunchError",
    "LaunchTimeout",
    "Timing",
    "Verdict",
    "ToyDataset",
    "accuracy",
    "benchmark",
    "check",
    "check_close",
    "check_faster",
    "check_not_faster",
    "check_range",
    "check_speed_ups_at_most",
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
    "new_axes",
    "num_gpus",
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
