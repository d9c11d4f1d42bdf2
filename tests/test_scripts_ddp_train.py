"""Launch companion/scripts/ddp_train.py for real, in several processes on this machine.

- parity: 2 processes (srun's environment with a simulated GPU per task;
  torchrun, mp.spawn and srun on the CPU in make test-slow) end with the
  parameters of 1 process on the same global batch (float64, 1e-12), and one
  process on the simulated GPU path (nccl, cuda) too;
- checkpoints: atomic, pruned by step, refused when the settings changed, and
  a run that resumes ends bit for bit where an uninterrupted one ends (slow:
  chapter 09 resumes and compares in every nbval run);
- fault tolerance (slow): a worker killed mid-training under ``torchrun
  --max-restarts=1`` is restarted and the run ends exactly where an
  uninterrupted run ends;
- several nodes (slow): two torchrun agents train together as two nodes;
- bad input: one sentence on stderr, exit code 2, nothing left running: each
  cause in the table of book/cluster.md is provoked, and the script says what
  the page quotes (the two-node cause in make test-slow);
- the SLURM batch file and the book's cluster page name only files that exist,
  the page only flags that the script, torchrun or the batch file take, and
  the batch file trains when run with stand-ins for ``srun`` and ``scontrol``.

Every launch is tiny (24 steps of a small MLP); the processes are the cost.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from launchers import LAUNCHER, SIMULATED_GPU, free_port, one_sentence_under_torchrun
from torch.distributed.run import get_args_parser

from companion.scripts import ddp_train

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "companion" / "scripts" / "ddp_train.py"
KILL_ONCE = ROOT / "tests" / "programs" / "kill_once.py"
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

pytestmark = pytest.mark.timeout(240)


def tagged(tag: str) -> list[psutil.Process]:
    """The live processes whose environment carries ``tag``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def assert_none_left(tag: str) -> None:
    """Fail if a process started under ``tag`` is still alive a few seconds later (and kill it)."""
    deadline = time.monotonic() + 10
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    for proc in tagged(tag):
        try:
            left.append(" ".join(proc.cmdline()))
            proc.kill()
        except psutil.Error:
            pass
    assert not left, f"processes left behind: {left}"


