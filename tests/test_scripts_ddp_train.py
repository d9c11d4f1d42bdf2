"""Launch companion/scripts/ddp_train.py for real, in several processes on this machine.

- parity: 2 processes (torchrun, SLURM's srun environment, mp.spawn) end with
  the parameters of 1 process on the same global batch (float64, 1e-12);
- fault tolerance: a worker killed mid-training under ``torchrun
  --max-restarts=1`` is restarted, resumes from its last checkpoint and ends
  exactly where an uninterrupted run ends;
- several nodes: two torchrun agents (``--nnodes=2``, c10d rendezvous on
  127.0.0.1) train together and match the one-node run;
- bad input: one sentence on stderr, a non-zero exit, no process left behind;
- the SLURM batch file and the book's cluster page name only files that exist,
  and the batch file trains when run with stand-ins for ``srun`` and ``scontrol``.

Every launch is tiny (24 steps of a small MLP); the processes are the cost.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "companion" / "scripts" / "ddp_train.py"
SBATCH = ROOT / "companion" / "scripts" / "ddp_train.sbatch"
CLUSTER_PAGE = ROOT / "book" / "cluster.md"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TAG = "DDP_TRAIN_TEST_TAG"  # marks every process a test starts, to find survivors
# float64, so that 1 and 2 processes agree to rounding (float32: ~1e-8).
TINY = [
    "--steps",
    "24",
    "--samples",
    "256",
    "--global-batch-size",
    "32",
    "--dtype",
    "float64",
    "--checkpoint-every",
    "8",
    "--log-every",
    "8",
]
TOL = 1e-12
NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = pytest.mark.timeout(240)


def load_script_module():
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged(tag: str) -> list[psutil.Process]:
    """Return the live processes whose environment carries ``tag``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def kill_all(tag: str) -> list[str]:
    """Kill every live process carrying ``tag``; return their command lines."""
    killed = []
    for proc in tagged(tag):
        try:
            killed.append(" ".join(proc.cmdline()))
            proc.kill()
        except psutil.Error:
            pass
    return killed


def assert_none_left(tag: str) -> None:
    """Fail if a process started under ``tag`` is still alive a few seconds later (and kill it)."""
    deadline = time.monotonic() + 10
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = kill_all(tag)
    assert not left, f"processes left behind: {left}"


