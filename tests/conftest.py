"""Shared test settings: quiet logs and one thread per test process."""

import logging

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
