"""Unit tests of companion/diagnosis.py: the launchers, and the parsers that turn
what PyTorch's tools printed into a diagnosis.

The parsers are fed the lines that torch 2.10 and 2.14.1 printed on this
stack (process ids, ports and paths changed), so that a change of format in
either shows here; tests/test_scripts_failures.py causes every failure for
real and checks the diagnoses end to end. The exercises of chapter 15 quote
such lines too: their diagnoses are checked here, against the notebook's
text. No test here imports torch in a child process: together they take
about a second.
"""

from __future__ import annotations

import http.server
import json
import math
import pickle
import re
import socketserver
import sys
import threading
from pathlib import Path

import pytest

from companion.diagnosis import (
    Collective,
    Mismatch,
    ask_worker,
    compare_flight_records,
    excerpt,
    find_barrier_report,
    find_drift,
    find_failures,
    find_gloo_errors,
    find_mismatch,
    find_root_cause,
    find_stacks,
    find_watch,
    flight_records_from_json,
    op_name,
    read_flight_records,
    run_ranks,
    sanitize,
    stacks_on_demand,
    torchrun_entry,
    torchrun_summary,
    where_stuck,
)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "15_when_it_goes_wrong.ipynb"

OPTIONS = (
    "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout="
    "Strided (default), requires_grad=false (default), pinned_memory=false "
    "(default), memory_format=(nullopt))"
)
# What DETAIL printed for --fail shape --shard, the same in 2.10 and 2.14.1.
DETAIL_SHAPE = (
    "[rank1]: RuntimeError: Detected mismatch between collectives on ranks. Rank 1 "
    "is running collective: CollectiveFingerPrint(SequenceNumber=52, OpType=ALLGATHER"
    f", TensorShape=[51], TensorDtypes=Double, {OPTIONS}), but Rank 0 is running "
    "collective: CollectiveFingerPrint(SequenceNumber=52, OpType=ALLGATHER, "
    f"TensorShape=[50], TensorDtypes=Double, {OPTIONS}).Collectives differ in the "
    "following aspects: \t Tensor Tensor shapes: 51vs 50\n"
)

# torchrun's summary for --fail crash: 2.14.1 ends the exitcode line with a
# space, 2.10 does not.
SUMMARY = """\
============================================================
failures.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-25_22:45:01
  host      : node7
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 25896)  (SIGTERM)
  error_file: /tmp/torchelastic_h264k7t0/fe1de6f5_pipf2yr4/attempt_1/0/error.json
  traceback : Traceback (most recent call last):
    File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 630, in backward
      torch.autograd.backward(
  RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] \
Connection closed by peer [127.0.0.1]:15529
  
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_22:45:00
  host      : node7
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 25897){space}
  error_file: /tmp/torchelastic_h264k7t0/fe1de6f5_pipf2yr4/attempt_1/1/error.json
  traceback : Traceback (most recent call last):
    File "/work/companion/scripts/failures.py", line 196, in load_batch
      raise ValueError(f"sample {{indices[0]}} is corrupt")
  ValueError: sample 232 is corrupt
  
============================================================
"""
KILLED = """\
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_22:41:36
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 23335)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 23335
============================================================
"""
# The same kill, when rank 0's @record stamped its own error (gloo lost its
# peer) a second before torchrun noticed rank 1 was gone: rank 0 takes the root
# cause. CI saw this once; the stamps are whole seconds.
KILLED_LATE = """\
Failures:
[1]:
  time      : 2026-11-25_22:41:37
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 23335)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 23335
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_22:41:36
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 23334)  (SIGTERM)
  error_file: /tmp/torchelastic_h264k7t0/fe1de6f5_pipf2yr4/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
    File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 630, in backward
      torch.autograd.backward(
  RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] \
Connection closed by peer [127.0.0.1]:15529
============================================================
"""
# faulthandler's dumps under torchrun --tee 3 (dump_traceback_later).
STACKS = """\
[default0]:Timeout (0:00:01.500000)!
[default0]:Thread 0x00007fc160409b80 (most recent call first):
[default0]:  File "/v/torch/autograd/graph.py", line 1072 in _engine_run_backward
[default0]:  File "/v/torch/autograd/__init__.py", line 395 in backward
[default0]:  File "/v/torch/_tensor.py", line 623 in backward
[default0]:  File "/w/companion/scripts/failures.py", line 333 in train
[default0]:  File "/w/companion/scripts/failures.py", line 410 in main
[default1]:Timeout (0:00:01.500000)!
[default1]:Thread 0x00007f7dcea50b80 (most recent call first):
[default1]:  File "/w/companion/scripts/failures.py", line 201 in load_batch
[default1]:  File "/w/companion/scripts/failures.py", line 330 in train
"""