def start(
    cmd: list[str], tag: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        TAG: tag,
        **(env or {}),
    }
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=ROOT,
        env=full_env,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(
    procs: list[subprocess.Popen], tag: str, timeout: float = 180
) -> list[tuple[int, str, str]]:
    """Wait for ``procs``; return ``(returncode, stdout, stderr)`` of each; check nothing survives."""
    out = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(
                timeout=max(1.0, deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            kill_all(tag)
            texts = [p.communicate() for p in procs]
            pytest.fail(
                f"{proc.args} ran past {timeout:g} s:\n"
                + "\n".join(a + b for a, b in texts)
            )
        out.append((proc.returncode, stdout, stderr))
    assert_none_left(tag)
    return out


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    tag = uuid.uuid4().hex
    return finish([start(cmd, tag, env)], tag)[0]


def train(
    cmd: list[str], workdir: Path, env: dict[str, str] | None = None
) -> tuple[dict, str]:
    """Run a training command that must succeed; return its results and its output."""
    import json

    results = workdir / "results.json"
    code, stdout, stderr = run(
        [*cmd, "--checkpoint-dir", workdir / "ckpt", "--results", results], env
    )
    assert code == 0, f"exit code {code}\n{stdout}\n{stderr}"
    return json.loads(results.read_text()), stdout + stderr


def final_params(results: dict) -> dict[str, torch.Tensor]:
    return torch.load(results["checkpoint"], weights_only=True)["model"]


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    results, _ = train([sys.executable, SCRIPT, *TINY], tmp_path_factory.mktemp("one"))
    return results


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict:
    results, _ = train(
        [*TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, *TINY],
        tmp_path_factory.mktemp("two"),
    )
    return results


# ---------------------------------------------------------------- no processes


def test_data_plan_gives_every_rank_an_equal_nonempty_shard():
    ddp_train = load_script_module()
    for world_size in range(1, 9):
        for samples in (1, 100, 2048):
            train_n, test_n, batch = ddp_train.plan_data(samples, None, world_size)
            assert batch >= 64 and batch % world_size == 0
            assert train_n >= samples and train_n % batch == 0
            assert test_n >= world_size  # at least one test sample per rank
    with pytest.raises(
        ddp_train.UsageError, match="smaller than the number of processes"
    ):
        ddp_train.plan_data(100, 3, 4)
    with pytest.raises(ddp_train.UsageError, match="multiple of 3"):
        ddp_train.plan_data(100, 64, 3)


def test_help_lists_the_options(capsys):
    ddp_train = load_script_module()
    with pytest.raises(SystemExit):
        ddp_train.parse_args(["--help"])
    text = capsys.readouterr().out
    for option in (
        "--steps",
        "--epochs",
        "--global-batch-size",
        "--lr",
        "--seed",
        "--samples",
        "--checkpoint-dir",
        "--results",
    ):
        assert option in text
    assert "--fail-at-step" not in text  # testing aid, hidden


def test_checkpoints_are_atomic_pruned_and_checked(tmp_path):
    ddp_train = load_script_module()
    config = {
        "global_batch_size": 64,
        "lr": 0.05,
        "seed": 0,
        "samples": 2048,
        "dtype": "float32",
        "steps": 30,
    }
    model = torch.nn.Linear(2, 2)
    for step in (10, 20, 30):
        state = {
            "model": model.state_dict(),
            "optimizer": {},
            "step": step,
            "losses": [1.0] * step,
            "config": config,
        }
        ddp_train.save_checkpoint(tmp_path, state, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000020.pt",
        "step-000030.pt",
    ]  # no .tmp left
    newest = ddp_train.newest_checkpoint(tmp_path)
    assert newest.name == "step-000030.pt"
    assert ddp_train.load_checkpoint(newest, torch.device("cpu"), config)["step"] == 30
    with pytest.raises(
        ddp_train.UsageError, match="was written with lr=0.05, not 0.1;"
    ):
        ddp_train.load_checkpoint(newest, torch.device("cpu"), {**config, "lr": 0.1})
    torch.save(
        {"model": {}}, tmp_path / "step-000040.pt"
    )  # readable, but not a checkpoint of this script
    with pytest.raises(
        ddp_train.UsageError, match="step-000040.pt is not one of this script's"
    ):
        ddp_train.load_checkpoint(
            tmp_path / "step-000040.pt", torch.device("cpu"), config
        )


def test_pruning_keeps_the_highest_steps_not_the_last_names(tmp_path):
    ddp_train = load_script_module()
    for step in (
        999_999,
        1_000_000,
    ):  # as text, "step-1000000.pt" sorts before "step-999999.pt"
        ddp_train.save_checkpoint(tmp_path, {"step": step}, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-1000000.pt"]


class Evil:
    def __reduce__(self):
        return (print, ("this would run when loaded",))


def test_each_way_a_checkpoint_cannot_load_gets_its_own_sentence(tmp_path, monkeypatch):
    """Only a damaged file is called corrupt; a missing, refused or unreadable one is never 'delete it'."""
    ddp_train = load_script_module()
    cpu = torch.device("cpu")
    cases = {
        "missing.pt": None,
        "code.pt": {"model": Evil()},
        "truncated.pt": b"PK\x03\x04 half a zip",
        "empty.pt": b"",
        "garbage.pt": b"hello world",
    }
    for name, content in cases.items():
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        elif content is not None:
            torch.save(content, tmp_path / name)
    said = {}
    for name in cases:
        with pytest.raises(ddp_train.UsageError) as info:
            ddp_train.read_checkpoint(tmp_path / name, cpu)
        said[name] = str(info.value)
    assert (
        "is missing on" in said["missing.pt"]
        and "file system that every node sees" in said["missing.pt"]
    )
    assert "run as code, so it was refused" in said["code.pt"]
    for name in ("truncated.pt", "empty.pt", "garbage.pt"):
        assert said[name].endswith(
            "is truncated or corrupt; delete it to resume from an older one."
        ), said[name]
    for name in ("missing.pt", "code.pt"):
        assert "delete" not in said[name]

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB"
        )

    monkeypatch.setattr(ddp_train.torch, "load", out_of_memory)
    with pytest.raises(
        ddp_train.UsageError, match="the file itself may be fine, so keep it"
    ) as info:
        ddp_train.read_checkpoint(tmp_path / "empty.pt", cpu)
    assert "delete" not in str(info.value)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--steps", "0"], "--steps must be at least 1, not 0."),
        (["--samples", "0"], "--samples must be at least 1, not 0."),
        (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1, not 0."),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1, not 0."),
        (["--log-every", "-1"], "--log-every must be at least 1, not -1."),
        (["--epochs", "0"], "--epochs must be positive, not 0.0."),
        (["--spawn", "-1"], "--spawn must be 0 or more, not -1."),
        (["--timeout", "0"], "--timeout must be positive, not 0.0."),
        (
            ["--fail-at-step", "3"],
            "--fail-at-step needs --checkpoint-dir for its marker file.",
        ),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    ],
)
def test_bad_arguments_get_one_line(argv, expected, capsys, monkeypatch):
    ddp_train = load_script_module()
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        ddp_train.parse_args(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"ddp_train.py: error: {expected}"]
    monkeypatch.setenv("RANK", "1")  # the other ranks exit too, silently
    with pytest.raises(SystemExit) as exit_info:
        ddp_train.parse_args(argv)
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""


