"""Every script, on GPU machines and clusters it has never seen: the same decision on every rank.

No GPU and no SLURM here, so ``tests/scripts/fake_cluster.py`` plays them: two
real processes meet at a real rendezvous, each with the GPUs (count, uuids),
host name and launcher environment that a case gives it, and record the
backend and ``device_id`` each script passes to ``init_process_group``, or
the error each rank reached. The cases, for each of the nine scripts:

- torchrun, no GPU: gloo on the CPU for both;
- torchrun, two GPUs per node: nccl, ``cuda:0`` and ``cuda:1``;
- torchrun, one GPU for two processes: gloo for both (a mix hangs);
- one GPU seen by one rank only (uneven nodes): gloo for both;
- srun on one node with ``--gpus-per-task=1`` (each sees its own GPU as
  ``cuda:0``): nccl, ``cuda:0`` on both;
- srun on two nodes: MASTER_ADDR from the node list's first host, a port from
  the job id, nccl;
- srun on two nodes with no node list: the same one sentence on both ranks,
  printed by rank 0 only, exit code 2.

and for ``ddp_train.py --backend nccl`` with one GPU for two processes, the
same one-sentence refusal on both ranks. Both processes run all cases in
turn, so torch is imported twice in all.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "companion" / "scripts"
FAKE = ROOT / "tests" / "scripts" / "fake_cluster.py"
ALL = sorted(p.name for p in SCRIPTS.glob("*.py") if p.name != "__init__.py")

pytestmark = pytest.mark.timeout(300)


TAKEN: set[int] = set()


def free_port(low: int = 20000, high: int = 40000) -> int:
    """A free port in ``[low, high)``, a new one each call: SLURM cases derive theirs from the job id."""
    for port in range(low + os.getpid() % 1000 * 7, high):
        if port in TAKEN:
            continue
        TAKEN.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def torchrun(gpus: list[list[str]], hosts=("host0", "host0")) -> list[dict]:
    port = str(free_port())
    return [
        {
            "host": hosts[r],
            "gpus": gpus[r],
            "env": {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        }
        for r in range(2)
    ]


def srun(gpus: list[list[str]], nodes: int, nodelist: str | None) -> list[dict]:
    job = str(free_port())  # 20000 + job % 20000 == job for a job id in [20000, 40000)
    procs = []
    for r in range(2):
        node = r if nodes == 2 else 0
        env = {
            "SLURM_PROCID": str(r),
            "SLURM_LOCALID": str(r if nodes == 1 else 0),
            "SLURM_NTASKS": "2",
            "SLURM_NNODES": str(nodes),
            "SLURM_NODEID": str(node),
            "SLURM_JOB_ID": job,
        }
        if nodelist:
            env["SLURM_JOB_NODELIST"] = nodelist
        procs.append({"host": f"node{node + 1}", "gpus": gpus[r], "env": env})
    return procs


# name: (processes, expected outcome: "gloo", "nccl" or an error to find in every
# rank's sentence)
CASES = {
    "torchrun, no GPU": (lambda: torchrun([[], []]), "gloo"),
    "torchrun, 2 GPUs per node": (
        lambda: torchrun([["G0", "G1"], ["G0", "G1"]]),
        "nccl",
    ),
    "torchrun, 1 GPU for 2 processes": (lambda: torchrun([["G0"], ["G0"]]), "gloo"),
    "torchrun, a GPU on one rank only": (
        lambda: torchrun([["G0"], []], hosts=("host0", "host1")),
        "gloo",
    ),
    "srun, 1 node, --gpus-per-task=1": (
        lambda: srun([["G0"], ["G1"]], 1, None),
        "nccl",
    ),
    "srun, 2 nodes": (lambda: srun([["G0"], ["G0"]], 2, "node[1-2]"), "nccl"),
    "srun, 2 nodes, no node list": (
        lambda: srun([["G0"], ["G0"]], 2, None),
        "MASTER_ADDR",
    ),
}
EXPECTED_DEVICES = {  # device_id per rank when nccl is chosen
    "torchrun, 2 GPUs per node": ["cuda:0", "cuda:1"],
    "srun, 1 node, --gpus-per-task=1": ["cuda:0", "cuda:0"],
    "srun, 2 nodes": ["cuda:0", "cuda:0"],
}


def make_plan() -> list[dict]:
    plan = []
    for script in ALL:
        for name, (processes, expected) in CASES.items():
            plan.append(
                {
                    "name": name,
                    "script": str(SCRIPTS / script),
                    "args": ["--timeout", "60"],
                    "processes": processes(),
                    "expected": expected,
                }
            )
    plan.append(
        {
            "name": "torchrun, 1 GPU for 2 processes, --backend nccl",
            "script": str(SCRIPTS / "ddp_train.py"),
            "args": ["--timeout", "60", "--backend", "nccl"],
            "processes": torchrun([["G0"], ["G0"]]),
            "expected": "the nccl backend needs one GPU per process, but host0 has 1 GPU(s) for 2 processes",
        }
    )
    return plan


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[tuple[dict, list[dict]]]:
    """Run the whole plan once in two processes; return each case with both ranks' records."""
    tmp = tmp_path_factory.mktemp("contract")
    plan = make_plan()
    (tmp / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs = [
        subprocess.Popen(
            [sys.executable, FAKE, tmp / "plan.json", str(r), tmp / f"rank{r}.json"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    texts = [p.communicate(timeout=280) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], texts
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    return [(case, [ranks[0][i], ranks[1][i]]) for i, case in enumerate(plan)]


def case_ids() -> list[str]:
    return [f"{Path(c['script']).name}: {c['name']}" for c in make_plan()]


@pytest.mark.parametrize("index", range(len(make_plan())), ids=case_ids())
def test_every_rank_reaches_the_same_decision(outcomes, index):
    case, (rank0, rank1) = outcomes[index]
    expected = case["expected"]
    if expected in ("gloo", "nccl"):
        for rank, rec in enumerate((rank0, rank1)):
            assert rec.get("backend") == expected, (rank, rec)
            assert "error" not in rec, (rank, rec)
        devices = [rank0["device_id"], rank1["device_id"]]
        assert devices == EXPECTED_DEVICES.get(
            case["name"], [None, None]
        )  # nccl: device_id names the GPU
        if expected == "nccl":
            assert [rank0.get("set_device"), rank1.get("set_device")] == devices
        if case["name"] == "srun, 2 nodes":
            port = int(
                case["processes"][0]["env"]["SLURM_JOB_ID"]
            )  # 20000 + id % 20000
            assert rank0["master"] == rank1["master"] == f"node1:{port}"
    else:
        # The same sentence on both ranks, a non-zero exit everywhere, printed
        # once (by rank 0).
        assert rank0["exit_code"] == rank1["exit_code"] == 2, (rank0, rank1)
        assert expected in rank0.get("error", "") and rank0.get("error") == rank1.get(
            "error"
        ), (rank0, rank1)
        lines = rank0["stderr"].strip().splitlines()
        assert lines == [f"{Path(case['script']).name}: error: {rank0['error']}"], (
            rank0["stderr"]
        )
        assert (
            rank1["stderr"].strip() == ""
            and "backend" not in rank0
            and "backend" not in rank1
        )


def test_the_plan_covers_every_script():
    assert len(ALL) == 9 and {Path(c["script"]).name for c in make_plan()} == set(ALL)


@pytest.mark.parametrize("script", ALL)
def test_help_shows_launch_lines_outputs_and_exit_codes(script):
    text = subprocess.run(
        [sys.executable, SCRIPTS / script, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    text = " ".join(text.split())  # argparse wraps option help at the terminal width
    assert (
        "torchrun --standalone" in text
        and "torchrun --nnodes=2" in text
        and "srun" in text
    )
    assert "Exit codes:" in text and "--timeout" in text and "default: 600" in text
    assert "--results" in text
    if script == "ddp_resnet.py":
        assert "train_images" in text and "weights_only=True" in text  # the data format


@pytest.mark.parametrize("script", ALL)
def test_an_old_torch_gets_one_sentence(script, tmp_path):
    """A fake ``torch`` package that says it is 2.0.0 stands first on the path."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.0.0"\n')
    proc = subprocess.run(
        [sys.executable, SCRIPTS / script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"{script}: error: this script needs PyTorch 2.")
    assert "not 2.0.0" in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu[07-08,10],cpu1", "gpu07"),
        ("node-a,node-b", "node-a"),
        ("n[001-004]", "n001"),
        ("single", "single"),
        ("", ""),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist, first):
    import importlib.util

    for script in ALL:
        spec = importlib.util.spec_from_file_location(script[:-3], SCRIPTS / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.first_host(nodelist) == first, script
