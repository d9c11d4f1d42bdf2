"""Cause every failure of companion/scripts/failures.py for real, and check the diagnosis.

Each test starts 2 processes on gloo (``run_ranks``, as srun would, or
``torchrun``), with time-outs of seconds, and asserts that the tool names the
right rank and the right collective or cause:

- mismatched collectives: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (shape, order,
  a rank-0-only collective) and the Flight Recorder's dumps;
- a skipped collective: ``monitored_barrier`` names the rank with more data;
  the three fixes (sampler, join, equal steps) finish;
- a dead or stuck rank: torchrun's summary (root cause, ``@record``'s error
  file, a signal), restarts, every rank's stack from ``faulthandler`` (on a
  stall and on ``SIGUSR1``);
- silent drift: the cross-rank checks name the parameter or the data bug;
- a smaller world: 2 processes lose one, 1 resumes from the DCP checkpoint
  and ends on the uninterrupted run's losses (float64, 1e-12);
- the lines chapter 15's exercises quote are what the script prints;
- the same diagnoses under the oldest torch the course supports, where that
  environment exists (``make test-oldest`` builds .venv-oldest; another
  interpreter: ``COURSE_OLDEST_PYTHON``), launched from this one.

Two launches run in ``make test`` (a few seconds each); the rest are marked
slow. No test waits for a default time-out: every hang ends within seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launchers import clean_environment, free_port
from test_failures import exercise_blocks  # the exercises' quoted lines

from companion.failures import (
    compare_flight_records,
    excerpt,
    find_barrier_report,
    find_drift,
    find_gloo_errors,
    find_mismatch,
    find_root_cause,
    find_stacks,
    read_flight_records,
    run_ranks,
    run_torchrun,
    sanitize,
    where_stuck,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "companion" / "scripts" / "failures.py"
OLD_PYTHON = os.environ.get(
    "COURSE_OLDEST_PYTHON", str(ROOT / ".venv-oldest" / "bin" / "python")
)
# make test-oldest's stamp: its environment is complete (an install that broke
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
FLIGHT = {"TORCH_FR_BUFFER_SIZE": "2000"}

pytestmark = pytest.mark.timeout(240)


def normalized(text: str) -> str:
    return " ".join(text.split())


def results(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / name).read_text())


# ---- mismatched collectives


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
    run = run_ranks(SCRIPT, args, env=FLIGHT, python=python)
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
def test_torchs_analyser_fails_on_gloo_dumps_as_the_chapter_says(tmp_path):
    """Chapter 15 says fr_trace stops with a KeyError on gloo's dumps: if a
    release fixes that, this test fails, and the text should change."""
    folder = tmp_path / "fr"
    args = ["--fail", "order", "--timeout", "2", "--flight-recorder", folder]
    run_ranks(SCRIPT, args, env=FLIGHT)
    analyse = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", folder],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert analyse.returncode != 0 and "KeyError" in analyse.stderr


@pytest.mark.slow
def test_rank0_only_flight_records_are_exercise_2(tmp_path):
    folder = tmp_path / "fr"
    args = ["--fail", "rank0-only", "--timeout", "2", "--flight-recorder", folder]
    run_ranks(SCRIPT, args, env=FLIGHT)
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
    assert (
        max(abs(x - y) for x, y in zip(resumed["losses"], straight["losses"])) < 1e-12
    )


# ---- bad input


@pytest.mark.slow
def test_ddp_under_detail_on_gloo_is_refused_in_one_sentence():
    run = run_ranks(SCRIPT, ["--timeout", "30"], env=DETAIL)
    # rank 0 says it and exits 2; rank 1 waits silently for the launcher to stop it
    assert run.returncodes[0] == 2 and run.returncodes[1] in (None, 2)
    assert run.outputs[0].strip().endswith(
        "failures.py: error: DDP crashes on gloo under "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL; add --shard"
    )
    assert "Traceback" not in run.outputs[1]


@pytest.mark.slow
def test_bad_arguments_are_one_sentence():
    ran = subprocess.run(
        [sys.executable, SCRIPT, "--shard", "--fix", "join"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 2
    assert (
        ran.stderr.strip()
        .splitlines()[-1]
        .endswith("--fix join works with DDP, not with --shard")
    )