def test_default_timeout_is_pytorchs_ten_minutes():
    assert load_script_module().parse_args([]).timeout == 600


# ---------------------------------------------------------------- parity


def test_one_process_learns(one_process):
    assert one_process["world_size"] == 1 and one_process["backend"] in ("gloo", "nccl")
    assert one_process["hosts"] == 1
    assert len(one_process["losses"]) == 24
    assert one_process["losses"][-1] < one_process["losses"][0] / 2
    assert (
        one_process["test_accuracy"] > 0.8 and 0.8 < one_process["train_accuracy"] <= 1
    )
    assert re.fullmatch(r"[0-9a-f]{16}", one_process["param_checksum"])
    params = final_params(one_process)
    assert one_process["param_sum"] == pytest.approx(
        sum(t.double().sum().item() for t in params.values()), abs=1e-9
    )
    # 24 steps of a 32-sample global batch in train_seconds
    assert one_process["samples_per_second"] == pytest.approx(
        24 * 32 / one_process["train_seconds"], rel=1e-6
    )


def test_the_log_gathers_losses_every_n_steps_and_counts_epochs_from_1(tmp_path):
    """--epochs 1.5 with 8 steps per epoch is 12 steps; log lines every 8 steps and at the end."""
    args = [arg for arg in TINY if arg not in ("--steps", "24")]
    results, output = train(
        [sys.executable, SCRIPT, *args, "--epochs", "1.5"], tmp_path
    )
    assert (
        len(results["losses"]) == 12
        and results["epochs"] == 1.5
        and results["steps"] == 12
    )
    logged = re.findall(r"step +(\d+)/12  epoch (\d+)  loss ([\d.]+)", output)
    assert [(int(s), int(e)) for s, e, _ in logged] == [(8, 1), (12, 2)]
    assert float(logged[-1][2]) == pytest.approx(results["losses"][-1], abs=1e-4)


@pytest.mark.slow
def test_resuming_with_changed_settings_is_refused(one_process, tmp_path):
    import shutil

    shutil.copytree(Path(one_process["checkpoint"]).parent, tmp_path / "ckpt")
    code, stdout, stderr = run(
        [
            sys.executable,
            SCRIPT,
            *TINY,
            "--lr",
            "0.1",
            "--checkpoint-dir",
            tmp_path / "ckpt",
        ]
    )
    check_one_sentence(
        code,
        stderr,
        "was written with lr=0.05, not 0.1; use the same settings or another",
    )
    assert code == 2 and sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-000016.pt",
        "step-000024.pt",
    ]
    # More steps with the same settings continue the run.
    results, output = train(
        [sys.executable, SCRIPT, *TINY[2:], "--steps", "32"], tmp_path
    )
    assert "resuming from checkpoint step-000024.pt (step 24)" in output
    assert (
        results["start_step"] == 24 and results["losses"][:24] == one_process["losses"]
    )


