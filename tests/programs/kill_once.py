"""Run ddp_train.py, but the last rank dies of SIGKILL once, after ``KILL_AT_STEP`` steps.

For tests/test_scripts_ddp_train.py: a worker crash in the middle of a run,
with no clean-up and no goodbye, as a node failure looks to torchrun. A marker
file (``KILL_MARKER``) makes sure only the first attempt dies, so that the
restarted workers finish. The script itself carries no testing hook.
"""

import os
import signal
import sys
from pathlib import Path

import torch

from companion.scripts import ddp_train

at_step, marker = int(os.environ["KILL_AT_STEP"]), Path(os.environ["KILL_MARKER"])
original_step, steps = torch.optim.SGD.step, [0]


def step_then_maybe_die(self, *args, **kwargs):
    out = original_step(self, *args, **kwargs)
    steps[0] += 1
    last_rank = int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1
    if steps[0] == at_step and last_rank and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return out


torch.optim.SGD.step = step_then_maybe_die
sys.exit(ddp_train.main())