def test_op_names_of_detail_and_the_flight_recorder_agree():
    assert op_name("ALLREDUCE") == op_name("gloo:all_reduce") == "all_reduce"
    assert op_name("nccl:broadcast") == op_name("BROADCAST") == "broadcast"
    assert op_name("_ALLGATHER_BASE") == "all_gather_into_tensor"
    assert op_name("SOMETHING_NEW") == "something_new"


def test_detail_mismatch_names_ranks_ops_and_shapes():
    mismatch = find_mismatch("noise before\n" + DETAIL_SHAPE)
    assert mismatch.ranks == [0, 1]
    assert [(c.op, c.shape, c.dtype, c.sequence) for c in mismatch.collectives] == [
        ("all_gather", (50,), "Double", 52),
        ("all_gather", (51,), "Double", 52),
    ]
    assert mismatch.differs_in == ["shape"]
    assert find_mismatch("Timed out waiting 2000ms for recv operation") is None


def test_a_fingerprint_without_tensors_still_parses():
    line = (
        "Detected mismatch between collectives on ranks. Rank 0 is running "
        "collective: CollectiveFingerPrint(SequenceNumber=3, OpType=BARRIER), but "
        "Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=3, "
        f"OpType=ALLREDUCE, TensorShape=[2], TensorDtypes=Float, {OPTIONS})."
    )
    mismatch = find_mismatch(line)
    assert [(c.rank, c.op, c.shape) for c in mismatch.collectives] == [
        (0, "barrier", None),
        (1, "all_reduce", (2,)),
    ]
    assert mismatch.differs_in == ["op", "shape", "dtype"]


def test_monitored_barrier_reports_both_sides():
    rank0 = "[rank0]: RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms"
    assert find_barrier_report(rank0).missing == (1,)
    several = "Ranks 1, 3 failed to pass monitoredBarrier in 2000 ms"
    assert find_barrier_report(several).missing == (1, 3)
    other = (
        "Rank 1 successfully reached monitoredBarrier, but received errors while "
        "waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank."
    )
    assert find_barrier_report(other).reached == (1,)
    assert find_barrier_report("all good") is None


def test_an_allocator_that_refuses_is_out_of_memory():
    said = (
        "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
        "can't allocate memory: you tried to allocate 1152921504606846976 bytes."
    )
    cuda = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert find_gloo_errors([said, cuda]) == {
        0: "ran out of memory",
        1: "ran out of memory",
    }


def test_gloo_errors_in_a_few_words():
    outputs = [
        (
            "[rank0]: RuntimeError: [/x/gloo/transport/tcp/unbound_buffer.cc:78] "
            "Timed out waiting 2000ms for recv operation to complete"
        ),
        (
            "RuntimeError: [/x/pair.cc:545] Read error [127.0.0.1]:7088: Connection "
            "reset by peer. This is typically caused by ..."
        ),
        (
            "what():  [enforce fail at /x/pair.cc:464] op.preamble.length <= "
            "op.nbytes. 840 vs 8. Received data size doesn't match expected size."
        ),
        "epoch 1/3: step 8, loss 0.6132",
    ]
    assert find_gloo_errors(outputs) == {
        0: "timed out after 2000 ms",
        1: "lost the connection to a peer",
        2: "received data of the wrong size",
    }


@pytest.mark.parametrize("space", [" ", ""], ids=["2.14", "2.10"])
def test_torchruns_root_cause_and_error_file(space):
    text = SUMMARY.format(space=space)
    root = find_root_cause(text)
    assert (root.rank, root.exitcode, root.signal) == (1, 1, None)
    assert root.error == "ValueError: sample 232 is corrupt"
    assert root.has_error_file
    assert root.others == {0: -15}
    shown = torchrun_summary(text)
    assert shown.startswith("Root Cause (first observed failure):")
    assert "<tmp>/attempt_1/1/error.json" in shown
    assert "traceback : … ValueError: sample 232 is corrupt" in shown
    assert "25897" not in shown and "node7" not in shown and "22:45" not in shown