# torchrun and mp.spawn are slow: chapter 09 compares both with one process in make
# test.
@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param("torchrun", marks=pytest.mark.slow),
        "srun",
        pytest.param("mp.spawn", marks=pytest.mark.slow),
    ],
)
def test_two_processes_match_one(launcher, one_process, request, tmp_path):
    if launcher == "torchrun":  # the fixture, so that only the slow run starts it
        results = request.getfixturevalue("two_processes")
    elif launcher == "srun":  # what srun sets for each of 2 tasks on one node
        tag, port = uuid.uuid4().hex, str(free_port())
        procs = [
            start(
                [
                    sys.executable,
                    SCRIPT,
                    *TINY,
                    "--checkpoint-dir",
                    tmp_path / "ckpt",
                    "--results",
                    tmp_path / "results.json",
                ],
                tag,
                {
                    "SLURM_PROCID": str(r),
                    "SLURM_LOCALID": str(r),
                    "SLURM_NTASKS": "2",
                    "SLURM_NNODES": "1",
                    "SLURM_NODEID": "0",
                    "MASTER_PORT": port,
                },
            )
            for r in range(2)
        ]
        assert [code for code, _, _ in finish(procs, tag)] == [0, 0]
        import json

        results = json.loads((tmp_path / "results.json").read_text())
    else:
        results, _ = train([sys.executable, SCRIPT, *TINY, "--spawn", "2"], tmp_path)
    assert results["world_size"] == 2 and results["micro_batch_size"] == 16
    assert [r["rank"] for r in results["ranks"]] == [0, 1]
    assert max_difference(final_params(results), final_params(one_process)) < TOL
    assert results["losses"] == pytest.approx(one_process["losses"], abs=TOL)
    assert results["test_accuracy"] == one_process["test_accuracy"]


# ---------------------------------------------------------------- fault tolerance


@pytest.mark.slow
def test_killed_worker_restarts_and_resumes_from_its_checkpoint(
    two_processes, tmp_path
):
    # Rank 1 SIGKILLs itself after step 12 (once); the newest checkpoint then is step 8.
    # Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the restarted workers share
    # the store of the first attempt and may read its stale addresses
    # (pytorch/pytorch#135712, #167288): here about half of the restarts failed.
    results, output = train(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            SCRIPT,
            *TINY,
            "--fail-at-step",
            "12",
        ],
        tmp_path,
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )
    assert (tmp_path / "ckpt" / "failed-at-step-12").exists()
    assert "exitcode: -9" in output  # torchrun saw the worker die of SIGKILL
    assert "resuming from checkpoint step-000008.pt" in output
    assert results["start_step"] == 8 and len(results["losses"]) == 24
    assert results["param_checksum"] == two_processes["param_checksum"]  # bit for bit
    assert results["losses"] == two_processes["losses"]


# ---------------------------------------------------------------- several nodes


@pytest.mark.slow
def test_two_torchrun_agents_train_as_two_nodes(two_processes, tmp_path):
    tag, port = uuid.uuid4().hex, free_port()
    results = tmp_path / "results.json"
    procs = [
        start(
            [
                *TORCHRUN,
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=test",
                SCRIPT,
                *TINY,
                "--checkpoint-dir",
                tmp_path / "ckpt",
                "--results",
                results,
            ],
            tag,
        )
        for node in (0, 1)
    ]
    outcomes = finish(procs, tag)
    assert [code for code, _, _ in outcomes] == [0, 0], outcomes
    import json

    two_nodes = json.loads(results.read_text())
    assert two_nodes["world_size"] == 2
    assert sorted(r["node_rank"] for r in two_nodes["ranks"]) == [0, 1]
    assert [r["local_rank"] for r in two_nodes["ranks"]] == [0, 0]
    assert max_difference(final_params(two_nodes), final_params(two_processes)) < TOL


# ---------------------------------------------------------------- bad input


