"""`make test-gpu`: every script and chapter on this machine's GPUs, in one command.

    python tools/gpu_check.py                 # scripts, chapters, CUDA-only tests
    python tools/gpu_check.py --only scripts  # or: chapters, tests
    python tools/gpu_check.py --jobs 4 --logs gpu-logs   # 4 at a time, all logs kept
    python tools/gpu_check.py --only chapters notebooks/12_memory.ipynb  # some chapters

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
unexplained difference. ``--logs DIR`` keeps everything a reader of a
failure needs: each script's whole output (``DIR/scripts``), each executed
chapter (``DIR/chapters``, failing cells' tracebacks included), the parity
table and the tests' output. ``--jobs N`` runs N scripts at once and
executes the chapters in N streams, each on its own share of the cores
(``tools/verdict_parity.py``); the streams share the GPU, so a timing
verdict that flips in such a run is rerun alone before it is believed. Without a
GPU it says so in one sentence and exits with 2. ``--simulate`` runs step 1
on a CPU instead, every script on its GPU path under
``tests/programs/simulated_gpu.py`` (two simulated GPUs: nccl and ``cuda:N``
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from companion.harness.launch import script_paths

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "companion" / "scripts"
SIMULATED_GPU = ROOT / "tests" / "programs" / "simulated_gpu.py"
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
    "collective_bench.py": ["--max-bytes", "1e8", "--quiet"],
}
# Scripts whose every launch needs a number of processes of their own.
PROCESSES: dict[str, tuple[int, ...]] = {}


def script_runs(gpus: int) -> list[tuple[str, int]]:
    """(script, processes) pairs: 1 process, and one per GPU."""
    runs = []
    for path in script_paths():
        for nproc in PROCESSES.get(path.name, sorted({1, gpus})):
            runs.append((path.name, nproc))
    return runs


def run_script(
    name: str,
    nproc: int,
    timeout: float,
    simulate: bool = False,
    log: Path | None = None,
) -> tuple[bool, str]:
    """Launch one script under torchrun; return (ok, one line saying how it went).

    ``log``: a file for the script's whole output (stdout, then stderr).
    """
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        program = [str(SIMULATED_GPU)] if simulate else []
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *program,
            str(SCRIPTS / name),
            *SMOKE[name],
            "--results",
            str(results),
        ]
        env = {**os.environ, "SIMULATED_GPUS": str(nproc)} if simulate else None
        start = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=env
            )
        except subprocess.TimeoutExpired as err:
            if log:
                log.write_text(f"{err.stdout or ''}{err.stderr or ''}")
            return False, f"did not finish within {timeout:g} s"
        seconds = time.monotonic() - start
        if log:
            log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
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


def run_scripts(
    gpus: int, timeout: float, jobs: int, simulate: bool, logs: Path | None
) -> int:
    """Run every script (``jobs`` at a time), print a line for each; the failures."""
    if logs:
        (logs / "scripts").mkdir(parents=True, exist_ok=True)
    where = "simulated GPU(s)" if simulate else "process(es)"

    def one(run: tuple[str, int]) -> bool:
        name, nproc = run
        log = logs / "scripts" / f"{Path(name).stem}-{nproc}.log" if logs else None
        ok, said = run_script(name, nproc, timeout, simulate=simulate, log=log)
        print(f"{'ok' if ok else 'FAILED'} {name}, {nproc} {where}: {said}", flush=True)
        return ok

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return sum(not ok for ok in pool.map(one, script_runs(gpus)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("notebooks", nargs="*", help="chapters to run (default: all)")
    parser.add_argument("--only", choices=["scripts", "chapters", "tests"])
    parser.add_argument(
        "--simulate", action="store_true", help="the scripts on two simulated GPUs"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per script")
    parser.add_argument(
        "--jobs", type=int, default=1, help="scripts or chapters at once"
    )
    parser.add_argument("--logs", type=Path, help="a folder for every log")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.simulate:
        failed = run_scripts(2, args.timeout, args.jobs, True, args.logs)
        return 1 if failed else 0
    if gpus == 0:
        print("make test-gpu needs a CUDA GPU, and this machine has none.")
        return 2
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    print(
        f"test-gpu: {gpus} x {', '.join(names)}, torch {torch.__version__}", flush=True
    )
    failed = 0
    if args.only in (None, "scripts"):
        failed += run_scripts(gpus, args.timeout, args.jobs, False, args.logs)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.only in (None, "chapters"):
        parity = [
            sys.executable,
            ROOT / "tools" / "verdict_parity.py",
            "--jobs",
            str(args.jobs),
            *args.notebooks,
        ]
        if args.logs:
            parity += [
                "--save",
                args.logs / "chapters",
                "--table",
                args.logs / "verdict_parity.md",
            ]
        failed += subprocess.run(parity, env=env, cwd=ROOT).returncode != 0
    if args.only in (None, "tests"):
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-q", "-rA"],
            cwd=ROOT,
            capture_output=bool(args.logs),
            text=True,
        )
        if args.logs:
            (args.logs / "pytest.log").write_text(tests.stdout + tests.stderr)
            print(
                tests.stdout.strip().splitlines()[-1]
                if tests.stdout.strip()
                else tests.stderr.strip()
            )
        failed += tests.returncode not in (0, 5)  # 5: no test collected
    print("test-gpu:", "FAILED" if failed else "green")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
