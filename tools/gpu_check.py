"""`make test-gpu`: every script and chapter on this machine's GPUs, in one command.

    python tools/gpu_check.py                 # scripts, chapters, CUDA-only tests
    python tools/gpu_check.py --only scripts  # or: chapters, tests

On a machine with CUDA GPUs it

1. launches every script of ``companion/scripts`` under ``torchrun`` on nccl,
   with one process and with one process per visible GPU, with small
   settings (``SMOKE`` below), and checks that each ran on ``cuda`` with
   ``nccl`` (its results file says where it ran);
2. executes every chapter on the GPU and compares each verdict with the
   stored CPU verdict (``tools/verdict_parity.py``: a parity table with the
   reason for each difference);
3. runs the tests that need CUDA (``pytest -m gpu``).

It prints one line per script and chapter and exits with 1 on a crash or an
unexplained difference. It takes under 15 minutes on one H100. Without a
GPU it says so in one sentence and exits with 2. ``--simulate`` runs step 1
on a CPU instead, every script on its GPU path under
``tests/scripts/simulated_gpu.py`` (two simulated GPUs: nccl and ``cuda:N``
as the script sees them, gloo and the CPU underneath), which catches
collectives on CPU tensors and CPU tensors meeting GPU tensors; the tests
run it in ``make test-slow``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "companion" / "scripts"
SIMULATED_GPU = ROOT / "tests" / "scripts" / "simulated_gpu.py"
# Small settings for each script: a minute or less on one GPU.
SMOKE: dict[str, list[str]] = {
    "hello_distributed.py": [],
    "ddp_train.py": ["--steps", "50"],
    "ddp_resnet.py": ["--epochs", "1", "--width", "8"],
    "dtensor_basics.py": [],
    "spmd_data_parallel.py": [],
    "convnext_sharded.py": [],
    "fsdp_gpt.py": ["--steps", "3"],
    "tensor_parallel_gpt.py": [],
    "pipeline_gpt.py": [],
    "ring_attention.py": [],
    "expert_parallel.py": [],
    "failures.py": [],
}
# Scripts whose every launch needs a number of processes of their own.
PROCESSES: dict[str, tuple[int, ...]] = {}


def script_runs(gpus: int) -> list[tuple[str, int]]:
    """(script, processes) pairs: 1 process, and one per GPU."""
    runs = []
    for path in sorted(SCRIPTS.glob("*.py")):
        if path.name == "__init__.py":
            continue
        for nproc in PROCESSES.get(path.name, sorted({1, gpus})):
            runs.append((path.name, nproc))
    return runs


def run_script(
    name: str, nproc: int, timeout: float, simulate: bool = False
) -> tuple[bool, str]:
    """Launch one script under torchrun; return (ok, one line saying how it went)."""
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        program = [str(SIMULATED_GPU)] if simulate else []
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *program, str(SCRIPTS / name), *SMOKE[name],
            "--results", str(results),
        ]  # fmt: skip
        env = {**os.environ, "SIMULATED_GPUS": str(nproc)} if simulate else None
        start = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=env
            )
        except subprocess.TimeoutExpired:
            return False, f"did not finish within {timeout:g} s"
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line]
            return False, f"exit code {proc.returncode}: {lines[-1] if lines else ''}"
        if not results.is_file():
            return False, "wrote no results"
        where = json.loads(results.read_text())
        ran = (where.get("device", "").split(":")[0], where.get("backend"))
        if ran != ("cuda", "nccl"):
            return False, f"ran on {ran[0]} with {ran[1]}, not cuda with nccl"
        return True, f"cuda, nccl, {seconds:.0f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=["scripts", "chapters", "tests"])
    parser.add_argument(
        "--simulate", action="store_true", help="the scripts on two simulated GPUs"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per script")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.simulate:
        failed = 0
        for name, nproc in script_runs(2):
            ok, said = run_script(name, nproc, args.timeout, simulate=True)
            print(f"{'ok' if ok else 'FAILED'} {name}, {nproc} simulated GPU(s): "
                  f"{said}", flush=True)  # fmt: skip
            failed += not ok
        return 1 if failed else 0
    if gpus == 0:
        print("make test-gpu needs a CUDA GPU, and this machine has none.")
        return 2
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    print(f"test-gpu: {gpus} x {', '.join(names)}, torch {torch.__version__}")
    failed = 0
    if args.only in (None, "scripts"):
        for name, nproc in script_runs(gpus):
            ok, said = run_script(name, nproc, args.timeout)
            print(f"{'ok' if ok else 'FAILED'} {name}, {nproc} process(es): {said}",
                  flush=True)  # fmt: skip
            failed += not ok
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.only in (None, "chapters"):
        failed += (
            subprocess.run(
                [sys.executable, ROOT / "tools" / "verdict_parity.py"],
                env=env,
                cwd=ROOT,
            ).returncode
            != 0
        )
    if args.only in (None, "tests"):
        failed += subprocess.run(
            [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-q"], cwd=ROOT
        ).returncode not in (0, 5)  # 5: no test collected
    print("test-gpu:", "FAILED" if failed else "green")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