def busy_port_env() -> tuple[socket.socket, dict[str, str]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, {"MASTER_PORT": str(sock.getsockname()[1])}


def check_one_sentence(code: int, stderr: str, expected: str) -> None:
    assert code != 0
    errors = [
        line for line in stderr.splitlines() if line.startswith("ddp_train.py: error:")
    ]
    assert len(errors) == 1, stderr  # rank 0 alone says it, once
    assert expected in errors[0] and errors[0].endswith(".")
    assert "Traceback" not in stderr.split("ddp_train.py: error:")[0]


@pytest.mark.parametrize("nproc", [NUM_GPUS + 1])
def test_nccl_with_more_processes_than_gpus(nproc):
    code, _, stderr = run(
        [
            *TORCHRUN,
            "--standalone",
            f"--nproc-per-node={nproc}",
            SCRIPT,
            "--backend",
            "nccl",
        ]
    )
    check_one_sentence(code, stderr, "the nccl backend needs one GPU per process")


@pytest.mark.slow
def test_global_batch_smaller_than_world_size():
    code, _, stderr = run(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            SCRIPT,
            "--global-batch-size",
            "1",
        ]
    )
    check_one_sentence(
        code, stderr, "the global batch (1) is smaller than the number of processes (2)"
    )


def test_busy_port():
    sock, env = busy_port_env()
    with sock:
        code, _, stderr = run([sys.executable, SCRIPT, "--steps", "1"], env)
    check_one_sentence(
        code, stderr, f"port 127.0.0.1:{env['MASTER_PORT']} is already in use"
    )


def test_corrupt_checkpoint(tmp_path):
    (tmp_path / "step-000010.pt").write_bytes(
        b"PK\x03\x04 this is not a whole checkpoint"
    )
    code, _, stderr = run(
        [sys.executable, SCRIPT, "--steps", "1", "--checkpoint-dir", tmp_path]
    )
    check_one_sentence(
        code, stderr, "step-000010.pt is truncated or corrupt; delete it"
    )


