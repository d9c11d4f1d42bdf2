"""What the script tests share to launch processes as a launcher would.

``LAUNCHER``: the variables torchrun and srun set, which a test removes from
its own environment before it sets them for a case. ``free_port``
(``companion.harness.launch``'s): a port for a rendezvous. ``two_agents``: a script (or a check) under two torchrun
agents that meet at a c10d rendezvous on 127.0.0.1, one process each: two
"nodes" on one machine. ``one_sentence_under_torchrun``: a bad launch under
torchrun, and what a reader sees of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from companion.harness.launch import free_port, script_path

ROOT_CAUSE = "Root Cause (first observed failure):"
SIMULATED_GPU = Path(__file__).parent / "programs" / "simulated_gpu.py"

LAUNCHER = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NODEID",
)


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's variables, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCHER}, **extra}


def two_agents(script: str, args: list, tmp_path: Path) -> dict:
    """Run ``script`` as two nodes of one process each; return rank 0's results."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    results = tmp_path / "results.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=loopback",
        str(script_path(script)),
        *map(str, args),
        "--results",
        str(results),
    ]
    env = clean_environment(
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
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


def one_sentence_under_torchrun(
    script: str, args: list, nproc: int, gpus: dict[str, str] | None = None
) -> str:
    """Launch ``script`` with bad input under torchrun; return the sentence it said.

    What a reader sees is checked: the sentence once, no traceback but
    torchrun's own, and torchrun's failure summary naming it, with exit code
    2, as the root cause. ``gpus``: run on simulated GPUs, with these
    variables (``SIMULATED_GPUS``, ``CUDA_VISIBLE_DEVICES``); else on the CPU.
    """
    simulated = [str(SIMULATED_GPU)] if gpus is not None else []
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *simulated,
        str(script_path(script)),
        *map(str, args),
    ]
    env = clean_environment(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.update(gpus or {})
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200)
    output = done.stdout + done.stderr
    said = [
        line for line in output.splitlines() if line.startswith(f"{script}: error:")
    ]
    assert done.returncode == 1 and len(said) == 1, output
    assert output.count("Traceback (most recent call last)") == 1, output  # torchrun's
    sentence = said[0].removeprefix(f"{script}: error: ")
    root_cause = output.split(ROOT_CAUSE)[1]
    assert "exitcode  : 2" in root_cause, output
    assert f"traceback : {sentence}\n" in root_cause, output
    return sentence