def start(
    cmd: list, tag: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env={
            **clean,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            TAG: tag,
            **(env or {}),
        },
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(procs: list[subprocess.Popen], tag: str, timeout: float = 180) -> list:
    """Wait for ``procs``; return ``(returncode, stdout, stderr)`` of each; check nothing survives."""
    out, deadline = [], time.monotonic() + timeout
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(
                timeout=max(1, deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            assert_none_left(tag)
            pytest.fail(f"{proc.args} ran past {timeout:g} s")
        out.append((proc.returncode, stdout, stderr))
    assert_none_left(tag)
    return out


def run(
    cmd: list, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> tuple[int, str, str]:
    tag = uuid.uuid4().hex
    return finish([start(cmd, tag, env, cwd)], tag)[0]


def train(
    cmd: list, workdir: Path, env: dict[str, str] | None = None
) -> tuple[dict, str]:
    """Run a training command that must succeed; return its results and its output."""
    results = workdir / "results.json"
    code, stdout, stderr = run(
        [*cmd, "--checkpoint-dir", workdir / "ckpt", "--results", results], env
    )
    assert code == 0, f"exit code {code}\n{stdout}\n{stderr}"
    return json.loads(results.read_text()), stdout + stderr


def final_params(results: dict) -> dict[str, torch.Tensor]:
    return torch.load(results["checkpoint"], map_location="cpu", weights_only=True)[
        "model"
    ]


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def srun_env(rank: int, port: int, tasks: int = 2) -> dict[str, str]:
    """What srun (and the batch file's MASTER_ADDR/PORT) set for task ``rank`` on one node."""
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NTASKS": str(tasks),
        "SLURM_NTASKS_PER_NODE": str(tasks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


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


def test_data_plan_gives_every_rank_an_equal_nonempty_shard(capsys):
    for world_size in range(1, 9):
        for samples in (1, 100, 2048):
            train_n, test_n, batch = ddp_train.plan_data(samples, None, world_size)
            assert batch >= 64 and batch % world_size == 0
            assert train_n >= samples and train_n % batch == 0
            assert test_n >= world_size  # at least one test sample per rank
    with pytest.raises(SystemExit) as stop:
        ddp_train.plan_data(100, 64, 3)
    assert stop.value.code == 2 and "use a multiple of 3" in capsys.readouterr().err


def test_checkpoints_are_atomic_pruned_by_step_and_checked(tmp_path, capsys):
    config = {
        "global_batch_size": 64,
        "lr": 0.05,
        "seed": 0,
        "samples": 2048,
        "dtype": "float32",
        "steps": 30,
    }
    model = torch.nn.Linear(2, 2)
    # As text, "step-1000000.pt" sorts before "step-999999.pt": pruning goes by step.
    for step in (10, 999_999, 1_000_000):
        state = {"model": model.state_dict(), "step": step, "config": config}
        ddp_train.save_checkpoint(tmp_path, state, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-1000000.pt",
        "step-999999.pt",
    ]  # no .tmp left
    cpu = torch.device("cpu")
    assert ddp_train.load_checkpoint(tmp_path, cpu, config)["step"] == 1_000_000
    assert ddp_train.load_checkpoint(tmp_path / "empty", cpu, config) is None
    for change, said in (
        ({**config, "lr": 0.1}, "was written with other settings (lr)"),
        ({**config, "steps": 99}, None),  # more steps continue the run
    ):
        if said is None:
            assert ddp_train.load_checkpoint(tmp_path, cpu, change)["step"] == 1_000_000
            continue
        with pytest.raises(SystemExit):
            ddp_train.load_checkpoint(tmp_path, cpu, change)
        assert said in capsys.readouterr().err


class Evil:
    def __reduce__(self):
        return (print, ("this would run when loaded",))


@pytest.mark.parametrize(
    "content, said",
    [
        (b"PK\x03\x04 half a zip", "cannot load"),
        (b"", "cannot load"),
        ({"model": Evil()}, "Weights only load failed"),
        ({"model": {}}, "is not one of this script's checkpoints"),
    ],
)
def test_a_checkpoint_that_cannot_load_is_one_sentence(tmp_path, capsys, content, said):
    """torch's own words, never "delete it": the file may be fine (refused code, no memory)."""
    path = tmp_path / "step-000010.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(SystemExit) as stop:
        ddp_train.load_checkpoint(tmp_path, torch.device("cpu"), {})
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and said in err
    assert "delete" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "0"],
        ["--samples", "0"],
        ["--log-every", "-1"],
        ["--epochs", "0"],
        ["--spawn", "-1"],
        ["--lr", "fast"],
    ],
)
def test_bad_arguments_stop_with_exit_code_2(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        ddp_train.parse_args(argv)
    assert stop.value.code == 2 and "error:" in capsys.readouterr().err


# ---------------------------------------------------------------- parity


def test_one_process_learns(one_process):
    assert one_process["world_size"] == 1 and one_process["backend"] == "gloo"
    assert one_process["device"] == "cpu" and len(one_process["losses"]) == 24
    assert one_process["losses"][-1] < one_process["losses"][0] / 2
    assert one_process["test_accuracy"] > 0.8 and 0.8 < one_process["train_accuracy"]


@pytest.mark.slow
def test_the_log_gathers_losses_every_n_steps(tmp_path):
    """--epochs 1.5 with 8 steps per epoch is 12 steps; logs every 8 steps and at the end."""
    args = [arg for arg in TINY if arg not in ("--steps", "24")]
    results, output = train(
        [sys.executable, SCRIPT, *args, "--epochs", "1.5"], tmp_path
    )
    assert len(results["losses"]) == 12 and results["steps"] == 12
    logged = re.findall(r"step +(\d+)/12  loss ([\d.]+)", output)
    assert [int(s) for s, _ in logged] == [8, 12]
    assert float(logged[-1][1]) == pytest.approx(results["losses"][-1], abs=1e-4)


@pytest.mark.slow
def test_srun_tasks_with_a_gpu_each_match_one_process(one_process, tmp_path):
    """``srun --ntasks-per-node=2 --gpus-per-task=1`` on simulated GPUs: each task
    sees its own GPU as cuda:0 while ``SLURM_LOCALID`` is 0 and 1, so DDP must
    be told the device, not the local rank (it was told cuda:1 once)."""
    tag, port = uuid.uuid4().hex, free_port()
    cmd = [
        sys.executable,
        SIMULATED_GPU,
        SCRIPT,
        *TINY,
        "--checkpoint-dir",
        tmp_path / "ckpt",
        "--results",
        tmp_path / "results.json",
    ]
    gpus = {"SIMULATED_GPUS": "2"}  # the node's; each task sees one of them
    procs = [
        start(cmd, tag, {**srun_env(r, port), **gpus, "CUDA_VISIBLE_DEVICES": str(r)})
        for r in range(2)
    ]
    outcomes = finish(procs, tag)
    assert [code for code, _, _ in outcomes] == [0, 0], outcomes
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["rank"], r["local_rank"], r["device"]) for r in results["ranks"]] == [
        (0, 0, "cuda"),
        (1, 1, "cuda"),
    ]
    assert results["backend"] == "nccl" and results["world_size"] == 2
    assert max_difference(final_params(results), final_params(one_process)) < TOL
    assert results["losses"] == pytest.approx(one_process["losses"], abs=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "mp.spawn", "srun"])
