"""Cause every failure of companion/scripts/failures.py for real, and check the diagnosis.

Each test starts 2 processes on gloo (``run_ranks``, as srun would, or
``torchrun``), with time-outs of seconds, and asserts that the tool names the
right rank and the right collective or cause:

- mismatched collectives: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (shape, order,
  a rank-0-only collective, a missing rank) and the Flight Recorder's dumps,
  on by default from torch 2.11 (the script sets 2,000 under 2.10, whose
  default is 0) and off with ``TORCH_FR_BUFFER_SIZE=0``;
- a skipped collective: ``monitored_barrier`` names the rank with more data;
  the three fixes (sampler, join, equal steps) finish, and with ``join()``
  the replicas part in the next epoch (momentum);
- a stuck, missing, dead or out-of-memory rank: torchrun's summary (root
  cause, ``@record``'s error file, a signal), restarts (with and without a
  separate rendezvous store), every rank's stack from ``faulthandler`` (on a
  stall, on ``SIGUSR1`` by process, not by name) and from the worker server,
  a rendezvous that never completes, an allocator that refuses;
- silent drift and data bugs: the cross-rank checks name the parameter or
  the data bug, and a short last batch is no false alarm;
- numbers: ``--watch`` stops a NaN before the all-reduce spreads it (without
  it, it spreads) and names the straggler;
- a smaller world: 2 processes lose one, 1 resumes from the DCP checkpoint
  and ends on the uninterrupted run's samples and losses (float64, 1e-12);
- canaries for what the chapter says torch does: DDP under DETAIL on gloo
  still crashes, fr_trace still fails on gloo's dumps;
- the lines chapter 15's exercises quote are what the script prints;
- the same diagnoses under the oldest torch the course supports, where that
  environment exists (``make test-slow`` and ``make test-oldest`` build
  .venv-oldest; another interpreter: ``COURSE_OLDEST_PYTHON``), launched from
  this one.

Two launches run in ``make test`` (a few seconds each); the rest are marked
slow. No test waits for a default time-out: every hang ends within seconds.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launchers import clean_environment, free_port
from test_diagnosis import exercise_blocks  # the exercises' quoted lines

from companion.diagnosis import (
    compare_flight_records,
    excerpt,
    find_barrier_report,
    find_drift,
    find_gloo_errors,
    find_mismatch,
    find_root_cause,
    find_stacks,
    find_watch,
    flight_records_from_json,
    read_flight_records,
    run_ranks,
    run_torchrun,
    sanitize,
    stacks_on_demand,
    where_stuck,
)
from companion.scripts import failures

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "companion" / "scripts" / "failures.py"
OLD_PYTHON = os.environ.get(
    "COURSE_OLDEST_PYTHON", str(ROOT / ".venv-oldest" / "bin" / "python")
)
# The oldest environment's stamp: it is complete (an install that broke
# off leaves a python without torch).
OLD_READY = (
    "COURSE_OLDEST_PYTHON" in os.environ
    or (ROOT / ".venv-oldest" / ".installed").is_file()
)
PYTHONS = [
    pytest.param(sys.executable, id="this-torch"),
    pytest.param(
        OLD_PYTHON,
        id="oldest-torch",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(not OLD_READY, reason="no oldest-torch environment"),
        ],
    ),
]
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}

pytestmark = pytest.mark.timeout(240)


def normalized(text: str) -> str:
    return " ".join(text.split())


def results(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / name).read_text())


# ---- mismatched collectives


@pytest.mark.slow  # chapter 15 launches the same run in `make test`
@pytest.mark.parametrize("python", PYTHONS)
def test_detail_names_the_shapes_of_an_all_gather(python):
    run = run_ranks(
        SCRIPT,
        ["--fail", "shape", "--shard", "--timeout", "30"],
        env=DETAIL,
        python=python,
    )
    assert run.returncodes == [1, 1] and not run.timed_out
    for output in run.outputs:  # every rank raises, and says the same
        mismatch = find_mismatch(output)
        assert [(c.rank, c.op, c.shape) for c in mismatch.collectives] == [
            (0, "all_gather", (50,)),
            (1, "all_gather", (51,)),
        ]
        assert mismatch.differs_in == ["shape"]
    assert "Timed out" not in run.text  # caught before it could hang


@pytest.mark.slow
def test_detail_names_an_order_mismatch():
    run = run_ranks(
        SCRIPT, ["--fail", "order", "--shard", "--timeout", "30"], env=DETAIL
    )
    mismatch = find_mismatch(run.text)
    assert [(c.rank, c.op) for c in mismatch.collectives] == [
        (0, "broadcast"),
        (1, "all_reduce"),
    ]
    assert "op" in mismatch.differs_in


@pytest.mark.slow
def test_detail_on_a_rank0_only_collective_is_exercise_1():
    run = run_ranks(
        SCRIPT, ["--fail", "rank0-only", "--shard", "--timeout", "30"], env=DETAIL
    )
    mismatch = find_mismatch(run.text)
    assert [(c.rank, c.op, c.shape) for c in mismatch.collectives] == [
        (0, "all_reduce", (2,)),
        (1, "all_gather_into_tensor", (144,)),
    ]
    (block,) = exercise_blocks()["ch15_ex1"]
    assert normalized(excerpt(run.outputs[0], "Detected mismatch")) == normalized(block)


@pytest.mark.slow
@pytest.mark.parametrize("python", PYTHONS)
def test_order_times_out_and_the_flight_recorder_names_the_collectives(
    python, tmp_path
):
    folder = tmp_path / "fr"
    args = ["--fail", "order", "--timeout", "2", "--flight-recorder", folder]
    run = run_ranks(SCRIPT, args, python=python)  # the Flight Recorder's default
    assert run.returncodes == [1, 1] and not run.timed_out and run.seconds < 60
    errors = find_gloo_errors(run.outputs)  # who gives up first is a race
    assert "timed out after 2000 ms" in errors.values()
    assert set(errors.values()) <= {
        "timed out after 2000 ms",
        "lost the connection to a peer",
    }
    parted = compare_flight_records(read_flight_records(folder))
    assert [(c.rank, c.op, c.shape, c.where) for c in parted.collectives] == [
        (0, "broadcast", (1,), "end_epoch"),
        (1, "all_reduce", (2,), "end_epoch"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("python", PYTHONS)
def test_torchs_analyser_fails_on_gloo_dumps_as_the_chapter_says(python, tmp_path):
    """Chapter 15 says fr_trace stops with a KeyError on gloo's dumps: if a
    release fixes that, this test fails, and the text should change."""
    folder = tmp_path / "fr"
    args = ["--fail", "order", "--timeout", "2", "--flight-recorder", folder]
    run_ranks(SCRIPT, args, python=python)
    assert read_flight_records(folder)[0]  # a dump with entries, on either torch
    analyse = subprocess.run(
        [python, "-m", "torch.distributed.flight_recorder.fr_trace", folder],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert analyse.returncode != 0 and "KeyError" in analyse.stderr


@pytest.mark.slow
def test_the_flight_recorder_is_on_by_default_and_off_with_zero(tmp_path, monkeypatch):
    """Chapter 15: since torch 2.11 no variable switches it on (2,000 entries by
    default, pytorch/pytorch#172843); this torch's own default, as failures.py
    sets TORCH_FR_BUFFER_SIZE only under an older torch."""
    assert torch.__version__ >= (2, 11), "this test is about torch's own default"
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)  # the default, whatever CI sets
    args = ["--fail", "order", "--timeout", "2", "--flight-recorder"]
    run_ranks(SCRIPT, [*args, tmp_path / "default"])
    run_ranks(SCRIPT, [*args, tmp_path / "off"], env={"TORCH_FR_BUFFER_SIZE": "0"})
    on, off = (read_flight_records(tmp_path / n) for n in ("default", "off"))
    assert all(len(entries) > 10 for entries in on.values()) and len(on) == 2
    assert off == {0: [], 1: []}


FR_ENTRIES = """
import pickle, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
print(torch.__version__, len(dump.get("entries", [])))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("python", PYTHONS)
def test_the_flight_recorder_records_by_default_only_from_torch_2_11(python):
    """Chapter 15: torch 2.10's Flight Recorder defaults to 0 entries (off), which
    is why failures.py sets TORCH_FR_BUFFER_SIZE=2000 under it; 2.11 and later
    record by default. If the oldest torch moves to 2.11, the setdefault and its
    sentences can go."""
    env = clean_environment()
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        env.pop(name, None)
    counts = {}
    for size in (None, "2000"):
        extra = {} if size is None else {"TORCH_FR_BUFFER_SIZE": size}
        out = subprocess.run(
            [python, "-c", FR_ENTRIES],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.split()
        version, counts[size] = torch.torch_version.TorchVersion(out[-2]), int(out[-1])
    assert counts["2000"] == 1  # one all_reduce, recorded when a size is given
    assert counts[None] == (1 if version >= (2, 11) else 0)


@pytest.mark.slow
def test_detail_names_a_missing_rank_with_its_barrier():
    """DETAIL's wrapper runs a monitored barrier before each collective: a rank
    stuck outside any collective is named after the group's time-out."""
    run = run_ranks(
        SCRIPT, ["--fail", "stuck", "--shard", "--timeout", "3"], env=DETAIL
    )
    assert run.returncodes[0] == 1
    assert find_barrier_report(run.outputs[0]).missing == (1,)


@pytest.mark.slow
@pytest.mark.parametrize("python", PYTHONS)
def test_ddp_under_detail_on_gloo_still_crashes(python, tmp_path):
    """Chapter 15 says DDP's constructor segfaults on gloo under DETAIL (2.10,
    2.14.1), which is why the script refuses it: if a release fixes that, this
    test fails, and the text and the refusal should change."""
    script = tmp_path / "ddp_detail.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('gloo')\n"
        "DDP(torch.nn.Linear(2, 2))\n"
        "dist.destroy_process_group()\n"
    )
    crashed = run_ranks(script, env=DETAIL, python=python)
    assert crashed.returncodes == [-signal.SIGSEGV] * 2
    assert run_ranks(script, python=python).returncodes == [0, 0]


@pytest.mark.slow
def test_rank0_only_flight_records_are_exercise_2(tmp_path):
    folder = tmp_path / "fr"
    args = ["--fail", "rank0-only", "--timeout", "2", "--flight-recorder", folder]
    run_ranks(SCRIPT, args)
    records = read_flight_records(folder)
    shown = {
        rank: ", ".join(
            f"#{c.sequence} {c.op} {list(c.shape)} in {c.where}" for c in entries[-3:]
        )
        for rank, entries in records.items()
    }
    (block,) = exercise_blocks()["ch15_ex2"]
    expected = normalized(block)
    for rank, line in shown.items():
        assert normalized(f"rank {rank}: ... {line}") in expected
    parted = compare_flight_records(records)
    assert [c.where for c in parted.collectives] == ["end_epoch", "validate"]


# ---- a rank that skips a collective


@pytest.mark.slow  # chapter 15 launches the same run in `make test`
@pytest.mark.parametrize("python", PYTHONS)
def test_monitored_barrier_names_the_rank_with_more_data(python):
    args = ["--fail", "uneven", "--timeout", "5", "--barrier-timeout", "1"]
    run = run_ranks(SCRIPT, args, python=python)
    assert run.returncodes == [1, 1] and not run.timed_out
    assert find_barrier_report(run.outputs[0]).missing == (1,)


@pytest.mark.slow
def test_uneven_data_without_tools_is_exercise_3():
    run = run_ranks(SCRIPT, ["--fail", "uneven", "--timeout", "5"])
    errors = find_gloo_errors(run.outputs)
    assert errors == {
        0: "received data of the wrong size",
        1: "lost the connection to a peer",
    }
    assert where_stuck(find_stacks(run.outputs)[0]) == "end_epoch (in wrapper)"
    rank0, rank1 = exercise_blocks()["ch15_ex3"]
    seen0 = normalized(sanitize(run.outputs[0]))
    assert normalized("op.preamble.length <= op.nbytes. 840 vs 8.") in seen0
    assert "loss.backward()  # DDP all-reduces the gradients here" in run.outputs[1]
    assert "in end_epoch" in rank0 and "in train" in rank1


@pytest.mark.slow
@pytest.mark.parametrize(
    "fix, steps",
    [("sampler", [24, 24]), ("steps", [21, 21]), ("join", [21, 24])],
    ids=["sampler", "steps", "join"],
)
@pytest.mark.parametrize("python", PYTHONS)
def test_each_fix_of_uneven_data_finishes(python, fix, steps, tmp_path):
    out = tmp_path / "results.json"
    args = ["--fail", "uneven", "--fix", fix, "--timeout", "20", "--results", out]
    run = run_ranks(SCRIPT, args, python=python)
    assert run.returncodes == [0, 0], run.text[-2000:]
    assert json.loads(out.read_text())["steps_by_rank"] == steps


@pytest.mark.slow
def test_join_keeps_the_parameters_equal_but_not_the_momentum():
    """join() broadcasts the last joiner's parameters, not the optimizer's
    state: the next epoch's steps move the replicas apart, which the replica
    check (run while every rank is still in join()) names."""
    args = ["--fail", "uneven", "--fix", "join", "--check-every", "4"]
    run = run_ranks(SCRIPT, [*args, "--timeout", "10"])
    assert run.returncodes == [1, 1] and not run.timed_out
    steps = [find_drift(output).step for output in run.outputs]
    # equal after join() (checked at steps 7 and 8), apart 4 steps later
    assert steps == [11, 12]  # 4 steps into epoch 2: rank 0 took 7 in epoch 1
    assert all(find_drift(o).kind == "replicas" for o in run.outputs)
    stateless = run_ranks(
        SCRIPT, [*args, "--timeout", "10", "--momentum", "0"], timeout=180
    )
    assert stateless.returncodes == [0, 0]  # no optimizer state: no drift


@pytest.mark.slow
def test_join_with_the_optimizers_state_broadcast_keeps_the_replicas_equal():
    """--fix join-state: join() and then the optimizer's state from the rank
    join() took the parameters from; with momentum 0.9 the replica check, at
    the same steps as above, never fires and the run ends."""
    args = ["--fail", "uneven", "--fix", "join-state", "--check-every", "4"]
    run = run_ranks(SCRIPT, [*args, "--timeout", "10"], timeout=180)
    assert run.returncodes == [0, 0] and find_drift(run.text) is None
    assert "epoch 3/3" in run.outputs[0]


# ---- a dead or stuck rank


@pytest.mark.slow
@pytest.mark.parametrize("python", PYTHONS)
def test_a_crash_is_restarted_then_summarised_with_its_exception(python):
    run = run_torchrun(SCRIPT, ["--fail", "crash"], max_restarts=1, python=python)
    assert run.returncodes == [1] and not run.timed_out
    root = find_root_cause(run.text)
    assert root.rank == 1 and root.has_error_file and root.exitcode == 1
    assert root.error == "ValueError: sample 232 is corrupt"
    assert "after restart 1" in run.text and "attempt_1" in run.text


@pytest.mark.slow
@pytest.mark.parametrize("python", PYTHONS)
def test_a_stuck_rank_shows_in_every_ranks_stack(python):
    args = ["--fail", "stuck", "--timeout", "4", "--stall-dump", "1.5"]
    run = run_torchrun(SCRIPT, args, python=python)
    assert run.returncodes == [1] and not run.timed_out
    root = find_root_cause(run.text)
    assert root.rank == 0 and "Timed out" in root.error  # the victim fails first
    assert root.others == {1: -15}  # the culprit is stopped by torchrun
    stacks = find_stacks(run.text)
    assert where_stuck(stacks[1]) == "load_batch"
    assert where_stuck(stacks[0]) == "train (in backward)"


@pytest.mark.slow
def test_sigusr1_prints_every_ranks_stack(tmp_path):
    """kill -USR1 on each process, as the chapter tells a reader to do."""
    env = clean_environment(
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONUNBUFFERED="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    logs = [tmp_path / f"rank{r}.txt" for r in range(2)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, SCRIPT, "--fail", "stuck", "--timeout", "60"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                )
            )
    try:
        deadline = time.monotonic() + 120
        while "epoch 1/3" not in logs[0].read_text():  # step 8; stuck at step 10
            assert time.monotonic() < deadline and procs[0].poll() is None
            time.sleep(0.2)
        time.sleep(1.0)
        for proc in procs:
            proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        stacks = find_stacks([log.read_text() for log in logs])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert where_stuck(stacks[1]) == "load_batch"
    assert where_stuck(stacks[0]) == "train (in backward)"


@pytest.mark.slow
def test_sigusr1_by_name_kills_torchrun_and_by_parent_reaches_the_workers(tmp_path):
    """Chapter 15: signal torchrun's workers by their parent, not by name
    (pkill -f), which also hits the agent, whose default action is to die and
    leave its workers running."""
    env = clean_environment(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    log = tmp_path / "out.txt"

    def start() -> subprocess.Popen:
        log.write_text("")
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            + ["--nproc-per-node=2", "--tee=3", str(SCRIPT), "--fail", "stuck"]
            + ["--timeout", "60"],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def workers(agent: subprocess.Popen) -> list[int]:
        deadline = time.monotonic() + 120
        while "epoch 1/3" not in log.read_text():  # stuck at step 10, soon after
            assert time.monotonic() < deadline and agent.poll() is None
            time.sleep(0.2)
        time.sleep(1.0)
        found = subprocess.run(
            ["pgrep", "-P", str(agent.pid)], capture_output=True, text=True, check=True
        )
        return [int(pid) for pid in found.stdout.split()]

    agent = start()
    try:
        pids = workers(agent)
        subprocess.run(["pkill", "-USR1", "-P", str(agent.pid)], check=True)
        time.sleep(1.5)
        stacks = find_stacks(log.read_text())
        assert agent.poll() is None  # the agent lives on
        assert where_stuck(stacks[1]) == "load_batch" and 0 in stacks
        for pid in [agent.pid, *pids]:  # what pkill -f reaches: all of them
            os.kill(pid, signal.SIGUSR1)
        agent.wait(timeout=30)
        assert agent.returncode == -signal.SIGUSR1  # status 138 in a shell
        time.sleep(1.0)
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    finally:
        for pid in [agent.pid, *pids]:  # the workers have sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert alive == pids  # workers left behind, as orphans


@pytest.mark.slow
def test_a_worker_server_answers_while_a_rank_hangs(tmp_path):
    sockets = tmp_path / "sockets"
    run = run_torchrun(
        SCRIPT,
        ["--fail", "stuck", "--timeout", "6", "--debug-socket", sockets],
        probe=lambda: stacks_on_demand(
            sockets, {0: "backward", 1: "load_batch"}, timeout=120
        ),
        timeout=180,  # a busy machine starts torchrun's workers slowly
    )
    asked = run.probed
    stacks = find_stacks([asked["stacks"][r] for r in range(2)])
    assert where_stuck(stacks[0]) == "train (in backward)"
    assert where_stuck(stacks[1]) == "load_batch"
    records = flight_records_from_json(asked["flight_records"])
    assert records[0][-1].op == "all_reduce"
    assert compare_flight_records(records).missing == (1,)


@pytest.mark.slow
def test_a_rank_that_never_comes_stops_rank_0_in_its_set_up():
    run = run_ranks(SCRIPT, ["--timeout", "2"], nproc=2, ranks=[0])
    assert run.returncodes == [2] and not run.timed_out
    assert "1/2 clients joined" in run.outputs[0]


@pytest.mark.slow
def test_one_rank_out_of_memory_and_its_peer_loses_it():
    run = run_ranks(SCRIPT, ["--fail", "oom", "--timeout", "10"])
    # rank 0 raised too (below), but on a busy machine may still be exiting
    # when run_ranks' grace after rank 1's failure ends
    assert run.returncodes[1] == 1 and run.returncodes[0] in (1, None)
    assert find_gloo_errors(run.outputs) == {
        0: "lost the connection to a peer",
        1: "ran out of memory",
    }


@pytest.mark.slow
def test_restarts_without_a_separate_store_can_fail():
    """Chapter 15 says to set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (since 2.5) for
    runs that restart (run_torchrun sets it). Without it, the restart fails
    now and then (a Gloo connectFullMesh error, or a hang): this canary tries
    up to 6 times, and any other failure fails it. It is a chance event (all
    6 worked in one run of 2026-11-28), so 6 clean restarts skip the test with
    a note rather than fail CI; if the note shows run after run, torch has
    fixed it, and the text should change. With the variable the restart works
    every time (test_a_crash_is_restarted_then_summarised...)."""
    for _ in range(6):
        run = run_torchrun(
            SCRIPT,
            ["--fail", "crash"],
            max_restarts=1,
            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"},
            timeout=45,
        )
        root = find_root_cause(run.text)
        restarted = (
            "after restart 1" in run.text and root and "ValueError" in root.error
        )
        if "connectFullMesh" in run.text:  # the failure the chapter names
            return
        assert restarted or run.timed_out, run.text[-3000:]  # no other failure
        if run.timed_out and "after restart 1" in run.text:  # a hang after restart
            return
    pytest.skip(
        "six restarts without a separate store all worked: a chance, or torch "
        "fixed the shared store (then chapter 15's advice needs a second look)"
    )


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_ends_where_an_unbroken_run_does(tmp_path):
    args = ["--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", "4"]
    broken = run_torchrun(
        SCRIPT,
        ["--fail", "kill", *args, "--results", tmp_path / "broken.json"],
        max_restarts=1,
    )
    assert broken.returncodes == [0], broken.text[-3000:]
    assert "resumed at step 8 after restart 1" in broken.text
    unbroken = run_ranks(SCRIPT, ["--results", tmp_path / "unbroken.json"])
    assert unbroken.returncodes == [0, 0]
    a, b = results(tmp_path, "broken.json"), results(tmp_path, "unbroken.json")
    assert a["start_step"] == 8 and len(a["losses"]) == len(b["losses"]) == 24
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 1e-12


# ---- silent drift


@pytest.mark.slow
@pytest.mark.parametrize(
    "fail, kind, step, detail",
    [
        ("unseen-param", "replicas", 4, "head.weight"),
        ("sampler-seed", "shards", None, "72 twice, 72 never"),
        ("no-set-epoch", "order", None, "set_epoch"),
    ],
)
def test_the_checks_name_each_drift(fail, kind, step, detail):
    run = run_ranks(SCRIPT, ["--fail", fail, "--check-every", "4"])
    assert run.returncodes == [1, 1]
    for output in run.outputs:  # every rank stops, with the same diagnosis
        drift = find_drift(output)
        assert (drift.kind, drift.step, drift.detail) == (kind, step, detail)
        if kind == "replicas":  # a softmax head: its sum stays, its norm moves
            assert drift.sum_gap < 1e-12 and drift.norm_gap > 1e-3


@pytest.mark.slow
def test_a_short_last_batch_is_not_a_missing_sample():
    """250 samples in batches of 32 leave 26 out of every epoch: the batching's
    choice, not two samplers that disagree."""
    run = run_ranks(SCRIPT, ["--samples", "250", "--check-every", "4"], nproc=1)
    assert run.returncodes == [0], run.text[-2000:]


# ---- numbers that go wrong


@pytest.fixture
def alone():
    """A process group of this one process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_watch_stops_spikes_and_nans_and_times_the_ranks(alone):
    model = torch.nn.Linear(2, 2)
    history = [0.3] * 8
    start = time.perf_counter()
    seconds = failures.watch(torch.tensor(2.9), start, 5, history, model)
    assert len(seconds) == 1 and 0 <= seconds[0] < 5
    assert history[-1] == pytest.approx(2.9)
    for loss in (3.1 * 10, math.nan, math.inf):  # above 10 x the recent median
        with pytest.raises(RuntimeError, match="step 6: the loss is") as raised:
            failures.watch(torch.tensor(loss), start, 6, list(history), model)
        stopped = find_watch(str(raised.value))
        assert stopped.step == 6 and list(stopped.losses) == [0]
        assert stopped.weights_finite
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    with pytest.raises(RuntimeError, match="not all finite"):
        failures.watch(torch.tensor(math.nan), start, 7, [], model)


@pytest.mark.slow
def test_the_watch_stops_a_nan_before_the_all_reduce_spreads_it(tmp_path):
    run = run_ranks(SCRIPT, ["--fail", "nan", "--watch"])
    assert run.returncodes == [1, 1]
    for output in run.outputs:
        stopped = find_watch(output)
        assert (stopped.step, list(stopped.losses)) == (10, [1])
        assert stopped.weights_finite
    out = tmp_path / "results.json"
    silent = run_ranks(SCRIPT, ["--fail", "nan", "--results", out])
    assert silent.returncodes == [0, 0]  # without the watch: no error at all,
    losses = json.loads(out.read_text())["losses"]
    assert not any(math.isnan(x) for x in losses[:10])
    assert all(math.isnan(x) for x in losses[10:])  # and NaN from step 10 on


@pytest.mark.slow
def test_the_watch_names_the_straggler(tmp_path):
    out = tmp_path / "results.json"
    run = run_ranks(SCRIPT, ["--fail", "slow", "--watch", "--results", out])
    assert run.returncodes == [0, 0]
    busy = json.loads(out.read_text())["seconds_before_all_reduce"]
    assert busy[1] == max(busy) and busy[1] - busy[0] > 0.025
    assert "slowest: rank 1" in run.outputs[0]


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(torch._C._distributed_c10d, "NanCheckHook"),
    reason="this torch has no TORCH_DIST_NAN_CHECK",
)
def test_torchs_nan_check_stops_the_nan_at_the_all_reduce():
    """Chapter 15: TORCH_DIST_NAN_CHECK=1 (torch 2.14, backends other than
    nccl) checks every collective's input: the NaN stops on rank 1, in the
    gradients' all-reduce of step 10, with no change to the script."""
    run = run_ranks(
        SCRIPT, ["--fail", "nan", "--timeout", "10"], env={"TORCH_DIST_NAN_CHECK": "1"}
    )
    assert run.returncodes[1] == 1 and not run.timed_out
    assert "NaN found in input tensor" in run.outputs[1]  # the words chapter 15 quotes
    assert "loss.backward()" in run.outputs[1]
    assert "epoch 2/3" not in run.outputs[0]  # stopped in the second epoch


@pytest.mark.slow
@pytest.mark.parametrize("fail", ["unseen-param", "sampler-seed", "no-set-epoch"])
def test_without_checks_the_drift_is_silent(fail, tmp_path):
    out = tmp_path / "results.json"
    run = run_ranks(SCRIPT, ["--fail", fail, "--results", out])
    assert run.returncodes == [0, 0]  # trains to the end, no error
    assert json.loads(out.read_text())["steps_by_rank"] == [24, 24]


# ---- a smaller world


@pytest.mark.slow
@pytest.mark.parametrize("python", PYTHONS)
def test_resuming_on_fewer_processes_follows_the_unbroken_run(python, tmp_path):
    ck = tmp_path / "ck"
    lost = run_ranks(
        SCRIPT,
        [
            "--fail",
            "kill",
            "--shard",
            "--checkpoint-dir",
            ck,
            "--checkpoint-every",
            "4",
        ],
        python=python,
    )
    assert lost.returncodes[1] == -signal.SIGKILL
    assert sorted(p.name for p in ck.iterdir()) == ["step-000004", "step-000008"]
    for name, args in (
        ("resumed.json", ["--shard", "--checkpoint-dir", ck]),
        ("straight.json", []),
    ):
        run = run_ranks(
            SCRIPT, [*args, "--results", tmp_path / name], nproc=1, python=python
        )
        assert run.returncodes == [0], run.text[-2000:]
    resumed, straight = (
        results(tmp_path, "resumed.json"),
        results(tmp_path, "straight.json"),
    )
    assert resumed["start_step"] == 8 and resumed["world_size"] == 1
    assert resumed["samples"] == straight["samples"][8:]  # the same data, in order
    assert len(straight["samples"]) == 24 and all(
        len(batch) == 32 for batch in straight["samples"]
    )
    assert (
        max(abs(x - y) for x, y in zip(resumed["losses"], straight["losses"])) < 1e-12
    )


# ---- bad input


@pytest.mark.slow
def test_ddp_under_detail_on_gloo_is_refused_in_one_sentence():
    run = run_ranks(SCRIPT, ["--timeout", "30"], env=DETAIL)
    # rank 0 says it and exits 2; rank 1 waits silently for the launcher to stop it
    assert run.returncodes[0] == 2 and run.returncodes[1] in (None, 2)
    assert (
        run.outputs[0]
        .strip()
        .endswith(
            "failures.py: error: DDP crashes on gloo under "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL; add --shard"
        )
    )
    assert "Traceback" not in run.outputs[1]


@pytest.mark.slow
def test_bad_arguments_are_one_sentence():
    """--fix join with a collective of the script's own inside join(): refused."""
    for args in (
        ["--shard"],
        ["--checkpoint-dir", "x", "--checkpoint-every", "4"],
        ["--watch"],
    ):
        ran = subprocess.run(
            [sys.executable, SCRIPT, "--fix", "join", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        last = ran.stderr.strip().splitlines()[-1]
        assert ran.returncode == 2 and last.endswith(
            "--fix join works with DDP and without --checkpoint-every or --watch "
            "(a rank that has left join() would never join the save or the gather)"
        )