@pytest.mark.slow
def test_unreachable_rendezvous_is_one_sentence_within_the_timeout():
    """Rank 1, the first process of node 1 under srun, finds nobody at MASTER_ADDR:MASTER_PORT."""
    port = str(free_port())
    env = {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    start_time = time.monotonic()
    code, _, stderr = run([sys.executable, SCRIPT, "--timeout", "3"], env)
    assert time.monotonic() - start_time < 60  # not the default 10 minutes
    assert code == 2
    last = stderr.strip().splitlines()[-1]
    assert last == (
        f"ddp_train.py: error: cannot reach the rendezvous at 127.0.0.1:{port} within "
        "3 s; "
        "check MASTER_ADDR and MASTER_PORT, and that rank 0 is running."
    )
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_a_missing_rank_is_one_sentence_from_rank_0():
    env = {
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "1",
        "MASTER_PORT": str(free_port()),
    }
    code, _, stderr = run([sys.executable, SCRIPT, "--timeout", "2"], env)
    check_one_sentence(
        code, stderr, "only 1 of 2 processes reached the rendezvous at 127.0.0.1:"
    )


# ---------------------------------------------------------------- SLURM and the book


def named_files(text: str) -> set[str]:
    """Return the repository files that commands in ``text`` name (scripts, batch files, notebooks)."""
    return set(
        re.findall(
            r"(?<![\w/.:-])((?:[\w.-]+/)*[\w.-]+\.(?:py|sbatch|sh|ipynb))\b", text
        )
    )


def exists(name: str) -> bool:
    """A path is relative to the repository's root; a bare file name is one of the scripts."""
    return (ROOT / name).is_file() if "/" in name else (SBATCH.parent / name).is_file()


@pytest.mark.parametrize("path", [SBATCH, CLUSTER_PAGE], ids=lambda p: p.name)
def test_every_named_file_exists(path):
    names = named_files(path.read_text())
    assert "companion/scripts/ddp_train.py" in names
    missing = sorted(n for n in names if not exists(n))
    assert not missing, f"{path.name} names files that do not exist: {missing}"


def test_every_command_on_the_cluster_page_names_an_existing_file():
    blocks = re.findall(r"```bash\n(.*?)```", CLUSTER_PAGE.read_text(), re.S)
    assert len(blocks) >= 5
    for block in blocks:
        names = named_files(block)
        assert names and all((ROOT / n).is_file() for n in names), block


STAND_IN_SRUN = r"""#!/usr/bin/env python3
# A stand-in for srun: it checks what a real srun needs from the batch file, records it, then runs the command.
import json, os, sys
args = sys.argv[1:]
options = []
while args and args[0].startswith("-"):
    options.append(args.pop(0))
problems = []
if "--kill-on-bad-exit=1" not in options and "-K" not in options:
    problems.append("no --kill-on-bad-exit: a failed node leaves the others waiting")
cpus = [o.split("=", 1)[1] for o in options if o.startswith("--cpus-per-task=")]
if cpus != [os.environ.get("SLURM_CPUS_PER_TASK")]:
    problems.append(f"--cpus-per-task {cpus} is not the job's {os.environ.get('SLURM_CPUS_PER_TASK')}")
with open(os.environ["SRUN_RECORD"], "w") as f:
    json.dump({"options": options, "command": args, "problems": problems,
               "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}}, f)
if problems:
    sys.exit("srun stand-in: " + "; ".join(problems))
if os.environ.get("SRUN_RUN") == "1":
    os.execvp(args[0], args)
"""


def run_sbatch(tmp_path, env: dict, args=()) -> tuple[int, str, dict]:
    """Run the batch file with bash and stand-ins for ``srun`` and ``scontrol`` on PATH."""
    import json

    assert subprocess.run(["bash", "-n", SBATCH]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(
        STAND_IN_SRUN.replace("/usr/bin/env python3", sys.executable)
    )
    # scontrol show hostnames expands a node list: the fake knows two forms.
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\ncase "$3" in\n  "gpu[07-08]") printf "gpu07\\ngpu08\\n";;\n'
        '  *) echo "$3";;\nesac\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    full_env = {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_CPUS_PER_TASK": "16",
        "SRUN_RECORD": str(tmp_path / "srun.json"),
        **env,
    }
    code, stdout, stderr = run(["bash", SBATCH, *args], full_env)
    record = (
        json.loads((tmp_path / "srun.json").read_text())
        if (tmp_path / "srun.json").is_file()
        else {}
    )
    return code, stdout + stderr, record


def test_sbatch_file_gives_srun_what_a_real_one_needs_on_two_nodes(tmp_path):
    code, output, record = run_sbatch(
        tmp_path,
        {
            "SLURM_JOB_ID": "123456",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_NNODES": "2",
            "SLURM_GPUS_ON_NODE": "4",
        },
    )
    assert code == 0 and record["problems"] == [], output
    port = 20000 + 123456 % 20000  # derived from the job id: two jobs on a node differ
    assert record["env"] == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(port)}
    command = " ".join(record["command"])
    assert f"--rdzv-endpoint=gpu07:{port}" in command and "--nnodes=2" in command
    assert "--nproc-per-node=4" in command and "--rdzv-id=123456" in command


@pytest.mark.slow
def test_sbatch_file_trains_with_stand_ins_for_slurm(tmp_path):
    """Run the batch file with bash: ``srun`` checks its options and runs the command once."""
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_NNODES": "1",
        "SLURM_GPUS_ON_NODE": "2",
        "MASTER_PORT": str(free_port()),
        "SRUN_RUN": "1",
    }
    code, output, record = run_sbatch(
        tmp_path,
        env,
        [
            *TINY,
            "--results",
            tmp_path / "results.json",
            "--checkpoint-dir",
            tmp_path / "ckpt",
            "--backend",
            "gloo",
        ],
    )
    assert code == 0 and record["problems"] == [], output
    assert "[rank 0] 2 process(es) on 1 host(s)" in output
    assert (tmp_path / "results.json").is_file()
    shown = next(
        line
        for line in output.splitlines()
        if line.startswith("Running on 1 node(s) x 2 process(es):")
    )
    missing = [n for n in named_files(shown) if not (ROOT / n).is_file()]
    assert "companion/scripts/ddp_train.py" in shown and not missing