def test_two_processes_match_one(launcher, one_process, request, tmp_path):
    if launcher == "torchrun":
        results = request.getfixturevalue("two_processes")
    elif launcher == "srun":
        tag, port = uuid.uuid4().hex, free_port()
        cmd = [
            sys.executable,
            SCRIPT,
            *TINY,
            "--checkpoint-dir",
            tmp_path / "ckpt",
            "--results",
            tmp_path / "results.json",
        ]
        procs = [start(cmd, tag, srun_env(r, port)) for r in range(2)]
        assert [code for code, _, _ in finish(procs, tag)] == [0, 0]
        results = json.loads((tmp_path / "results.json").read_text())
    else:
        results, _ = train([sys.executable, SCRIPT, *TINY, "--spawn", "2"], tmp_path)
    assert results["world_size"] == 2 and results["threads"] == 1
    assert max_difference(final_params(results), final_params(one_process)) < TOL
    assert results["losses"] == pytest.approx(one_process["losses"], abs=TOL)


@pytest.mark.slow
def test_the_gpu_path_trains_and_resumes_on_a_simulated_gpu(one_process, tmp_path):
    """nccl and cuda:0 as on a GPU machine; the simulation raises what CUDA would."""
    cmd = [sys.executable, SIMULATED_GPU, SCRIPT, *TINY[2:]]
    first, _ = train([*cmd, "--steps", "16"], tmp_path)
    resumed, output = train([*cmd, "--steps", "24"], tmp_path)
    assert (first["device"], first["backend"]) == ("cuda", "nccl")
    assert "resuming at step 16" in output and resumed["start_step"] == 16
    assert max_difference(final_params(resumed), final_params(one_process)) < TOL


# ---------------------------------------------------------------- resuming


@pytest.mark.slow  # chapter 09 resumes and compares in every nbval run
def test_a_resumed_run_ends_bit_for_bit_where_a_straight_one_ends(
    one_process, tmp_path
):
    shutil.copytree(Path(one_process["checkpoint"]).parent, tmp_path / "ckpt")
    more = [*TINY[2:], "--steps", "32"]
    resumed, output = train([sys.executable, SCRIPT, *more], tmp_path)
    straight, _ = train([sys.executable, SCRIPT, *more], tmp_path / "straight")
    assert "resuming at step 24" in output and resumed["start_step"] == 24
    assert resumed["losses"][:24] == one_process["losses"]
    a, b = final_params(resumed), final_params(straight)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_killed_worker_restarts_and_resumes_from_its_checkpoint(
    two_processes, tmp_path
):
    # Rank 1 dies of SIGKILL after step 12 (once); the newest checkpoint then is
    # step 8. Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the restarted workers
    # share the first attempt's store and may read its stale addresses
    # (pytorch/pytorch#135712, #167288): about half of the restarts failed.
    env = {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "KILL_AT_STEP": "12",
        "KILL_MARKER": str(tmp_path / "killed"),
    }
    results, output = train(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            KILL_ONCE,
            *TINY,
        ],
        tmp_path,
        env,
    )
    assert (tmp_path / "killed").exists()  # rank 1 touched it, then died of SIGKILL
    # torchrun saw the group fail. Which rank it names is a race: rank 0's @record
    # may time-stamp its own error (gloo lost its peer) a second before torchrun
    # polls rank 1's -9, and then it names rank 0 (-15 or 1), as CI once saw.
    assert re.search(r"failed \(exitcode: -?\d+\) local_rank: [01]", output)
    assert "resuming at step 8" in output and results["start_step"] == 8
    assert results["losses"] == two_processes["losses"]
    a, b = final_params(results), final_params(two_processes)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit


