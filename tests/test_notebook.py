"""companion.notebook: seeding and the one-line display of course errors."""

import random

import numpy as np
import torch

from companion.notebook import set_seed


def test_set_seed_makes_all_generators_repeat():
    set_seed(3)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_seed(3)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
