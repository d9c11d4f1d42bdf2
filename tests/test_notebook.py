"""companion.harness.notebook: seeding and the one-line display of course errors."""

import logging
import random

import numpy as np
import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell

from companion.harness.notebook import set_seed, setup_notebook


def test_set_seed_makes_all_generators_repeat():
    set_seed(3)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_seed(3)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    set_seed()
    zero = torch.rand(1).item()
    set_seed(0)
    assert torch.rand(1).item() == zero  # the default seed is 0
    set_seed(4)
    assert (
        random.random() != first[0]
        and np.random.rand() != first[1]
        and torch.rand(1).item() != first[2]
    )


@pytest.fixture
def shell(tmp_path, monkeypatch):
    """An IPython shell like a notebook kernel's, and no custom handler left behind."""
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))  # its history database goes here
    shell = InteractiveShell.instance()
    shell.colors = "nocolor"  # plain text, as a notebook's stored output is checked
    yield shell
    shell.set_custom_exc((), None)
    InteractiveShell.clear_instance()


def run(shell, code: str, capsys) -> tuple[str, object]:
    result = shell.run_cell(code, store_history=False)
    return capsys.readouterr().out, result


COURSE_ERRORS = [
    (
        "companion.harness.notebook",
        "CourseError",
        "The data folder is read-only; pass root= to write elsewhere.",
    ),
    (
        "companion.harness.devices",
        "DeviceError",
        "3 devices were requested but this machine has 2 GPU(s); ask for at most 2.",
    ),
    (
        "companion.data",
        "DataUnavailableError",
        "Fashion-MNIST is not in /nowhere; call load_image_data().",
    ),
    (
        "companion.harness.launch",
        "LaunchError",
        "Port 29500 is busy; pass another port.",
    ),
    (
        "companion.checkpoint",
        "CheckpointError",
        "ckpt.pt is corrupt; delete it and train again.",
    ),
]


@pytest.mark.parametrize(
    "module, name, message", COURSE_ERRORS, ids=[e[1] for e in COURSE_ERRORS]
)
def test_course_errors_show_as_one_line(shell, capsys, module, name, message):
    setup_notebook()
    out, result = run(
        shell, f"from {module} import {name}\nraise {name}({message!r})", capsys
    )
    assert out == f"{name}: {message}\n"  # one line, no traceback
    assert type(result.error_in_exec).__name__ == name


def test_other_errors_keep_their_traceback(shell, capsys):
    setup_notebook()
    out, result = run(shell, "def f():\n    raise ValueError('a bug')\nf()", capsys)
    assert "Traceback" in out and "----> 3 f()" in out and "ValueError: a bug" in out
    assert isinstance(result.error_in_exec, ValueError)


def test_without_setup_course_errors_show_a_traceback(shell, capsys):
    out, _ = run(
        shell,
        "from companion.harness.devices import DeviceError\nraise DeviceError('too many')",
        capsys,
    )
    assert "Traceback" in out and "DeviceError: too many" in out


def test_setup_notebook_outside_ipython_seeds_and_quiets(monkeypatch):
    # No IPython shell (a plain script or pytest): nothing to install, no error.
    assert InteractiveShell.initialized() is False
    logger = logging.getLogger("torch.utils.cpp_extension")
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    setup_notebook(seed=5)
    first = torch.rand(1).item()
    assert logger.level == logging.ERROR
    set_seed(5)
    assert torch.rand(1).item() == first
    setup_notebook()
    first = torch.rand(1).item()
    set_seed(0)
    assert torch.rand(1).item() == first


def test_float32_products_stay_full_precision_and_inductor_notes_are_quiet():
    """Inductor's TF32 advice and softmax note (UserWarnings in torch 2.6-2.13) print nothing."""
    import warnings

    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True  # cuDNN's default: TF32 convolutions
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup_notebook()
        for text in (
            "TensorFloat32 tensor cores for float32 matrix multiplication available "
            "but not enabled. Consider setting `torch.set_float32_matmul_precision"
            "('high')` for better performance.",
            "Online softmax is disabled on the fly since Inductor decides to split "
            "the reduction.",
        ):
            warnings.warn(text, UserWarning)
        warnings.warn("a warning the reader should see", UserWarning)
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cudnn.allow_tf32 is False
    assert [str(w.message) for w in caught] == ["a warning the reader should see"]
