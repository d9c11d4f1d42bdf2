"""Helpers for the compilation chapter: record warnings, run code in a fresh interpreter.

``warning_messages`` turns the warnings a block raised into short strings
(category and message, no file paths), so a notebook can print them.
``run_python`` runs a snippet in a new Python process, the honest way to show
that a saved model loads where the class that defined it does not exist.
Used in chapter 05.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from companion.harness.notebook import CourseError

__all__ = ["FreshProcessError", "run_python", "warning_messages"]


class FreshProcessError(CourseError):
    """A snippet run by ``run_python`` failed or timed out."""


@contextmanager
def warning_messages() -> Iterator[list[str]]:
    """Record the warnings raised inside the block, instead of printing them.

    Yields a list that is filled when the block ends, with one
    ``"Category: message"`` string per distinct warning, in the order they
    were first raised. File names and line numbers are left out.

    >>> with warning_messages() as messages:
    ...     warnings.warn("old API", FutureWarning)
    >>> messages
    ['FutureWarning: old API']

    Used in chapter 05.
    """
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield messages
    for record in caught:
        text = f"{record.category.__name__}: {record.message}"
        if text not in messages:
            messages.append(text)


def run_python(code: str, cwd: str | Path | None = None, timeout: float = 120.0) -> str:
    """Run ``code`` in a fresh Python interpreter and return what it printed.

    The child is the same interpreter as this process (``sys.executable``),
    started in ``cwd``, with none of this process's variables, classes or
    imports. Its standard output is returned; its standard error is shown
    only if it fails.

    Args:
        code: Python source; common indentation is removed.
        cwd: the working folder of the child (default: this process's).
        timeout: seconds to wait before giving up.

    Raises:
        FreshProcessError: the child exited with an error or timed out.

    Used in chapter 05.
    """
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ),
        )
    except subprocess.TimeoutExpired:
        raise FreshProcessError(
            f"The fresh Python process did not finish within {timeout:g} s; "
            "pass a larger timeout if the machine is busy."
        ) from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no error message)"]
        raise FreshProcessError(
            f"The fresh Python process failed (exit code {done.returncode}): "
            f"{lines[-1]}"
        )
    return done.stdout
