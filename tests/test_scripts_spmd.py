"""Chapter 11's DTensor scripts and their checks, launched for real on gloo processes.

- dtensor_basics.py (checks/dtensor_placements.py): every placement
  reassembles to the matrix; each change of placement costs the collective,
  and the bytes, it should;
- spmd_data_parallel.py (checks/spmd_vs_ddp.py): DTensor replication,
  replicate() and fully_shard end where DDP ends (float64) for every
  optimiser and both batch dims, while the no-sync control does not (so the
  comparison can fail);
- convnext_sharded.py (checks/convnext_vs_unsharded.py): with width-sharded
  input, the halo exchange and the replicate remedy match the unsharded model
  in float64 on every torch, and DTensor's own padded convolution does not:
  it fails where DTensor labels its output Replicate() (torch 2.13 and later),
  and its gradients are off where it exchanges halos itself (2.10 to 2.12);
- bad launches end in one sentence before the processes meet; two torchrun
  agents (two loopback "nodes") give what one node gives; each script runs
  its GPU path on a simulated GPU (tests/programs/simulated_gpu.py).

The launches take 10 to 40 s each on 2 cores, so they are marked slow:
chapter 11 launches the three checks on 4 processes in ``make test``, with
verdicts. What runs in ``make test`` here is the scripts' argument checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from launchers import SIMULATED_GPU, one_sentence_under_torchrun, two_agents

from companion.harness.launch import launch, script_path
from companion.scripts import convnext_sharded, dtensor_basics, spmd_data_parallel

pytestmark = pytest.mark.timeout(240)

CONTROL_MIN = 1e-4  # training without gradient sync moves at least this far


# ---------------------------------------------------------------- bad launches


@pytest.mark.parametrize(
    "script, argv, world_size, said",
    [
        (
            spmd_data_parallel,
            ["--batch-size", "30"],
            "4",
            (
                "--batch-size 30 does not split evenly over 4 processes; use a multiple "
                "of 4."
            ),
        ),
        (
            spmd_data_parallel,
            ["--steps", "0"],
            "1",
            "--steps must be at least 1, not 0.",
        ),
        (
            convnext_sharded,
            [],
            "8",
            (
                "with 8 processes each holds 2 column(s) of the last stage, fewer than "
                "the halo of 3; use fewer processes, or --conv-mode replicate."
            ),
        ),
        (
            convnext_sharded,
            ["--conv-mode", "replicate"],
            "3",
            "3 processes do not divide dim 3 (256).",
        ),
        (
            convnext_sharded,
            ["--shard-dim", "0"],
            "4",
            "4 processes do not divide dim 0 (2).",
        ),
        (
            dtensor_basics,
            ["--rows", "0"],
            "1",
            "--rows and --cols must be positive, not 0 and 8.",
        ),
    ],
)
def test_a_bad_launch_is_one_sentence(
    script, argv, world_size, said, monkeypatch, capsys
):
    """Refused in ``parse_args``, before the processes meet, on every rank."""
    monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(SystemExit) as stop:
        script.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f": error: {said}\n") and err.count("\n") == 1, err


@pytest.mark.slow
def test_a_bad_launch_under_torchrun_is_said_once_and_named_the_root_cause():
    said = one_sentence_under_torchrun("convnext_sharded.py", [], 3)
    assert said == "3 processes do not divide dim 3 (256)."


def test_eight_processes_may_replicate_instead_of_exchanging_halos(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = convnext_sharded.parse_args(["--conv-mode", "replicate"])
    assert args.config == convnext_sharded.SMALL


# ---------------------------------------------------------------- placements


@pytest.fixture(scope="module")
def placements2() -> dict:
    return launch("checks/dtensor_placements.py", nproc=2, gpus=False, timeout=120)


@pytest.mark.slow
def test_every_placement_reassembles_the_matrix(placements2) -> None:
    full = np.array(placements2["full"])
    pieces = {layout["label"]: layout["locals"] for layout in placements2["layouts"]}
    assert np.array_equal(np.concatenate(pieces["Shard(0)"], axis=0), full)
    assert np.array_equal(np.concatenate(pieces["Shard(1)"], axis=1), full)
    assert all(np.array_equal(piece, full) for piece in pieces["Replicate()"])
    terms = pieces["Partial(): A @ B"]  # each rank's term differs; their sum is A @ B
    assert not np.array_equal(terms[0], terms[1])
    assert np.array_equal(np.sum(terms, axis=0), full @ np.ones((8, 4)))
    assert placements2["partial_sums_to_product"] is True
    assert (placements2["device"], placements2["backend"]) == ("cpu", "gloo")


@pytest.mark.slow
def test_each_change_of_placement_costs_its_collective(placements2) -> None:
    cost = {step["label"]: step["collectives"] for step in placements2["steps"]}
    matrix, product = 4 * 8 * 4, 4 * 4 * 4  # bytes of float32
    assert cost["Shard(0) -> Replicate()"] == {
        "all-gather": {"calls": 1, "input_bytes": matrix // 2, "output_bytes": matrix}
    }
    assert cost["Replicate() -> Shard(0)"] == {}  # each rank keeps its own chunk
    assert cost["Partial() -> Replicate()"] == {
        "all-reduce": {"calls": 1, "input_bytes": product, "output_bytes": product}
    }
    assert cost["Partial() -> Shard(0)"] == {  # each rank receives only its part
        "reduce-scatter": {
            "calls": 1,
            "input_bytes": product,
            "output_bytes": product // 2,
        }
    }
    after = {step["label"]: step["locals"] for step in placements2["steps"]}
    columns = [[4 + 8 * r + c for c in range(4)] for r in range(4)]  # rank 1's half
    assert after["Shard(0) -> Shard(1)"][1] == columns


@pytest.mark.slow
def test_four_processes_hold_a_row_each() -> None:
    out = launch("checks/dtensor_placements.py", nproc=4, gpus=False, timeout=120)
    rows = {layout["label"]: layout["locals"] for layout in out["layouts"]}["Shard(0)"]
    assert [np.array(piece).shape for piece in rows] == [(1, 8)] * 4
    cost = {step["label"]: step["collectives"] for step in out["steps"]}
    assert cost["Partial() -> Shard(0)"]["reduce-scatter"]["output_bytes"] == 16


# ---------------------------------------------------------------- data parallel


@pytest.fixture(scope="module")
def dp2() -> dict:
    args = ["--steps", "2", "--batch-size", "32"]
    return launch("checks/spmd_vs_ddp.py", args, nproc=2, gpus=False, timeout=200)


@pytest.mark.slow
def test_every_method_ends_where_ddp_ends_and_the_control_does_not(dp2) -> None:
    rows = dp2["rows"]
    assert len(rows) == 2 * 4 * 4  # 2 models x 4 optimisers x (3 methods + control)
    assert dp2["dtype"] == "float64" and dp2["tolerance"] <= 1e-10
    for r in rows:
        if r["method"] == "no sync (control)":
            assert r["max_abs_diff"] > CONTROL_MIN, r
        else:
            assert r["max_abs_diff"] <= dp2["tolerance"], r
    assert all(
        r["max_abs_diff"] == 0 for r in rows if r["method"] == "replicate (private)"
    )


@pytest.mark.slow
def test_the_script_trains_each_method_to_the_same_losses() -> None:
    """What a reader runs: one method per launch; every method, the same losses."""
    args = [
        "--steps",
        "3",
        "--batch-size",
        "32",
        "--dtype",
        "float64",
        "--batch-dim",
        "1",
    ]
    losses = [
        launch("spmd_data_parallel.py", [*args, "--method", m], nproc=2, gpus=False)[
            "losses"
        ]
        for m in ("ddp", "dtensor", "fully_shard")
    ]
    np.testing.assert_allclose(losses[1:], [losses[0]] * 2, rtol=1e-12)
    assert losses[0][-1] < losses[0][0]


# ---------------------------------------------------------------- ConvNeXt


@pytest.mark.slow
def test_halo_and_replicate_match_and_dtensors_own_padded_conv_does_not() -> None:
    out = launch(
        "checks/convnext_vs_unsharded.py",
        ["--conv-mode", "halo", "replicate", "naive", "--iters", "1"],
        nproc=4,
        gpus=False,
        timeout=200,
    )
    modes = {m["conv_mode"]: m for m in out["modes"]}
    for mode in ("halo", "replicate"):
        assert modes[mode]["ok"], modes[mode]
        assert max(modes[mode]["loss_diff"], modes[mode]["grad_rel_diff"]) <= 1e-10
        assert modes[mode]["probe_placements"] == ["Shard(dim=3)"]
    # Sharding the width 4 ways leaves each rank about a quarter of the activations.
    halo = modes["halo"]["ranks"][0]["saved_bytes"]
    assert 0.25 < halo / out["reference_saved_bytes"] < 0.3
    assert modes["replicate"]["ranks"][0]["saved_bytes"] > halo
    naive = modes["naive"]
    assert not naive["ok"] and "ranks" not in naive
    if naive["probe_placements"] == ["Shard(dim=3)"]:  # torch 2.10 to 2.12
        assert naive["probe_diff"] <= 1e-9  # its forward exchanges halos ...
        assert naive["grad_rel_diff"] > 1e-8  # ... its backward gets them wrong
    else:  # torch 2.13 on: labelled Replicate(), each rank holds a quarter
        assert naive["probe_placements"] == ["Replicate()"]
        assert naive["probe_local_shape"][3] * 4 == naive["probe_global_shape"][3]
        assert naive["probe_diff"] > 1e-3  # the silent error: a wrong mean
        assert "must match the size" in naive["model_error"]  # the loud one


@pytest.mark.slow
def test_batch_shards_need_no_halo() -> None:
    out = launch(
        "checks/convnext_vs_unsharded.py",
        ["--shard-dim", "0", "--conv-mode", "naive", "--iters", "1"],
        nproc=2,
        gpus=False,
        timeout=200,
    )
    (mode,) = out["modes"]
    assert out["shard_dim"] == 0 and mode["ok"] and "probe_diff" not in mode


# ---------------------------------------------------------------- GPU path, nodes


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, args",
    [
        ("dtensor_basics.py", []),
        (
            "spmd_data_parallel.py",
            ["--method", "dtensor", "--batch-dim", "1", "--optimizer", "adam"],
        ),
        ("convnext_sharded.py", ["--steps", "1"]),
    ],
)
def test_the_gpu_path_runs_on_a_simulated_gpu(script, args, tmp_path) -> None:
    """nccl and a GPU per process, as on a GPU node; the simulation raises what
    CUDA or nccl would (a CPU tensor in a collective, devices mixed)."""
    out = tmp_path / "results.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            SIMULATED_GPU,
            script_path(script),
            *args,
            "--results",
            out,
        ],
        check=True,
        timeout=220,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    results = json.loads(out.read_text())
    assert (results["device"], results["backend"]) == ("cuda", "nccl")


@pytest.mark.slow
def test_two_loopback_nodes_equal_one_node(placements2, dp2, tmp_path) -> None:
    assert two_agents("checks/dtensor_placements.py", [], tmp_path / "a") == placements2
    dp = two_agents(
        "checks/spmd_vs_ddp.py", ["--steps", "2", "--batch-size", "32"], tmp_path / "b"
    )
    assert dp["rows"] == dp2["rows"]  # every difference from DDP, bit for bit
