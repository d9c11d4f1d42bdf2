"""companion.checks._shared: what the check programs share."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from gpt_scripts import one_process_group

from companion.checks._shared import DeviceClock, clock, every_rank, finish, tolerance


def test_tolerances_follow_the_dtype_unless_given() -> None:
    assert tolerance("float64") == 1e-10
    assert tolerance("float32") == 1e-4
    assert tolerance("float32", 1e-2) == 1e-2


def test_the_clock_moves_forward() -> None:
    first = clock()
    assert clock() >= first


def test_the_device_clock_reads_the_host_clock_on_a_cpu() -> None:
    clock_ = DeviceClock("cpu")
    a, b = clock_.mark(), clock_.mark()
    assert isinstance(a, float) and clock_.seconds(a, b) >= 0


def test_the_device_clock_records_cuda_events_without_waiting(monkeypatch) -> None:
    """On a GPU a mark is an event in the stream; only reading it waits."""
    calls = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = len(calls)

        def record(self) -> None:
            calls.append("record")

        def synchronize(self) -> None:
            calls.append("synchronize")

        def elapsed_time(self, end: Event) -> float:
            return 1000.0 * (end.at - self.at)  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda *a: calls.append("device sync")
    )
    clock_ = DeviceClock(torch.device("cuda", 0))
    marks = [clock_.mark() for _ in range(3)]
    assert calls == ["record"] * 3  # no synchronisation while marking
    assert clock_.seconds(marks[0], marks[2]) == 2.0
    assert calls[-1] == "synchronize"  # the event read waits for itself only


def test_a_passed_check_writes_its_results_and_ends_quietly(tmp_path, capsys) -> None:
    path = tmp_path / "results.json"
    with one_process_group():
        assert every_rank({"rank": 0}) == [{"rank": 0}]
        finish({"checks": {"losses": True}}, "", str(path))
        assert not dist.is_initialized()  # finish ended the group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert json.loads(path.read_text()) == {"checks": {"losses": True}}
    assert capsys.readouterr().err == ""


def test_a_missed_check_exits_with_code_3_and_one_sentence(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr("sys.argv", ["some_check.py"])
    path = tmp_path / "results.json"
    with one_process_group():
        with pytest.raises(SystemExit) as stopped:
            finish({"checks": {"losses": False}}, "the losses differ.", str(path))
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert stopped.value.code == 3
    assert capsys.readouterr().err == "some_check.py: error: the losses differ.\n"
    assert json.loads(path.read_text())["checks"] == {"losses": False}  # written first


def test_first_miss_names_the_first_comparison_that_missed():
    from companion.checks._shared import first_miss

    assert first_miss({"bytes": True, "work": True}) == ""
    assert first_miss({"bytes": True, "work": False, "loss": False}).startswith(
        "work: measured and predicted differ"
    )
