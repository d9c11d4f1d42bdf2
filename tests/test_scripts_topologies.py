"""Every launch that the scripts and book/cluster.md document, run on simulated GPUs.

Each topology runs every script of companion/scripts to its end (a few
training steps, past the first) on its GPU path, under
tests/programs/simulated_gpu.py: nccl and ``cuda:N`` as the script sees them,
gloo and the CPU underneath. The simulation gives each node the GPUs the
topology names and each process those that ``CUDA_VISIBLE_DEVICES`` lists,
and raises what CUDA or nccl would when a process names a GPU it does not
see, wraps its model in DDP with another GPU's index, or shares a GPU with
another process of its node. The topologies:

- ``python``: one process, one GPU;
- ``torchrun``: ``--nproc-per-node=2`` on a node with 2 GPUs;
- ``srun-gpu-per-task``: ``srun --ntasks-per-node=2 --gpus-per-task=1``, each
  task sees its own GPU (``CUDA_VISIBLE_DEVICES`` its index) as ``cuda:0``,
  and ``SLURM_LOCALID`` is 0 and 1;
- ``srun-every-gpu``: ``srun --ntasks-per-node=2`` with both GPUs of the node
  visible to each task;
- ``visible-subset``: ``CUDA_VISIBLE_DEVICES=1,3 torchrun --nproc-per-node=2``
  on a node with 4 GPUs;
- ``two-nodes``: two torchrun agents (one GPU each) meeting at a c10d
  rendezvous on 127.0.0.1, as ``ddp_train.sbatch`` starts them.

72 launches, 39 minutes on a busy 2-core machine (load about 11): all in
``make test-slow``. ``make test`` runs the topology that hid a bug
(``srun-gpu-per-task``: ``ddp_train.py`` told DDP ``cuda:LOCAL_RANK``) for
``ddp_train.py`` in tests/test_scripts_ddp_train.py, and the shared set-up's
choice for each topology, in-process, in tests/test_scripts.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launchers import SIMULATED_GPU, clean_environment, free_port

from companion.harness.launch import script_path, script_paths

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "companion" / "scripts"
DDP_GONE = ROOT / "tests" / "programs" / "ddp_gone_at_destroy.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# A few steps of each script: enough to get past the first.
TINY = {
    "collective_bench.py": [
        "--collectives",
        "all_reduce",
        "--max-bytes",
        "4096",
        "--blocks",
        "1",
        "--quiet",
    ],
    "convnext_sharded.py": ["--steps", "2"],
    "ddp_resnet.py": ["--width", "2", "--epochs", "1", "--global-batch-size", "8"],
    "ddp_train.py": ["--steps", "3", "--samples", "96", "--log-every", "1"],
    "dtensor_basics.py": [],
    "expert_parallel.py": ["--steps", "2", "--n-layer", "1", "--seq-len", "16"],
    "failures.py": ["--epochs", "1", "--samples", "64"],
    "fsdp_gpt.py": ["--steps", "2", "--n-layer", "1"],
    "hello_distributed.py": [],
    "pipeline_gpt.py": ["--steps", "2", "--microbatches", "2", "--n-layer", "2"],
    "ring_attention.py": ["--steps", "2", "--batch-size", "4"],
    "spmd_data_parallel.py": ["--steps", "2"],
    "tensor_parallel_gpt.py": ["--steps", "2", "--n-layer", "1"],
}
TOPOLOGIES = (
    "python",
    "torchrun",
    "srun-gpu-per-task",
    "srun-every-gpu",
    "visible-subset",
    "two-nodes",
)


def processes(topology: str, program: list[str]) -> list[tuple[list, dict]]:
    """The commands a launch starts, with the environment each gets."""
    node = [*TORCHRUN, "--standalone", "--nproc-per-node=2", *program]
    port = str(free_port())
    if topology == "python":
        return [([sys.executable, *program], {"SIMULATED_GPUS": "1"})]
    if topology == "torchrun":
        return [(node, {"SIMULATED_GPUS": "2"})]
    if topology == "visible-subset":
        return [(node, {"SIMULATED_GPUS": "4", "CUDA_VISIBLE_DEVICES": "1,3"})]
    if topology == "two-nodes":
        agent = [
            *TORCHRUN,
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=nodes",
            *program,
        ]
        return [(agent, {"SIMULATED_GPUS": "1"})] * 2
    tasks = []
    for task in (0, 1):  # what srun sets for each task on one node of 2 GPUs
        env = {
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task),
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_NODEID": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "SIMULATED_GPUS": "2",
        }
        if topology == "srun-gpu-per-task":
            env["CUDA_VISIBLE_DEVICES"] = str(task)
        tasks.append(([sys.executable, *program], env))
    return tasks


def run_on_simulated_gpus(
    topology: str, script: str, args: list, tmp_path: Path, timeout: float = 240
) -> tuple[dict, str]:
    """Launch ``script`` as ``topology`` describes; return rank 0's results and the output."""
    results = tmp_path / "results.json"
    program = [
        str(SIMULATED_GPU),
        str(SCRIPTS / script),
        *map(str, args),
        "--results",
        str(results),
    ]
    base = clean_environment(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    base = {k: v for k, v in base.items() if k != "CUDA_VISIBLE_DEVICES"}
    with contextlib.ExitStack() as stack:  # logs in files: a full pipe would block
        logs, procs = [], []
        for n, (command, env) in enumerate(processes(topology, program)):
            logs.append(tmp_path / f"process{n}.log")
            log = stack.enter_context(open(logs[-1], "w"))
            procs.append(
                subprocess.Popen(
                    command,
                    env={**base, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=tmp_path,
                    start_new_session=True,
                )
            )
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:  # nothing left running, whatever happened
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0] * len(procs), output
    return json.loads(results.read_text()), output


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """ddp_resnet.py's data: 16 training and 8 test images of 8 x 8 pixels."""
    path = tmp_path_factory.mktemp("data") / "images.pt"
    gen = torch.Generator().manual_seed(0)
    torch.save(
        {
            f"{part}_{kind}": tensor
            for part, n in (("train", 16), ("test", 8))
            for kind, tensor in (
                ("images", torch.rand(n, 1, 8, 8, generator=gen)),
                ("labels", torch.randint(0, 10, (n,), generator=gen)),
            )
        },
        path,
    )
    return path


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", sorted(TINY))
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_script_runs_on_the_gpus_of_every_launch(
    topology, script, data_file, tmp_path
):
    args = TINY[script] + (["--data", data_file] if script == "ddp_resnet.py" else [])
    results, output = run_on_simulated_gpus(topology, script, args, tmp_path)
    assert (results["device"], results["backend"]) == ("cuda", "nccl"), output
    assert results["world_size"] == (1 if topology == "python" else 2)


def test_every_script_has_tiny_settings_here():
    scripts = {p.name for p in script_paths()}
    assert set(TINY) == scripts, "give a new script its few steps in TINY"


DDP_CHECKS = {
    "checks/ddp_scaling.py": [*TINY["ddp_resnet.py"], "--timing-rounds", "1"],
    "checks/cost_of_talking.py": [
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--seq-len",
        "8",
        "--caps",
        "1",
        "--rounds",
        "3",
        "--traces",
        "3",
        "--max-bytes",
        "4096",
        "--min-bytes",
        "1024",
    ],
}
DDP_USERS = sorted(
    [
        p.name
        for p in script_paths()
        if "DistributedDataParallel(" in p.read_text()
        or "DistributedDataParallel as DDP" in p.read_text()
    ]
    + list(DDP_CHECKS)
)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", DDP_USERS)
def test_every_ddp_script_drops_its_model_before_it_destroys_its_group(
    script, tmp_path
):
    """A DDP model alive at ``destroy_process_group()`` can hang the process
    (tests/programs/ddp_gone_at_destroy.py says how); the wrapper exits with 3
    if one is."""
    args = DDP_CHECKS.get(script, TINY.get(script))
    command = [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        str(DDP_GONE),
        str(script_path(script)),
        *args,
    ]
    env = clean_environment(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=280
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
