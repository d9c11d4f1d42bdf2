"""tests/scripts/simulated_gpu.py: the mistakes only a GPU shows, caught on a CPU.

The first real GPU run of the course (an H100, torch 2.11) crashed where no
CPU test had looked: ``ddp_resnet.py`` all-reduced its timings from a CPU
tensor under nccl, and chapter 07 subtracted CPU clones from GPU parameters.
The simulation runs code on its GPU path with the tensors on the CPU and
raises what CUDA or nccl would; these tests make each mistake once
(``tests/scripts/gpu_mistakes.py``) and check that the simulation names it,
and that the right version of the same code runs. The scripts' own tests run
every script under the simulation.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "scripts"
SAME_DEVICE = "Expected all tensors to be on the same device"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    results = tmp_path_factory.mktemp("simulated") / "outcomes.json"
    subprocess.run(
        [sys.executable, HERE / "simulated_gpu.py", HERE / "gpu_mistakes.py", results],
        check=True,
        timeout=120,
    )
    return json.loads(results.read_text())


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
    ],
)
def test_each_mistake_raises_what_a_gpu_would(outcomes, case, error):
    assert outcomes[case].startswith("SimulationError: " + error), outcomes[case]
