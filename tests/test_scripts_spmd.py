"""Launch chapter 11's DTensor scripts for real, with 2 and 4 gloo processes, and on two loopback "nodes".

- dtensor_basics: every placement reassembles to the full matrix; each
  redistribution uses the collective it should;
- spmd_data_parallel: DTensor replication, replicate() and fully_shard end
  where DDP ends (float32, 1e-5) for every optimiser and both batch dims,
  while the no-sync control does not (so the comparison can fail);
- convnext_sharded: with width-sharded input, the halo exchange and the
  replicate-around-padded-convs remedy match the unsharded model, and the
  naive DTensor path is caught as wrong;
- bad input: one sentence on stderr and a non-zero exit; a method that misses
  its tolerance (or a blind control) exits with code 3;
- two torchrun agents (``--nnodes=2``, c10d rendezvous on 127.0.0.1), one
  process each, give exactly what one node with two processes gives, for every
  multi-process script (``ddp_train.py`` has its own in its test file).

Every launch is tiny; starting the processes is most of the cost.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from companion.launch import LaunchError, launch, script_path

pytestmark = pytest.mark.timeout(120)

DP_TOL = 1e-5  # float32 after a few steps; measured up to ~4e-7 with 4 processes
CONTROL_MIN = (
    1e-4  # training without gradient sync must move at least this far from DDP
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_agents(script: str, args: list[str], tmp_path) -> dict:
    """Run ``script`` under two torchrun agents that meet at a c10d rendezvous, one process each."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    port, results = free_port(), tmp_path / "results.json"
    logs = [
        open(tmp_path / f"agent{n}.log", "w") for n in range(2)
    ]  # files: a full pipe cannot block an agent
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=loopback",
                str(script_path(script)),
                *args,
                "--results",
                str(results),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for log in logs
    ]
    for p in procs:
        p.wait(timeout=200)
    outputs = [log.name for log in logs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    return json.loads(results.read_text())


@pytest.fixture(scope="module")
def basics2() -> dict:
    return launch("dtensor_basics.py", nproc=2, timeout=90)


@pytest.fixture(scope="module")
def dp2() -> dict:
    return launch(
        "spmd_data_parallel.py",
        ["--steps", "2", "--batch-size", "32"],
        nproc=2,
        timeout=120,
    )


@pytest.mark.slow
def test_dtensor_basics_four_processes() -> None:
    out = launch("dtensor_basics.py", nproc=4, timeout=120)
    full = np.array(out["full"])
    by_label = {layout["label"]: layout["locals"] for layout in out["layouts"]}
    assert [np.array(piece).shape for piece in by_label["Shard(0)"]] == [(1, 8)] * 4
    assert np.array_equal(np.concatenate(by_label["Shard(1)"], axis=1), full)
    assert np.array_equal(
        np.sum(by_label["Partial(): A @ B"], axis=0), full @ np.ones((8, 4))
    )
    collectives = {step["label"]: step["collectives"] for step in out["steps"]}
    assert collectives["Partial() -> Shard(0)"] == {"reduce_scatter_tensor": 1}


@pytest.mark.slow  # chapter 11 runs dtensor_basics.py on 4 processes in make test, with verdicts
def test_dtensor_basics_two_processes(basics2) -> None:
    out = basics2
    full = np.array(out["full"])
    by_label = {layout["label"]: layout["locals"] for layout in out["layouts"]}
    assert np.array_equal(np.concatenate(by_label["Shard(0)"], axis=0), full)
    assert np.array_equal(np.concatenate(by_label["Shard(1)"], axis=1), full)
    assert all(np.array_equal(piece, full) for piece in by_label["Replicate()"])
    partial_sum = np.sum(by_label["Partial(): A @ B"], axis=0)
    assert np.array_equal(partial_sum, full @ np.ones((full.shape[1], full.shape[0])))
    collectives = {step["label"]: step["collectives"] for step in out["steps"]}
    assert collectives["Replicate() -> Shard(0)"] == {}
    assert collectives["Partial() -> Replicate()"] == {"all_reduce": 1}
    assert collectives["Partial() -> Shard(0)"] == {"reduce_scatter_tensor": 1}


@pytest.mark.slow  # chapter 11 runs spmd_data_parallel.py on 4 processes in make test, with verdicts
def test_data_parallel_variants_match_ddp(dp2) -> None:
    rows = dp2["rows"]
    assert {(r["model"], r["optimizer"]) for r in rows} >= {
        ("batch dim 1", "Adam lr=0.1 fused")
    }
    for r in rows:
        if r["method"] == "no sync (control)":
            assert r["max_abs_diff"] > CONTROL_MIN, r
        else:
            assert r["max_abs_diff"] <= DP_TOL, r
    assert len(rows) == 2 * 4 * 4  # 2 models x 4 optimisers x 4 methods


@pytest.mark.slow
def test_data_parallel_variants_match_ddp_with_four_processes() -> None:
    out = launch(
        "spmd_data_parallel.py",
        ["--steps", "2", "--batch-size", "32"],
        nproc=4,
        timeout=200,
    )
    assert out["world_size"] == 4
    for r in out["rows"]:
        if r["method"] == "no sync (control)":
            assert r["max_abs_diff"] > CONTROL_MIN, r
        else:
            assert r["max_abs_diff"] <= DP_TOL, r


@pytest.mark.parametrize(
    "tolerance, expected",
    [
        (
            "1e-30",
            "ended .* from DDP, beyond --tolerance 1e-30",
        ),  # after 2 steps some method differs a little
        (
            "10",
            (
                "a no-sync control ended only .* within --tolerance 10, so the comparison "
                "cannot tell"
            ),
        ),
    ],
)
@pytest.mark.slow
def test_a_missed_tolerance_exits_with_code_3(tolerance, expected, capsys) -> None:
    with pytest.raises(LaunchError, match="exit code"):
        launch(
            "spmd_data_parallel.py",
            ["--steps", "2", "--batch-size", "32", "--tolerance", tolerance],
            nproc=2,
            timeout=120,
        )
    lines = [
        line
        for line in capsys.readouterr().out.splitlines()
        if "spmd_data_parallel.py: error:" in line
    ]
    assert len(lines) == 1 and re.search(expected, lines[0]), lines


def test_an_uneven_batch_is_refused_before_training() -> None:
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}
    proc = subprocess.run(
        [
            sys.executable,
            str(script_path("spmd_data_parallel.py")),
            "--batch-size",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "spmd_data_parallel.py: error: --batch-size 30 does not split evenly over 4 "
        "processes; "
        "use a multiple of 4.\n"
    )


@pytest.mark.slow  # chapter 11 runs the same 4-process check in make test, with verdicts
def test_convnext_width_sharded_matches_unsharded_and_naive_is_caught() -> None:
    out = launch(
        "convnext_sharded.py",
        ["--conv-mode", "halo", "replicate", "naive", "--iters", "1"],
        nproc=4,
        timeout=120,
    )
    modes = {m["conv_mode"]: m for m in out["modes"]}
    for mode in ("halo", "replicate"):
        assert modes[mode]["ok"], modes[mode]
        assert modes[mode]["loss_diff"] <= out["tolerance"]
        assert modes[mode]["grad_rel_diff"] <= out["tolerance"]
    # Sharding the width 4 ways leaves each rank about a quarter of the activations.
    assert modes["halo"]["saved_bytes"] < 0.4 * out["reference_saved_bytes"]
    naive = modes["naive"]
    assert not naive["ok"]
    assert naive["probe_diff"] > 1e-3  # the silent error: a wrong mean, no exception
    assert (
        "must match the size" in naive["model_error"]
    )  # the loud one, at the residual add


@pytest.mark.slow  # about 20 s of DTensor backward passes on 2 processes
def test_convnext_batch_sharded_matches_unsharded() -> None:
    out = launch(
        "convnext_sharded.py",
        ["--shard-dim", "0", "--conv-mode", "naive", "--iters", "1"],
        nproc=2,
        timeout=120,
    )
    (mode,) = out["modes"]
    assert (
        out["shard_dim"] == 0 and mode["ok"]
    )  # batch shards need no halo: even DTensor's own conv is right
    assert (
        mode["loss_diff"] <= out["tolerance"]
        and mode["grad_rel_diff"] <= out["tolerance"]
    )


def test_bad_input_is_one_sentence() -> None:
    proc = subprocess.run(
        [sys.executable, str(script_path("convnext_sharded.py")), "--iters", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr
        == "convnext_sharded.py: error: --iters must be at least 1 and --timeout positive.\n"
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_too_many_processes_for_the_halo_is_one_sentence_from_rank_0(rank) -> None:
    """8 processes leave 2 columns per rank in the last stage: refused before the processes meet."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "8"}
    proc = subprocess.run(
        [sys.executable, str(script_path("convnext_sharded.py"))],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2
    expected = (
        "convnext_sharded.py: error: with 8 processes each holds 2 column(s) of the "
        "last stage, fewer "
        "than the halo of 3; use at most 4 processes, or --conv-mode replicate.\n"
    )
    assert proc.stderr == (expected if rank == 0 else "")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_loopback_nodes_equal_one_node_hello_and_basics(basics2, tmp_path) -> None:
    hello = two_agents("hello_distributed.py", [], tmp_path / "hello")
    assert hello == {"world_size": 2, "backend": "gloo", "sum": 3.0}
    assert two_agents("dtensor_basics.py", [], tmp_path / "basics") == basics2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_loopback_nodes_equal_one_node_data_parallel(dp2, tmp_path) -> None:
    dp = two_agents(
        "spmd_data_parallel.py", ["--steps", "2", "--batch-size", "32"], tmp_path / "dp"
    )
    assert dp["rows"] == dp2["rows"]  # every difference from DDP, bit for bit


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_loopback_nodes_equal_one_node_convnext(tmp_path) -> None:
    args = ["--conv-mode", "halo", "--iters", "1"]
    one = launch("convnext_sharded.py", args, nproc=2, timeout=120)
    two = two_agents("convnext_sharded.py", args, tmp_path / "convnext")
    for key in ("loss", "loss_diff", "grad_diff", "saved_bytes", "ok"):
        assert two["modes"][0][key] == one["modes"][0][key], key


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_loopback_nodes_equal_one_node_resnet(tmp_path) -> None:
    args = [
        "--width",
        "4",
        "--epochs",
        "1",
        "--global-batch-size",
        "16",
        "--max-train",
        "32",
        "--timing-steps",
        "0",
    ]
    one = launch("ddp_resnet.py", args, nproc=2, timeout=120)
    two = two_agents("ddp_resnet.py", args, tmp_path / "resnet")
    assert (
        two["loss_curve"] == one["loss_curve"]
        and two["test_accuracy"] == one["test_accuracy"]
    )