def test_a_killed_worker_has_a_signal_and_no_error_file():
    root = find_root_cause(KILLED)
    assert (root.rank, root.exitcode, root.signal) == (1, -9, "SIGKILL")
    assert not root.has_error_file
    assert find_root_cause("no summary here") is None
    assert torchrun_summary("no summary here") == ""


def test_a_killed_worker_is_found_wherever_the_summary_lists_it():
    late = find_root_cause(KILLED_LATE)
    assert (late.rank, late.exitcode, late.others) == (0, -15, {1: -9})
    for text in (KILLED, KILLED_LATE):
        killed = find_failures(text)[1]
        assert (killed.exitcode, killed.signal) == (-9, "SIGKILL")
        assert not killed.has_error_file
    shown = (
        "  time      : <time>\n"
        "  host      : <host>\n"
        "  rank      : 1 (local_rank: 1)\n"
        "  exitcode  : -9 <pid>  (SIGKILL)\n"
        "  error_file: <N/A>\n"
        "  traceback : Signal 9 (SIGKILL) received by <pid>"
    )
    assert torchrun_entry(KILLED, 1) == torchrun_entry(KILLED_LATE, 1) == shown
    assert "… RuntimeError: [gloo/" in torchrun_entry(KILLED_LATE, 0)
    assert find_failures("no summary here") == {}
    assert torchrun_entry(KILLED, 0) == ""


def test_stacks_from_torchrun_tee_and_from_separate_outputs():
    stacks = find_stacks(STACKS)
    assert where_stuck(stacks[0]) == "train (in backward)"
    assert where_stuck(stacks[1]) == "load_batch"
    assert stacks[1][0].file == "failures.py" and stacks[1][0].line == 201
    per_rank = [
        "\n".join(line.split(":", 1)[1] for line in STACKS.splitlines() if tag in line)
        for tag in ("[default0]", "[default1]")
    ]
    assert find_stacks(per_rank) == stacks
    signal_dump = 'Current thread 0x00007f (most recent call first):\n  File "/a/b.py", line 3 in f\n'
    assert where_stuck(find_stacks([signal_dump])[0], script="b.py") == "f"
    assert find_stacks(["no dump"]) == {}


def _dump(folder: Path, rank: int, entries: list[tuple]) -> None:
    """A Flight Recorder file as _dump_fr_trace writes it (the fields read here).

    Each entry: (sequence number, op, shape, calling function[, group]).
    """
    records = [
        {
            "process_group": ("0", (group or ["default_pg"])[0]),
            "profiling_name": f"gloo:{op}",
            "input_sizes": [list(shape)],
            "input_dtypes": ["Double"],
            "collective_seq_id": seq,
            "frames": [
                {"name": op, "filename": "/t/distributed_c10d.py", "line": 1},
                {"name": where, "filename": "/s/failures.py", "line": 2},
            ],
        }
        for seq, op, shape, where, *group in entries
    ]
    (folder / f"rank_{rank}").write_bytes(
        pickle.dumps({"version": "2.10", "pg_config": {}, "entries": records})
    )


def test_flight_records_part_where_op_shape_or_caller_differ(tmp_path):
    common = (14, "all_reduce", (420,), "train")
    _dump(tmp_path, 0, [common, (15, "broadcast", (1,), "end_epoch")])
    _dump(tmp_path, 1, [common, (15, "all_reduce", (2,), "end_epoch")])
    records = read_flight_records(tmp_path)
    assert [c.where for c in records[0]] == ["train", "end_epoch"]
    parted = compare_flight_records(records)
    assert [(c.rank, c.op, c.shape) for c in parted.collectives] == [
        (0, "broadcast", (1,)),
        (1, "all_reduce", (2,)),
    ]
    assert parted.differs_in == ["op", "shape"]
    # same operation and shape, called from different places: still parted
    _dump(tmp_path, 0, [common, (15, "all_reduce", (2,), "end_epoch")])
    _dump(tmp_path, 1, [common, (15, "all_reduce", (2,), "validate")])
    assert compare_flight_records(read_flight_records(tmp_path)).differs_in == ["where"]


