"""companion.compilation: recording warnings and running code in a fresh interpreter."""

import os
import warnings

import pytest
import torch

from companion.compilation import FreshProcessError, run_python, warning_messages
from companion.harness.notebook import CourseError


def test_warning_messages_records_category_and_text_once():
    with warning_messages() as messages:
        warnings.warn("old API", FutureWarning)
        warnings.warn("old API", FutureWarning)  # a repeat is listed once
        warnings.warn("odd value", UserWarning)
    assert messages == ["FutureWarning: old API", "UserWarning: odd value"]


def test_warning_messages_catches_the_torchscript_deprecation():
    """A DeprecationWarning in torch 2.10 to 2.13 (hidden by default: torch
    attributes it to its own module), a FutureWarning (seen everywhere) in 2.14;
    on Python 3.14 the text says TorchScript is not supported there."""
    with warning_messages() as messages:
        torch.jit.script(torch.nn.Linear(2, 2))
    version = tuple(map(int, torch.__version__.split(".")[:2]))
    category = (
        "DeprecationWarning"
        if (2, 10) <= version <= (2, 13)
        else "FutureWarning"
        if version == (2, 14)
        else ("DeprecationWarning", "FutureWarning")
    )
    texts = (
        "`torch.jit.script` is deprecated",
        "`torch.jit.script` is not supported in Python 3.14+",
    )
    assert any(
        m.startswith(category) and any(text in m for text in texts) for m in messages
    ), messages
    assert not any(os.sep + "torch" + os.sep in m for m in messages)  # no file paths


def test_warning_messages_restores_the_warning_filters():
    before = list(warnings.filters)
    with warning_messages():
        pass
    assert warnings.filters == before


def test_run_python_returns_stdout_from_a_fresh_process(tmp_path):
    (tmp_path / "data.txt").write_text("42")
    marker = "value_defined_only_in_the_parent"
    out = run_python(
        f"""
        import os
        print(open("data.txt").read(), "{marker}" in globals(), os.getpid() != {os.getpid()})
        """,
        cwd=tmp_path,
    )
    assert out == "42 False True\n"


def test_run_python_failure_is_one_sentence(tmp_path):
    with pytest.raises(
        FreshProcessError, match=r"exit code 1\): ZeroDivisionError"
    ) as info:
        run_python("1 / 0", cwd=tmp_path)
    assert isinstance(info.value, CourseError)
    assert "\n" not in str(info.value)


def test_run_python_times_out():
    with pytest.raises(FreshProcessError, match="did not finish within 0.5 s"):
        run_python("import time; time.sleep(30)", timeout=0.5)
