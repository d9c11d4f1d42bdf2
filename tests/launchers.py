"""What the script tests share to launch processes as a launcher would.

``LAUNCHER``: the variables torchrun and srun set, which a test removes from
its own environment before it sets them for a case. ``free_port``: a port
for a rendezvous. ``two_agents``: a script (or a check) under two torchrun
agents that meet at a c10d rendezvous on 127.0.0.1, one process each: two
"nodes" on one machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from companion.launch import script_path

LAUNCHER = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "GROUP_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE", "SLURM_NODEID",
)  # fmt: skip


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's variables, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCHER}, **extra}


def two_agents(script: str, args: list, tmp_path: Path) -> dict:
    """Run ``script`` as two nodes of one process each; return rank 0's results."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    results = tmp_path / "results.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
        "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=loopback",
        str(script_path(script)), *map(str, args), "--results", str(results),
    ]  # fmt: skip
    env = clean_environment(
        OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )  # fmt: skip
    with contextlib.ExitStack() as stack:  # logs in files: a full pipe would block
        logs = [
            stack.enter_context(open(tmp_path / f"agent{n}.log", "w")) for n in (0, 1)
        ]
        procs = [
            subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            for log in logs
        ]
        codes = [p.wait(timeout=200) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"agent{n}.log").read_text() for n in (0, 1)]
    return json.loads(results.read_text())
