"""tools/gpu_check.py (make test-gpu): what it launches, and the GPU path on a CPU.

On a CPU machine `make test-gpu` only says that it needs a GPU; its script
runs are checked here on two simulated GPUs (tests/programs/simulated_gpu.py).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from companion.harness.launch import script_paths

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


def test_every_script_has_small_settings_for_the_gpu_run():
    scripts = {p.name for p in script_paths()}
    assert scripts == set(gpu_check.SMOKE)


def test_each_script_runs_with_one_process_and_one_per_gpu():
    runs = gpu_check.script_runs(gpus=4)
    assert ("hello_distributed.py", 1) in runs and ("hello_distributed.py", 4) in runs
    assert len(runs) == 2 * len(gpu_check.SMOKE)


def test_without_a_gpu_it_says_so_in_one_sentence():
    done = subprocess.run(
        [sys.executable, ROOT / "tools" / "gpu_check.py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode == 2:  # this machine has no GPU
        assert (
            done.stdout
            == "make test-gpu needs a CUDA GPU, and this machine has none.\n"
        )


@pytest.mark.slow
def test_hello_runs_on_two_simulated_gpus_with_nccl(tmp_path):
    log = tmp_path / "hello.log"
    ok, said = gpu_check.run_script("hello_distributed.py", 2, 120, True, log)
    assert ok and said.startswith("cuda, nccl"), said
    command, *output = log.read_text().splitlines()
    assert "--nproc-per-node=2" in command and "hello_distributed.py" in command
    assert "2 process(es) on cuda: sum = 3" in output


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_script_runs_on_its_gpu_path_on_simulated_gpus():
    done = subprocess.run(
        [sys.executable, ROOT / "tools" / "gpu_check.py", "--simulate"],
        capture_output=True,
        text=True,
        timeout=1450,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("\nok ") + done.stdout.startswith("ok ") == 2 * len(
        gpu_check.SMOKE
    )
