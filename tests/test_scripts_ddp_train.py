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
TINY = ["--steps", "24", "--samples", "256", "--global-batch-size", "32", "--dtype", "float64",
        "--checkpoint-every", "8", "--log-every", "8"]  # fmt: skip
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


def start(cmd: list[str], tag: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", TAG: tag, **(env or {})}
    return subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=full_env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def finish(procs: list[subprocess.Popen], tag: str, timeout: float = 180) -> list[tuple[int, str, str]]:
    """Wait for ``procs``; return ``(returncode, stdout, stderr)`` of each; check nothing survives."""
    out = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_all(tag)
            texts = [p.communicate() for p in procs]
            pytest.fail(f"{proc.args} ran past {timeout:g} s:\n" + "\n".join(a + b for a, b in texts))
        out.append((proc.returncode, stdout, stderr))
    assert_none_left(tag)
    return out


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    tag = uuid.uuid4().hex
    return finish([start(cmd, tag, env)], tag)[0]


def train(cmd: list[str], workdir: Path, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """Run a training command that must succeed; return its results and its output."""
    import json

    results = workdir / "results.json"
    code, stdout, stderr = run([*cmd, "--checkpoint-dir", workdir / "ckpt", "--results", results], env)
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
    results, _ = train([*TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, *TINY],
                       tmp_path_factory.mktemp("two"))  # fmt: skip
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
    with pytest.raises(ddp_train.UsageError, match="smaller than the number of processes"):
        ddp_train.plan_data(100, 3, 4)
    with pytest.raises(ddp_train.UsageError, match="multiple of 3"):
        ddp_train.plan_data(100, 64, 3)


def test_help_lists_the_options(capsys):
    ddp_train = load_script_module()
    with pytest.raises(SystemExit):
        ddp_train.parse_args(["--help"])
    text = capsys.readouterr().out
    for option in ("--steps", "--epochs", "--global-batch-size", "--lr", "--seed", "--samples",
                   "--checkpoint-dir", "--results"):  # fmt: skip
        assert option in text
    assert "--fail-at-step" not in text  # testing aid, hidden


def test_checkpoints_are_atomic_pruned_and_checked(tmp_path):
    ddp_train = load_script_module()
    config = {"global_batch_size": 64, "lr": 0.05, "seed": 0, "samples": 2048, "dtype": "float32", "steps": 30}
    model = torch.nn.Linear(2, 2)
    for step in (10, 20, 30):
        state = {"model": model.state_dict(), "optimizer": {}, "step": step, "losses": [1.0] * step, "config": config}
        ddp_train.save_checkpoint(tmp_path, state, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000020.pt", "step-000030.pt"]  # no .tmp left
    newest = ddp_train.newest_checkpoint(tmp_path)
    assert newest.name == "step-000030.pt"
    assert ddp_train.load_checkpoint(newest, torch.device("cpu"), config)["step"] == 30
    with pytest.raises(ddp_train.UsageError, match="was written with lr=0.05, not 0.1;"):
        ddp_train.load_checkpoint(newest, torch.device("cpu"), {**config, "lr": 0.1})
    torch.save({"model": {}}, tmp_path / "step-000040.pt")  # readable, but not a checkpoint of this script
    with pytest.raises(ddp_train.UsageError, match="step-000040.pt cannot be read"):
        ddp_train.load_checkpoint(tmp_path / "step-000040.pt", torch.device("cpu"), config)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--lr", "fast"], ["--fail-at-step", "3"]])
def test_bad_arguments_get_one_line(argv, capsys):
    ddp_train = load_script_module()
    with pytest.raises(SystemExit) as exit_info:
        ddp_train.parse_args(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_train.py: error:"), lines


# ---------------------------------------------------------------- parity


def test_one_process_learns(one_process):
    assert one_process["world_size"] == 1 and one_process["backend"] in ("gloo", "nccl")
    assert len(one_process["losses"]) == 24
    assert one_process["losses"][-1] < one_process["losses"][0] / 2
    assert one_process["test_accuracy"] > 0.8
    assert re.fullmatch(r"[0-9a-f]{16}", one_process["param_checksum"])


@pytest.mark.parametrize("launcher", ["torchrun", "srun", "mp.spawn"])
def test_two_processes_match_one(launcher, one_process, two_processes, tmp_path):
    if launcher == "torchrun":
        results = two_processes
    elif launcher == "srun":  # what srun sets for each of 2 tasks on one node
        tag, port = uuid.uuid4().hex, str(free_port())
        procs = [start([sys.executable, SCRIPT, *TINY, "--checkpoint-dir", tmp_path / "ckpt",
                        "--results", tmp_path / "results.json"], tag,
                       {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NTASKS": "2",
                        "SLURM_NNODES": "1", "SLURM_NODEID": "0", "MASTER_PORT": port})
                 for r in range(2)]  # fmt: skip
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


def test_killed_worker_restarts_and_resumes_from_its_checkpoint(two_processes, tmp_path):
    # Rank 1 SIGKILLs itself after step 12 (once); the newest checkpoint then is step 8.
    # Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the restarted workers share
    # the store of the first attempt and may read its stale addresses
    # (pytorch/pytorch#135712, #167288): here about half of the restarts failed.
    results, output = train([*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1",
                             SCRIPT, *TINY, "--fail-at-step", "12"], tmp_path,
                            {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})  # fmt: skip
    assert (tmp_path / "ckpt" / "failed-at-step-12").exists()
    assert "exitcode: -9" in output  # torchrun saw the worker die of SIGKILL
    assert "resuming from checkpoint step-000008.pt" in output
    assert results["start_step"] == 8 and len(results["losses"]) == 24
    assert results["param_checksum"] == two_processes["param_checksum"]  # bit for bit
    assert results["losses"] == two_processes["losses"]


# ---------------------------------------------------------------- several nodes


def test_two_torchrun_agents_train_as_two_nodes(two_processes, tmp_path):
    tag, port = uuid.uuid4().hex, free_port()
    results = tmp_path / "results.json"
    procs = [start([*TORCHRUN, "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test",
                    SCRIPT, *TINY, "--checkpoint-dir", tmp_path / "ckpt", "--results", results], tag)
             for node in (0, 1)]  # fmt: skip
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
    errors = [line for line in stderr.splitlines() if line.startswith("ddp_train.py: error:")]
    assert len(errors) == 1, stderr  # rank 0 alone says it, once
    assert expected in errors[0] and errors[0].endswith(".")
    assert "Traceback" not in stderr.split("ddp_train.py: error:")[0]


@pytest.mark.parametrize("nproc", [NUM_GPUS + 1])
def test_nccl_with_more_processes_than_gpus(nproc):
    code, _, stderr = run([*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", SCRIPT, "--backend", "nccl"])
    check_one_sentence(code, stderr, "the nccl backend needs one GPU per process")


def test_global_batch_smaller_than_world_size():
    code, _, stderr = run([*TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, "--global-batch-size", "1"])
    check_one_sentence(code, stderr, "the global batch (1) is smaller than the number of processes (2)")


def test_busy_port():
    sock, env = busy_port_env()
    with sock:
        code, _, stderr = run([sys.executable, SCRIPT, "--steps", "1"], env)
    check_one_sentence(code, stderr, f"port 127.0.0.1:{env['MASTER_PORT']} is already in use")


def test_corrupt_checkpoint(tmp_path):
    (tmp_path / "step-000010.pt").write_bytes(b"PK\x03\x04 this is not a whole checkpoint")
    code, _, stderr = run([sys.executable, SCRIPT, "--steps", "1", "--checkpoint-dir", tmp_path])
    check_one_sentence(code, stderr, "step-000010.pt cannot be read")


# ---------------------------------------------------------------- SLURM and the book


def named_files(text: str) -> set[str]:
    """Return the repository files that commands in ``text`` name (scripts, batch files, notebooks)."""
    return set(re.findall(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w.-]+\.(?:py|sbatch|sh|ipynb))\b", text))


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


def test_sbatch_file_trains_with_stand_ins_for_slurm(tmp_path):
    """Run the batch file with bash: ``srun`` runs its command once, ``scontrol`` names this host."""
    assert subprocess.run(["bash", "-n", SBATCH]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1",
           "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_GPUS_ON_NODE": "2", "MASTER_PORT": str(free_port())}
    code, stdout, stderr = run(["bash", SBATCH, *TINY, "--results", tmp_path / "results.json",
                                "--checkpoint-dir", tmp_path / "ckpt", "--backend", "gloo"], env)  # fmt: skip
    assert code == 0, stdout + stderr
    assert "[rank 0] 2 process(es) on 1 host(s)" in stdout
    assert (tmp_path / "results.json").is_file()
    shown = next(line for line in stdout.splitlines() if line.startswith("Running on 1 node(s) x 2 process(es):"))
    missing = [n for n in named_files(shown) if not (ROOT / n).is_file()]
    assert "companion/scripts/ddp_train.py" in shown and not missing
