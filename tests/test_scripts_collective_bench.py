"""companion/scripts/collective_bench.py and chapter 16's check, checks/cost_of_talking.py.

make test launches the benchmark once with 2 processes and tiny sizes
(chapter 16 runs the check on 4 processes in every nbval run); make test-slow
adds the check on 2 processes, 4 processes with subgroups, the compiled
variants of the check, plain python and the simulated GPU path.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
from launchers import SIMULATED_GPU

from companion import launch, script_path
from companion.comm_costs import KINDS, assign_buckets, bus_factor, ddp_bucket_caps

TINY = ["--max-bytes", "4096", "--step", "8", "--blocks", "2", "--block-time", "0.001"]


def check_rows(results: dict, groups: list[int]) -> None:
    rows = results["measurements"]
    expected = {(k, n) for n in groups for k in KINDS if k != "send_recv" or n == 2}
    assert {(r["kind"], r["processes"]) for r in rows} == expected
    assert {r["bytes"] for r in rows} == {64, 512, 4096}
    for r in rows:
        assert r["seconds"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["seconds"])
        assert r["busbw"] == pytest.approx(
            r["algbw"] * bus_factor(r["kind"], r["processes"])
        )


@pytest.mark.timeout(240)
def test_every_collective_is_timed_on_two_processes() -> None:
    results = launch("collective_bench.py", [*TINY, "--quiet"], nproc=2, timeout=200)
    assert (results["device"], results["backend"], results["world_size"]) == (
        "cpu",
        "gloo",
        2,
    )
    check_rows(results, [2])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_groups_of_two_and_four_on_four_processes(capfd) -> None:
    results = launch(
        "collective_bench.py", [*TINY, "--groups", "2", "4"], nproc=4, timeout=280
    )
    check_rows(results, [2, 4])
    out = capfd.readouterr().out
    assert "all_to_all, 4 processes" in out and "busbw (GB/s)" in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_process_says_there_is_nothing_to_time(tmp_path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, script_path("collective_bench.py"), "--results", out],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0 and "no collective to time" in done.stdout
    assert json.loads(out.read_text())["measurements"] == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_group_larger_than_the_processes_is_one_sentence() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            script_path("collective_bench.py"),
            "--groups",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode != 0
    assert "group sizes must lie between 2 and the 2 processes" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gpu_path_runs_on_simulated_gpus(tmp_path) -> None:
    """nccl and cuda:N, as on a GPU machine; the simulation raises what CUDA would."""
    out = tmp_path / "results.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            SIMULATED_GPU,
            script_path("collective_bench.py"),
            *TINY,
            "--quiet",
            "--results",
            out,
        ],
        check=True,
        timeout=280,
        env={**os.environ, "SIMULATED_GPUS": "2"},
    )
    results = json.loads(out.read_text())
    assert (results["device"], results["backend"]) == ("cuda", "nccl")
    check_rows(results, [2])


ROUNDS = 3
CHECK = [
    "--n-layer",
    "1",
    "--n-embd",
    "64",
    "--seq-len",
    "16",
    "--caps",
    "0.01",
    "1",
    "--rounds",
    str(ROUNDS),
    "--traces",
    "3",
    "--max-bytes",
    "4096",
]


def check_ddp_results(results: dict) -> None:
    assert results["world_size"] == 2
    plain = results["plain"]
    order = plain["ready_order"]
    sizes = [plain["bytes"][i] for i in order]
    assert sorted(order) == list(range(len(plain["bytes"])))
    for name, cap in results["caps"].items():
        ours = [
            [order[i] for i in b] for b in assign_buckets(sizes, ddp_bucket_caps(cap))
        ]
        assert ours == results["buckets"][name], name
    assert set(results["step"]) == {
        "no communication",
        "backward beside an all-reduce",
        "all-reduce alone",
        "0.01 MiB",
        "1 MiB",
        "default",
    }
    assert {r["bytes"] for r in results["all_reduce"]} == {
        4096 * 4**k for k in range(7)
    }
    assert all(r["seconds"] > 0 for r in results["all_reduce"])  # timed with the steps
    load = results["other_load"]  # recorded, in cores (tests/test_timing.py tests it)
    assert load["available"] >= 1 and 0 <= load["cores"] <= load["available"] + 0.1
    for v in results["step"].values():  # each round's time, the slowest rank's
        assert len(v["rounds"]) == ROUNDS
        assert v["median"] == pytest.approx(statistics.median(v["rounds"]))
        assert v["median"] > 0 and v["iqr"] >= 0
    trace = results["trace"]
    default = assign_buckets(sizes, ddp_bucket_caps(None))
    assert trace["collectives"] == len(default)
    assert 0 <= trace["exposed"] <= trace["communication"]
    assert len(trace["exposed_per_rank"]) == 2
    assert (
        len(trace["exposed_steps"]) == 3 and trace["exposed"] in trace["exposed_steps"]
    )
    assert trace["exposed"] == sorted(trace["exposed_steps"])[1]  # the median step
    assert len(trace["communication_steps"]) == 3
    assert trace["communication"] in trace["communication_steps"]


@pytest.mark.slow  # chapter 16 runs this check on 4 processes in every nbval run
@pytest.mark.timeout(300)
def test_the_check_times_the_collectives_and_the_buckets_ddp_builds() -> None:
    results = launch("checks/cost_of_talking.py", CHECK, nproc=2, timeout=280)
    assert (results["world_size"], results["backend"]) == (2, "gloo")
    check_rows({"measurements": results["measurements"]}, [2])
    check_ddp_results(results["ddp"])
    assert "compiled" not in results["ddp"]
    assert set(results["other_load"]) == {"cores", "available"}  # over the sweep


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_four_processes_ddp_runs_on_two_and_compiled_trains_as_eager() -> None:
    args = [*CHECK, "--compile", "--groups", "2", "4"]
    results = launch("checks/cost_of_talking.py", args, nproc=4, timeout=580)
    check_rows({"measurements": results["measurements"]}, [2, 4])
    check_ddp_results(results["ddp"])
    comp = results["ddp"]["compiled"]
    for variant in ("ddp_optimizer", "compiled_autograd"):
        assert comp[f"{variant}_losses"] == pytest.approx(
            comp["eager_losses"], abs=1e-5
        )
    backward = max(comp["compiled_autograd_graphs"], key=lambda g: g["all_reduces"])
    assert backward["all_reduces"] == len(comp["bytes"])
    assert comp["exposed"]["compiled_autograd"]["collectives"] == len(comp["bytes"])
    for trace in comp["exposed"].values():  # --traces steps of each, as the default's
        assert len(trace["exposed_steps"]) == len(trace["communication_steps"]) == 3