def test_flight_records_name_a_missing_rank_and_skip_other_groups(tmp_path):
    _dump(
        tmp_path,
        0,
        [(1, "all_reduce", (4,), "train"), (2, "all_reduce", (4,), "train")],
    )
    _dump(tmp_path, 1, [(1, "all_reduce", (4,), "train")])
    parted = compare_flight_records(read_flight_records(tmp_path))
    assert parted.missing == (1,) and parted.ranks == [0]
    _dump(tmp_path, 1, [(1, "all_reduce", (4,), "train"), (2, "barrier", (), "x", "g")])
    assert [c.sequence for c in read_flight_records(tmp_path)[1]] == [1]
    _dump(
        tmp_path,
        1,
        [(1, "all_reduce", (4,), "train"), (2, "all_reduce", (4,), "train")],
    )
    assert compare_flight_records(read_flight_records(tmp_path)) is None


def test_flight_records_after_the_ring_buffers_wrapped():
    """Buffers that keep the last entries start at different numbers (here #5
    and #9, as after a wrap): the comparison starts where both have entries,
    so the rank whose window starts later is not called missing."""
    ahead = [Collective(0, "all_reduce", (4,), sequence=q) for q in range(9, 14)]
    stuck = [Collective(1, "all_reduce", (4,), sequence=q) for q in range(5, 13)]
    parted = compare_flight_records({0: ahead, 1: stuck})
    assert parted.missing == (1,) and parted.collectives[0].sequence == 13
    assert compare_flight_records({0: ahead[:-1], 1: stuck}) is None
    assert compare_flight_records({0: ahead, 1: []}).missing == (1,)  # off there
    assert compare_flight_records({0: [], 1: []}) is None


def test_drift_messages_of_the_scripts_checks():
    replicas = (
        "RuntimeError: the replicas differ after step 4: head.weight has norm 1.242308 "
        "on rank 0,\n    1.224249 on rank 1 (apart by 1.8e-02; its sums by 1.1e-16)"
    )
    assert find_drift(replicas) == find_drift(replicas.replace("Runtime", "x"))
    drift = find_drift(replicas)
    assert (drift.kind, drift.step, drift.detail) == ("replicas", 4, "head.weight")
    assert (drift.norm_gap, drift.sum_gap) == (1.8e-02, 1.1e-16)
    shards = "the ranks' shards overlap: 72 samples twice, 72 never; do all ..."
    assert find_drift(shards).detail == "72 twice, 72 never"
    assert (
        find_drift("this epoch repeats the last one's order: set_epoch?").kind
        == "order"
    )
    assert find_drift("epoch 1/3: step 8") is None


def test_the_watch_message_names_the_step_the_ranks_and_the_weights():
    said = (
        "[rank0]: RuntimeError: step 10: the loss is nan on rank 1, 7.5 on rank 3, "
        "against a recent median of 0.2966;\n    stopped before the gradients' "
        "all-reduce, every rank's weights still finite"
    )
    watch = find_watch(said)
    assert (watch.step, list(watch.losses), watch.median) == (10, [1, 3], 0.2966)
    assert math.isnan(watch.losses[1]) and watch.losses[3] == 7.5
    assert watch.weights_finite
    stopped = find_watch(said.replace("still finite", "still not all finite"))
    assert not stopped.weights_finite
    assert find_watch("epoch 1/3: step 8, loss nan") is None


def test_flight_records_from_the_worker_servers_json():
    entry = {
        "process_group": ["0", "default_pg"],
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[420]],
        "input_dtypes": ["Double"],
        "collective_seq_id": 20,
        "state": "scheduled",
    }
    helper = {**entry, "process_group": ["1", "helper"], "collective_seq_id": 3}
    answers = {
        0: json.dumps({"entries": [{**entry, "collective_seq_id": 19}, entry, helper]}),
        1: json.dumps({"entries": [{**entry, "collective_seq_id": 19}]}),
    }
    records = flight_records_from_json(answers)
    assert [c.sequence for c in records[0]] == [19, 20]  # other groups left out
    assert records[0][-1] == Collective(
        0, "all_reduce", (420,), "Double", 20, "", "scheduled"
    )
    assert compare_flight_records(records).missing == (1,)


