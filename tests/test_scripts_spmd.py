"""Launch chapter 11's DTensor scripts for real, with 2 and 4 gloo processes.

- dtensor_basics: every placement reassembles to the full matrix; each
  redistribution uses the collective it should;
- spmd_data_parallel: DTensor replication, replicate() and fully_shard end
  where DDP ends (float32, 1e-5) for every optimiser and both batch dims,
  while the no-sync control does not (so the comparison can fail);
- convnext_sharded: with width-sharded input, the halo exchange and the
  replicate-around-padded-convs remedy match the unsharded model, and the
  naive DTensor path is caught as wrong;
- bad input: one sentence on stderr and a non-zero exit.

Every launch is tiny; starting the processes is most of the cost.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from companion.launch import launch, script_path

pytestmark = pytest.mark.timeout(120)

DP_TOL = 1e-5  # float32 after a few steps; measured up to ~4e-7 with 4 processes
CONTROL_MIN = 1e-4  # training without gradient sync must move at least this far from DDP


def test_dtensor_basics_two_processes() -> None:
    out = launch("dtensor_basics.py", nproc=2, timeout=90)
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


def test_data_parallel_variants_match_ddp() -> None:
    out = launch("spmd_data_parallel.py", ["--steps", "2", "--batch-size", "32"], nproc=2, timeout=120)
    rows = out["rows"]
    assert {(r["model"], r["optimizer"]) for r in rows} >= {("batch dim 1", "Adam lr=0.1 fused")}
    for r in rows:
        if r["method"] == "no sync (control)":
            assert r["max_abs_diff"] > CONTROL_MIN, r
        else:
            assert r["max_abs_diff"] <= DP_TOL, r
    assert len(rows) == 2 * 4 * 4  # 2 models x 4 optimisers x 4 methods


def test_convnext_width_sharded_matches_unsharded_and_naive_is_caught() -> None:
    out = launch("convnext_sharded.py", ["--conv-mode", "halo", "replicate", "naive", "--iters", "1"],
                 nproc=4, timeout=120)  # fmt: skip
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
    assert "must match the size" in naive["model_error"]  # the loud one, at the residual add


def test_bad_input_is_one_sentence() -> None:
    proc = subprocess.run([sys.executable, str(script_path("convnext_sharded.py")), "--iters", "0"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "--iters" in proc.stderr