def two_nodes_command(port: int, args: list) -> list:
    """One of two torchrun agents (one process each) that meet on 127.0.0.1."""
    return [
        *TORCHRUN,
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=test",
        SCRIPT,
        *TINY,
        *args,
    ]


@pytest.mark.slow
def test_two_torchrun_agents_train_as_two_nodes(two_processes, tmp_path):
    tag, port = uuid.uuid4().hex, free_port()
    args = [
        "--checkpoint-dir",
        tmp_path / "ckpt",
        "--results",
        tmp_path / "results.json",
    ]
    procs = [start(two_nodes_command(port, args), tag) for _ in (0, 1)]
    outcomes = finish(procs, tag)
    assert [code for code, _, _ in outcomes] == [0, 0], outcomes
    two_nodes = json.loads((tmp_path / "results.json").read_text())
    assert [(r["rank"], r["local_rank"]) for r in two_nodes["ranks"]] == [
        (0, 0),
        (1, 0),
    ]
    assert max_difference(final_params(two_nodes), final_params(two_processes)) < TOL


# ---------------------------------------------------------------- bad input
# Each cause in the cluster page's table, provoked: the page quotes what the
# script says, and these tests check that it says so.


def one_sentence(code: int, output: str) -> str:
    """What every failing rank said: one sentence, no traceback before it."""
    errors = {
        line.removeprefix("ddp_train.py: error: ")
        for line in output.splitlines()
        if line.startswith("ddp_train.py: error: ")
    }
    assert code != 0 and len(errors) == 1, output
    assert "Traceback" not in output.split("ddp_train.py: error:")[0]
    return errors.pop()


def alone(args: list, env: dict | None = None, cwd: Path = ROOT) -> str:
    """Run one process with ``args``; return its sentence (exit code 2, one line)."""
    code, stdout, stderr = run([sys.executable, SCRIPT, *args], env, cwd)
    assert code == 2 and stderr.count("\n") == 1, stdout + stderr
    return one_sentence(code, stderr)


def busy_port(tmp_path: Path) -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        return alone(["--timeout", "5"], srun_env(0, sock.getsockname()[1]))


def checkpoint(tmp_path: Path, content: dict, cut: bool = False) -> Path:
    """``tmp_path/ckpt/step-000010.pt`` holding ``content``, its first half if
    ``cut``; return the folder to run in."""
    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "ckpt" / "step-000010.pt"
    torch.save(content, path)
    if cut:  # as a full disk or a killed copy leaves it
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return tmp_path


def folders_not_shared(tmp_path: Path) -> str:
    """A relative --checkpoint-dir on two nodes: each has its own folder, and only
    node 0's holds a checkpoint. Training apart would go wrong silently."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    code, _, err = run(
        [
            *TORCHRUN,
            "--nproc-per-node=1",
            SCRIPT,
            *TINY,
            "--steps",
            "8",
            "--checkpoint-dir",
            nodes[0] / "ckpt",
        ]
    )
    assert code == 0, err
    tag, port = uuid.uuid4().hex, free_port()
    command = two_nodes_command(port, ["--checkpoint-dir", "ckpt"])
    outcomes = finish([start(command, tag, cwd=node) for node in nodes], tag)
    outputs = [out + err for _, out, err in outcomes]
    assert all(code != 0 for code, _, _ in outcomes), outputs
    # Rank 0 says it; the other node's agent loses the rendezvous as rank 0's
    # stops, and ends its worker before that worker's wait is over.
    said = {one_sentence(1, out) for out in outputs if "ddp_train.py: error:" in out}
    assert len(said) == 1, outputs
    sentence = said.pop()
    assert "[0, 8]" in sentence or "[8, 0]" in sentence
    return sentence


SETTINGS = {
    "global_batch_size": 64,
    "lr": 0.1,
    "seed": 0,
    "samples": 2048,
    "dtype": "float32",
    "steps": 200,
}  # the defaults, but for lr
CAUSES = {
    "a flag it does not know, or a bad value": lambda tmp: alone(["--lr", "fast"]),
    "`--global-batch-size 33` with 2 processes": lambda tmp: (
        one_sentence_under_torchrun("ddp_train.py", ["--global-batch-size", "33"], 2)
    ),
    "2 processes on a node whose processes see 1 GPU": lambda tmp: (
        one_sentence_under_torchrun(
            "ddp_train.py", [], 2, {"SIMULATED_GPUS": "2", "CUDA_VISIBLE_DEVICES": "1"}
        )
    ),
    "`srun`, several tasks, without `MASTER_ADDR`": lambda tmp: alone(
        [], {k: v for k, v in srun_env(0, 1).items() if not k.startswith("MASTER_")}
    ),
    "`MASTER_PORT` already taken, under `srun`": busy_port,
    "a process missing for `--timeout` seconds": lambda tmp: alone(
        ["--timeout", "2"], srun_env(0, free_port())
    ),
    "a damaged checkpoint": lambda tmp: alone(
        ["--checkpoint-dir", "ckpt"],
        cwd=checkpoint(tmp, {"config": SETTINGS}, cut=True),
    ),
    "a checkpoint written with other settings": lambda tmp: alone(
        ["--checkpoint-dir", "ckpt"], cwd=checkpoint(tmp, {"config": SETTINGS})
    ),
    "the checkpoint folder not shared between nodes": folders_not_shared,
}
# Several processes: make test launches torchrun's failure path once
# (tests/test_scripts.py) and checks these two sentences in-process.
SLOW = {
    "`--global-batch-size 33` with 2 processes",
    "2 processes on a node whose processes see 1 GPU",
    "the checkpoint folder not shared between nodes",
}


def quoted() -> dict[str, str]:
    """The cluster page's table of bad input: each cause, and what the script says."""
    section = CLUSTER_PAGE.read_text().split("## When something is wrong")[1]
    return dict(re.findall(r"^\| (.+?) \| `(.+?)` \|$", section, re.M))