def test_sanitize_removes_what_changes_between_runs():
    text = (
        "E1125 22:41:48.445000 23402 torch/x.py:1] failed (exitcode: 1) (pid: 23428)\n"
        '  File "/home/me/.venv/lib/python3.11/site-packages/torch/autograd/graph.py", '
        "line 5\n"
        "[rank0]:[E1125 22:44:25.805342690 ProcessGroupGloo.cpp:66] [Rank 0]: x\n"
        "Read error [127.0.0.1]:49814: Connection reset\n"
        "Thread 0x00007fc160409b80 (most recent call first):\n"
        "  host      : node17.cluster\n"
        "  error_file: /tmp/torchelastic_ab12/3d_x9/attempt_0/1/error.json   \n"
    )
    clean = sanitize(text)
    for volatile in (
        "23402",
        "23428",
        "22:41",
        "/home/me",
        "49814",
        "b80",
        "node17",
        "ab12",
    ):
        assert volatile not in clean, volatile
    assert '".../site-packages/torch/autograd/graph.py"' in clean
    assert "<tmp>/attempt_0/1/error.json\n" in clean
    assert "[rank0]:[ProcessGroupGloo.cpp:66]" in clean


def test_excerpt_keeps_matching_lines_once_shortened_and_wrapped():
    text = DETAIL_SHAPE + DETAIL_SHAPE.replace("[rank1]", "[rank0]") + "other\n"
    shown = excerpt(text, "Detected mismatch", width=60)
    assert "TensorOptions" not in shown and "[rank" not in shown
    assert shown.startswith("RuntimeError: Detected mismatch")
    assert all(len(line) <= 60 for line in shown.splitlines())
    assert shown.count("Detected mismatch") == 1  # the same line twice, shown once
    assert excerpt("a\nb\n", "c") == ""


# ---- the launcher, with a script that needs no torch (it starts in a moment)

RANK_SCRIPT = """\
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} at {os.environ['MASTER_ADDR']}:"
      f"{os.environ['MASTER_PORT']}, gpus={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
      f"threads={os.environ['OMP_NUM_THREADS']}, args={sys.argv[1:]}", flush=True)
if "fail" in sys.argv and rank == 1:
    sys.exit(3)
if "hang" in sys.argv or "fail" in sys.argv:
    time.sleep(60)
"""


@pytest.fixture
def rank_script(tmp_path: Path) -> Path:
    path = tmp_path / "ranks.py"
    path.write_text(RANK_SCRIPT)
    return path


def test_run_ranks_gives_each_rank_its_place_and_keeps_outputs_apart(rank_script):
    run = run_ranks(rank_script, ["a", 1], nproc=3, env={"EXTRA": "x"}, timeout=20)
    assert run.returncodes == [0, 0, 0] and not run.timed_out
    ports = set()
    for rank, output in enumerate(run.outputs):
        match = re.match(
            r"rank (\d) of 3 at 127\.0\.0\.1:(\d+), gpus='', threads=1, ", output
        )
        assert match and int(match.group(1)) == rank, output
        ports.add(match.group(2))
        assert "args=['a', '1']" in output
    assert len(ports) == 1  # every rank meets at the same address
    assert run.text.count("rank ") == 3


def test_run_ranks_can_leave_ranks_out_and_probe_while_they_run(rank_script):
    seen = []
    run = run_ranks(
        rank_script,
        ["hang"],
        nproc=3,
        ranks=[2],
        timeout=1.5,
        probe=lambda: seen.append("asked") or "answer",
    )
    assert len(run.outputs) == len(run.returncodes) == 1
    assert run.outputs[0].startswith("rank 2 of 3 at ")  # the others never came
    assert run.probed == "answer" and seen == ["asked"]
    assert run_ranks(rank_script, nproc=1, timeout=20).probed is None


def test_one_failed_rank_stops_the_others_after_the_grace(rank_script):
    run = run_ranks(rank_script, ["fail"], timeout=30, grace=0.5)
    assert run.returncodes[1] == 3 and run.returncodes[0] is None
    assert not run.timed_out and run.seconds < 10


def test_a_hang_is_stopped_at_the_timeout(rank_script):
    run = run_ranks(rank_script, ["hang"], timeout=1.5)
    assert run.timed_out and run.returncodes == [None, None]
    assert 1.5 <= run.seconds < 10


# What torch's worker server answers (a faulthandler dump; an empty record).
WORKER_ANSWERS = {
    "dump_traceback": STACKS.replace("[default0]:", "").split("[default1]")[0],
    "fr_trace_json": json.dumps({"entries": []}),
}


