"""One call that prepares a notebook: seeds, figures, quiet logs, short errors.

Used in the set-up cell of every chapter.
"""

from __future__ import annotations

import logging
import random
import warnings

import numpy as np
import torch

__all__ = ["INDUCTOR_NOTES", "CourseError", "setup_notebook", "set_seed"]

# Inductor's advice that setup_notebook silences (regular expressions).
INDUCTOR_NOTES = (
    r".*TensorFloat32 tensor cores .* available but not enabled",
    r".*[Oo]nline softmax is disabled",
)


class CourseError(Exception):
    """Marker for errors whose message is a whole sentence for the reader.

    ``setup_notebook`` makes IPython show such errors (and the library's
    ``DataUnavailableError``, ``DeviceError`` and ``LaunchError``) as one line,
    without the traceback.
    """


def set_seed(seed: int = 0) -> None:
    """Seed Python's, NumPy's and PyTorch's random number generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _short_errors() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    from companion.data import DataUnavailableError
    from companion.harness.devices import DeviceError
    from companion.harness.launch import LaunchError

    def show_one_line(shell, etype, value, tb, tb_offset=None):
        print(f"{etype.__name__}: {value}")

    shell.set_custom_exc(
        (CourseError, DataUnavailableError, DeviceError, LaunchError), show_one_line
    )


def setup_notebook(seed: int = 0) -> None:
    """Seed the generators, draw sharp PNG figures, and quiet known noise.

    - figures: PNG at twice the resolution ("retina"), shown at their size, so
      they stay sharp on high-DPI screens (nbval does not compare images; SVG
      would carry random ids);
    - ``float32`` matrix products and convolutions stay in full precision on
      GPUs too (``torch.set_float32_matmul_precision("highest")``, PyTorch's
      default, set explicitly, and ``torch.backends.cudnn.allow_tf32 = False``,
      since cuDNN's default is TF32): chapters compare float32 results with
      tolerances that TF32 tensor cores would not meet;
    - known noise is silenced, because nbval compares stderr too:
      ``torch.compile``'s "No CUDA runtime is found" log line on CPU-only
      machines, and Inductor's advice on GPUs to enable TF32 (declined above)
      and its note that it split a softmax reduction (PyTorch 2.6 to 2.13
      print both as warnings, 2.14 only logs them);
    - errors that carry a one-sentence message are shown without traceback.
    """
    set_seed(seed)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    for message in INDUCTOR_NOTES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    try:
        from matplotlib_inline.backend_inline import set_matplotlib_formats

        set_matplotlib_formats("retina")
    except ImportError:
        pass
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    _short_errors()