def matches(quote: str, sentence: str) -> bool:
    """Whether ``sentence`` is ``quote``, whose ``...`` stands for any text."""
    pattern = ".*".join(re.escape(piece.strip()) for piece in quote.split("..."))
    return re.fullmatch(pattern, sentence) is not None


@pytest.mark.slow
def test_a_bad_launch_under_mp_spawn_is_one_sentence_and_exit_code_2():
    code, out, err = run(
        [sys.executable, SCRIPT, "--spawn", "2", "--global-batch-size", "33"]
    )
    assert code == 2 and "Traceback" not in out + err, out + err
    assert one_sentence(code, err).startswith("the global batch (33) does not split")


def test_the_cluster_page_quotes_a_sentence_for_each_cause_the_tests_provoke():
    assert list(quoted()) == list(CAUSES)
    assert matches("a ... c ...", "a b c d") and not matches("a ... c", "a b c d")


@pytest.mark.parametrize(
    "cause",
    [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else []) for c in CAUSES],
)
@pytest.mark.slow
def test_bad_input_is_the_sentence_the_cluster_page_quotes(cause, tmp_path):
    said = CAUSES[cause](tmp_path)
    assert matches(quoted()[cause], said), (
        f"the page quotes {quoted()[cause]!r}, the script said {said!r}"
    )


# ---------------------------------------------------------------- SLURM and the book


def named_files(text: str) -> set[str]:
    """The repository files that commands in ``text`` name (scripts, batch files, notebooks)."""
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


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")


def test_every_flag_the_cluster_page_names_exists(capsys):
    """A flag after ``ddp_train.py`` (or its batch file) in a command is one of the
    script's; any other is the script's, torchrun's, or SLURM's from the batch file."""
    with pytest.raises(SystemExit):
        ddp_train.parse_args(["--help"])
    options = capsys.readouterr().out.split("options:")[1]
    own = set(re.findall(r"^ +(?:-\w, )?(--[a-z-]+)", options, re.M))
    assert {"--checkpoint-dir", "--timeout", "--lr"} <= own and "--backend" not in own
    text = CLUSTER_PAGE.read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            for args in re.split(r"ddp_train\.(?:py|sbatch)\b", command)[1:]:
                assert set(FLAG.findall(args)) <= own, command
    torchrun = set(get_args_parser()._option_string_actions)
    slurm = set(FLAG.findall(SBATCH.read_text())) - own - torchrun
    unknown = set(FLAG.findall(text)) - own - torchrun - slurm
    assert not unknown, f"the page names flags that nothing takes: {sorted(unknown)}"


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
    record_file = tmp_path / "srun.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
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
        ],
    )
    assert code == 0 and record["problems"] == [], output
    assert "2 process(es) on cpu" in output and (tmp_path / "results.json").is_file()
    shown = next(
        line
        for line in output.splitlines()
        if line.startswith("Running on 1 node(s) x 2 process(es):")
    )
    missing = [n for n in named_files(shown) if not (ROOT / n).is_file()]
    assert "companion/scripts/ddp_train.py" in shown and not missing