class _Handler(http.server.BaseHTTPRequestHandler):
    """Answers like torch's worker server: POST /handler/<name>, else 404."""

    def do_POST(self) -> None:
        name = self.path.removeprefix("/handler/")
        body = WORKER_ANSWERS.get(name)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write((body or "").encode())

    def log_message(self, *args) -> None:
        pass


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):  # http.server wants an address pair
        request, _ = super().get_request()
        return request, ("local", 0)


def test_a_worker_server_is_asked_over_its_unix_socket(tmp_path):
    path = tmp_path / "rank0.sock"
    with _UnixServer(str(path), _Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        stack = ask_worker(path, "dump_traceback")
        assert where_stuck(find_stacks([stack])[0]) == "train (in backward)"
        with pytest.raises(OSError, match="404"):
            ask_worker(path, "no_such_handler")
        asked = stacks_on_demand(tmp_path, wait_for={0: "backward"}, timeout=5)
        server.shutdown()
    assert asked["flight_records"] == {0: json.dumps({"entries": []})}
    assert "in backward" in asked["stacks"][0]
    with pytest.raises(OSError):
        ask_worker(path, "dump_traceback", timeout=1)  # nothing listens now


# ---- chapter 15's exercises quote tool output: their diagnoses hold


def exercise_blocks() -> dict[str, list[str]]:
    """Each exercise's ```text blocks, from the notebook's Markdown, by label."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    markdown = "\n".join(
        "".join(c["source"]) for c in cells if c["cell_type"] == "markdown"
    )
    blocks = {}
    for label, body in re.findall(
        r":label: (ch15_ex\d)\n(.*?)\n````", markdown, re.DOTALL
    ):
        blocks[label] = re.findall(r"```text\n(.*?)```", body, re.DOTALL)
    return blocks


def test_the_exercises_are_there_with_their_solutions():
    blocks = exercise_blocks()
    assert sorted(blocks) == ["ch15_ex1", "ch15_ex2", "ch15_ex3"]
    markdown = NOTEBOOK.read_text()
    for label in blocks:
        assert "solution-start} " + label in markdown


def test_exercise_1_is_an_allreduce_against_fsdps_allgather():
    (block,) = exercise_blocks()["ch15_ex1"]
    mismatch = find_mismatch(" ".join(block.split()))
    assert [(c.rank, c.op, c.shape) for c in mismatch.collectives] == [
        (0, "all_reduce", (2,)),
        (1, "all_gather_into_tensor", (144,)),
    ]


def test_exercise_2_parts_at_15_by_caller():
    (block,) = exercise_blocks()["ch15_ex2"]
    records = {}
    for rank, line in re.findall(
        r"rank (\d): \.\.\. (.*?)(?=\nrank|\Z)", block, re.DOTALL
    ):
        records[int(rank)] = [
            Collective(
                int(rank), op, tuple(map(int, shape.split(","))), None, int(seq), where
            )
            for seq, op, shape, where in re.findall(
                r"#(\d+) (\w+) \[([\d, ]+)\] in (\w+)", line
            )
        ]
    parted = compare_flight_records(records)
    assert isinstance(parted, Mismatch)
    assert parted.collectives[0].sequence == 15 and parted.differs_in == ["where"]
    assert [c.where for c in parted.collectives] == ["end_epoch", "validate"]


def test_exercise_3_is_rank_0_ahead_in_end_epoch():
    rank0, rank1 = exercise_blocks()["ch15_ex3"]
    errors = find_gloo_errors([" ".join(rank0.split()), " ".join(rank1.split())])
    assert errors == {
        0: "received data of the wrong size",
        1: "lost the connection to a peer",
    }
    assert "in end_epoch" in rank0 and "in train" in rank1


def test_exercise_blocks_fit_the_page():
    for blocks in exercise_blocks().values():
        for block in blocks:
            assert all(len(line) <= 88 for line in block.splitlines()), block


def test_run_ranks_uses_this_interpreter_by_default(tmp_path):
    probe = tmp_path / "which.py"
    probe.write_text("import sys; print(sys.executable)")
    run = run_ranks(probe, nproc=1, timeout=20)
    assert run.outputs[0].strip() == sys.executable
