"""tests/programs/simulated_gpu.py: the mistakes only a GPU shows, caught on a CPU.

The first real GPU run of the course (an H100, torch 2.11) crashed where no
CPU test had looked: ``ddp_resnet.py`` all-reduced its timings from a CPU
tensor under nccl, and chapter 07 subtracted CPU clones from GPU parameters.
The simulation runs code on its GPU path with the tensors on the CPU and
raises what CUDA or nccl would; these tests make each mistake once
(``tests/programs/gpu_mistakes.py``) and check that the simulation names it,
and that the right version of the same code runs (two processes on one GPU,
the one mistake that needs two processes, in make test-slow). The scripts'
own tests run every script under the simulation, in every launch the scripts
document (tests/test_scripts_topologies.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "programs"))
from launchers import clean_environment, free_port  # noqa: E402
from simulated_gpu import visible_gpus  # noqa: E402

HERE = Path(__file__).parent / "programs"
HELLO = Path(__file__).parents[1] / "companion" / "scripts" / "hello_distributed.py"
SAME_DEVICE = "Expected all tensors to be on the same device"
UNSEEN = "CUDA error: invalid device ordinal"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    results = tmp_path_factory.mktemp("simulated") / "outcomes.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    subprocess.run(
        [sys.executable, HERE / "simulated_gpu.py", HERE / "gpu_mistakes.py", results],
        check=True,
        timeout=120,
        env={**env, "SIMULATED_GPUS": "2"},
    )
    return json.loads(results.read_text())


@pytest.mark.slow
def test_the_right_code_runs_on_nccl(outcomes):
    assert outcomes["right"] == "ok" and outcomes["backend"] == "nccl"


@pytest.mark.parametrize(
    "case, error",
    [
        ("model_left_on_the_cpu", f"linear: {SAME_DEVICE}"),
        ("batch_left_on_the_cpu", f"linear: {SAME_DEVICE}"),
        ("cpu_clones_minus_gpu_parameters", f"sub: {SAME_DEVICE}"),
        (
            "timings_all_reduced_from_the_cpu",
            "dist.all_reduce on a CPU tensor under nccl: No backend type "
            "associated with device type cpu",
        ),
        ("load_without_map_location", "torch.load without map_location"),
        ("a_gpu_it_does_not_see", f"{UNSEEN} (cuda:2; this process sees 2 GPU(s))"),
        (
            "two_gpus_in_one_sum",
            f"add: {SAME_DEVICE}, but found at least two devices, cuda:0 and cuda:1!",
        ),
        ("ddp_told_a_gpu_it_does_not_see", f"{UNSEEN} (cuda:2;"),
        (
            "ddp_told_another_gpu",
            f"DistributedDataParallel: {SAME_DEVICE}, but "
            "found at least two devices, cuda:1 and cuda:0!",
        ),
    ],
)
def test_each_mistake_raises_what_a_gpu_would(outcomes, case, error):
    assert outcomes[case].startswith("SimulationError: " + error), outcomes[case]


@pytest.mark.parametrize(
    "listed, seen",
    [(None, [0, 1, 2, 3]), ("", []), ("2,0", [2, 0]), ("1,7,2", [1]), ("x", [])],
)
def test_a_process_sees_the_gpus_cuda_visible_devices_lists(listed, seen):
    """As CUDA reads it on a node of 4: in order, up to the first that is not there."""
    assert visible_gpus(4, listed) == seen


@pytest.mark.slow
def test_two_processes_on_one_gpu_raise_what_nccl_would(tmp_path):
    """Two srun tasks of a node with one GPU, both shown it: nccl refuses the pair."""
    logs, procs = [], []
    env = {k: v for k, v in clean_environment().items() if k != "CUDA_VISIBLE_DEVICES"}
    port = str(free_port())
    for task in (0, 1):
        logs.append(open(tmp_path / f"task{task}.log", "w"))
        procs.append(
            subprocess.Popen(
                [sys.executable, HERE / "simulated_gpu.py", HELLO, "--timeout", "60"],
                env={
                    **env,
                    "SIMULATED_GPUS": "1",
                    "SLURM_PROCID": str(task),
                    "SLURM_LOCALID": str(task),
                    "SLURM_NTASKS": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                },
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
            )
        )
    codes = [p.wait(timeout=120) for p in procs]
    for log in logs:
        log.close()
    output = "".join((tmp_path / f"task{t}.log").read_text() for t in (0, 1))
    assert codes == [1, 1], output
    assert (
        "SimulationError: Duplicate GPU detected : rank 0 and rank 1 both on CUDA "
        "device 0 of node 0" in output
    )
