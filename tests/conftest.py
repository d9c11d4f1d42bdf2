"""Shared test settings: a fixed seed per test, quiet logs, one intra-op thread.

One thread: the unit tests use tiny tensors, for which more threads only
spin; and the machines that run them (2-core CI runners, this course's
laptops) also run the script tests' worker processes and the nbval kernels.
A test that needs more threads sets them itself and restores them.
"""

import logging
import os

import pytest
import torch

torch.set_num_threads(1)
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

if os.environ.get("MUTANT_UNDER_TEST"):
    # `make mutation`: mutmut routes every mutated function through a
    # "trampoline" that torch.compile cannot trace, so compiled code runs
    # eagerly in mutation runs; the logic around it is still tested.
    torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
