"""companion.harness.timing: formatting, the benchmark wrapper and the context manager."""

import math
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import torch

from companion.harness import timing
from companion.harness.timing import (
    Benchmark,
    OtherLoad,
    Timing,
    benchmark,
    format_table,
    format_time,
    median_interval,
    paired_difference,
)


@pytest.mark.parametrize(
    "seconds, text",
    [
        (2.5, "2.5 s"),
        (1.0, "1 s"),
        (0.999, "999 ms"),
        (0.0123, "12.3 ms"),
        (1e-3, "1 ms"),
        (9.997e-4, "1 ms"),  # not "1e+03 us", which widened a table in CI
        (9.994e-4, "999 us"),
        (4.56e-5, "45.6 us"),
        (1e-6, "1 us"),
        (7e-8, "70 ns"),
        (-2.73e-3, "-2.73 ms"),  # a difference of two times
        (math.nan, "n/a"),
        (math.inf, "n/a"),
    ],
)
def test_format_time_picks_unit(seconds, text):
    assert format_time(seconds) == text


def test_timing_str_names_median_spread_and_runs():
    assert (
        str(Timing("sleep", 0.0123, 4.56e-5, 7, "hw"))
        == "sleep: 12.3 ms per call (IQR 45.6 us, 7 runs)"
    )


def test_timings_add_up_as_calls_made_one_after_the_other():
    a = Timing("a", 0.010, 0.001, 7, "hw, 2 threads", 2)
    b = Timing("b", 0.030, 0.004, 5, "hw, 2 threads", 2)
    both = a + b
    assert (both.label, both.runs, both.hardware, both.threads) == (
        "a + b",
        5,
        "hw, 2 threads",
        2,
    )
    assert both.median == pytest.approx(0.040) and both.iqr == pytest.approx(0.005)
    mixed = a + Timing("c", 0.02, 0.0, 3, "hw, 1 thread", 1)
    assert (mixed.threads, mixed.hardware) == (0, "hw, 2 threads; hw, 1 thread")
    with pytest.raises(TypeError):
        a + 1.0


class FakeTimer:
    """Stands in for ``timeit.Timer``: reports the per-call medians it is given.

    Like ``timeit``, each ``timeit(number)`` reads the clock (which
    synchronises), makes ``number`` calls and reads the clock again; it
    records ``number`` and the intra-op threads it ran with.
    """

    instances: list["FakeTimer"] = []

    def __init__(self, medians, stmt, timer):
        self.medians = iter(medians)
        self.stmt = stmt
        self.timer = timer
        self.numbers: list[int] = []
        self.threads: set[int] = set()
        FakeTimer.instances.append(self)

    def timeit(self, number):
        self.timer()
        self.numbers.append(number)
        self.threads.add(torch.get_num_threads())
        for _ in range(number):
            self.stmt()
        self.timer()
        return next(self.medians) * number


@pytest.fixture
def fake_timer(monkeypatch):
    """Install a FakeTimer that replies with the medians the test sets."""
    medians: list[float] = []
    FakeTimer.instances = []
    monkeypatch.setattr(
        timing.timeit, "Timer", lambda stmt, timer: FakeTimer(medians, stmt, timer)
    )
    return medians


def test_benchmark_warms_up_before_timing(fake_timer, monkeypatch):
    events = []
    monkeypatch.setattr(
        timing, "synchronize", lambda: events.append(("sync", len(calls)))
    )
    fake_timer += [1e-3] * 8
    calls: list[int] = []
    benchmark(calls.append, 1, warmup=3, repeats=7, min_run_time=0.01)
    # exactly the warm-up calls, then the clock, which first finishes queued work
    assert events[0] == ("sync", 3)
    events.clear()
    calls.clear()
    fake_timer += [1e-3] * 8
    benchmark(calls.append, 1, warmup=0, repeats=7, min_run_time=0.01)
    assert events[0] == ("sync", 0)


def test_benchmark_median_and_iqr_of_the_blocks(fake_timer):
    # One call takes 1/32 s, so blocks of 0.5 s / 4 repeats hold 4 calls each.
    fake_timer += [0.03125, 0.004, 0.001, 0.003, 0.002]
    calls: list[int] = []
    result = benchmark(
        calls.append, 0, label="fake", warmup=1, repeats=4, min_run_time=0.5
    )
    (timer,) = FakeTimer.instances
    assert timer.numbers == [1, 4, 4, 4, 4]
    assert len(calls) == 1 + 1 + 16
    assert result.label == "fake" and result.runs == 4
    assert result.median == pytest.approx(0.0025)  # between 2 and 3 ms
    # Quartiles of 1, 2, 3, 4 ms (exclusive method): 1.25 and 3.75 ms.
    assert result.iqr == pytest.approx(0.0025)
    assert timer.threads == {torch.get_num_threads()}


def test_benchmark_passes_the_threads_on(fake_timer):
    fake_timer += [0.01, 0.02]
    result = benchmark(
        lambda: None, warmup=0, repeats=1, min_run_time=0.1, num_threads=3
    )
    # one block of 0.1 s / 1 repeat / 10 ms per call = 10 calls
    assert FakeTimer.instances[0].numbers == [1, 10]
    assert result.threads == 3 and "3 threads" in result.hardware


def test_benchmark_one_block_and_slow_calls(fake_timer):
    # A call slower than the whole budget: blocks of one call, never zero.
    fake_timer += [10.0, 7.0]
    result = benchmark(
        lambda _: None, [], warmup=0, repeats=1, min_run_time=0.1, num_threads=3
    )
    (timer,) = FakeTimer.instances
    assert timer.numbers == [1, 1]
    assert timer.threads == {3}
    assert (result.median, result.iqr, result.runs) == (7.0, 0.0, 1)


def test_benchmark_defaults_and_keyword_arguments(fake_timer):
    # Documented defaults: 2 warm-up calls, 7 blocks, about 0.2 s of measuring.
    fake_timer += [1e-3] * 8
    seen = []
    result = benchmark(lambda *a, **k: seen.append((a, k)), 1, scale=2)
    (timer,) = FakeTimer.instances
    assert all(call == ((1,), {"scale": 2}) for call in seen)  # timed calls too
    assert timer.numbers == [1] + [28] * 7  # int(0.2 s / 7 / 1 ms)
    assert len(seen) == 2 + 1 + 7 * 28
    assert (result.label, result.runs) == ("", 7)


def test_timing_from_samples():
    two = Timing.from_samples("epochs", [3.0, 1.0], threads=3)
    # Quartiles of 1 and 3 s (exclusive method) extrapolate to 0.5 and 3.5 s.
    assert (two.label, two.median, two.iqr, two.runs, two.threads) == (
        "epochs",
        2.0,
        3.0,
        2,
        3,
    )
    assert "3 threads" in two.hardware
    one = Timing.from_samples("once", [0.5])
    assert (one.median, one.iqr, one.runs, one.threads) == (
        0.5,
        0.0,
        1,
        1,
    )  # one thread: conftest
    assert one.hardware.endswith("1 thread")
    with pytest.raises(ValueError, match=r"^No measurements for 'nothing'\.$"):
        Timing.from_samples("nothing", [])


@pytest.mark.parametrize(
    "ratio, digits, text",
    [
        (1.5, 2, "1.50×"),
        (12.34, 1, "12.3×"),
        (5167.29, 2, "5170×"),  # three significant digits from 100 up
        (123.456, 2, "123×"),
        (math.nan, 2, "n/a"),
        (math.inf, 1, "n/a"),
    ],
)
def test_format_ratio(ratio, digits, text):
    assert timing.format_ratio(ratio, digits) == text
    if digits == 2:
        assert timing.format_ratio(ratio) == text


def test_benchmark_measures_a_known_duration():
    result = benchmark(time.sleep, 0.01, label="sleep", warmup=1, min_run_time=0.1)
    assert isinstance(result, Timing)
    assert result.label == "sleep"
    assert 0.009 < result.median < 0.05  # sleep(10 ms) cannot take less than 10 ms
    assert result.runs == 7
    assert "cores" in result.hardware


def test_benchmark_of_a_long_call_makes_no_calls_beyond_its_blocks():
    # torch.utils.benchmark.Timer.timeit runs two warm-up calls before each
    # timing, so sizing and 3 blocks of one call would make 1 + 3 + 3 * 3 = 13.
    calls: list[int] = []

    def slow() -> None:
        time.sleep(0.02)
        calls.append(1)

    result = benchmark(slow, warmup=1, repeats=3, min_run_time=0.01)
    assert len(calls) == 1 + 1 + 3  # warm-up, sizing the blocks, 3 blocks of 1 call
    assert result.runs == 3 and result.median >= 0.02


def test_benchmark_tells_small_from_large_work():
    small, large = torch.randn(32, 32), torch.randn(256, 256)
    t_small = benchmark(torch.mm, small, small, min_run_time=0.05)
    t_large = benchmark(torch.mm, large, large, min_run_time=0.05)
    assert t_large.median > t_small.median  # 512x the flops


@pytest.mark.parametrize("available", [True, False])
def test_synchronize_waits_for_the_accelerator_only_when_there_is_one(
    monkeypatch, available
):
    waits = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: available)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: waits.append(a))
    timing.synchronize()
    assert waits == ([()] if available else [])


@pytest.fixture
def fake_clock(monkeypatch):
    """A clock that reads 10 s, then 10.25 s; the events list shows clock reads and syncs."""
    events = []
    readings = iter([10.0, 10.25])

    def perf_counter():
        events.append("clock")
        return next(readings)

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(timing, "synchronize", lambda: events.append("sync"))
    return events


def test_benchmark_context_manager_syncs_at_both_ends(fake_clock, capsys):
    with Benchmark("nap") as b:
        fake_clock.append("work")
    # the work queued before the block is finished before the clock starts,
    # and the block's work before the clock stops
    assert fake_clock == ["sync", "clock", "work", "sync", "clock"]
    assert b.elapsed == 0.25
    assert capsys.readouterr().out == "nap: 250 ms\n"


def test_benchmark_context_manager_defaults(fake_clock, capsys):
    b = Benchmark()
    assert math.isnan(b.elapsed)  # nothing measured yet
    with b:
        pass
    assert capsys.readouterr().out == "Done: 250 ms\n"


def test_benchmark_context_manager_quiet(fake_clock, capsys):
    with Benchmark("nap", quiet=True) as b:
        pass
    assert b.elapsed == 0.25 and capsys.readouterr().out == ""


def test_benchmark_context_manager_measures_real_time(capsys):
    with Benchmark("nap") as b:
        time.sleep(0.02)
    assert 0.019 < b.elapsed < 0.5
    assert capsys.readouterr().out.startswith("nap: ")


def test_benchmark_context_manager_silent_on_error(capsys):
    with pytest.raises(ZeroDivisionError):
        with Benchmark("fails"):
            1 / 0
    assert capsys.readouterr().out == ""


def test_format_table_headers_of_two_lines_align_at_the_bottom():
    rows = [{"models": 8, "compiled\nspeed-up": "14.7x", "time per\nstep": "3 ms"}]
    assert format_table(rows, hardware=False) == (
        "        compiled  time per\n"
        "models  speed-up  step\n"
        "------  --------  --------\n"
        "8       14.7x     3 ms"
    )


def test_format_table_aligns_and_names_hardware():
    t = Timing("x", 0.002, 0.0001, 10, "hw")
    rows = [
        {"variant": "eager", "time": t, "ratio": 1.0},
        {"variant": "compiled", "time": t, "ratio": 2.345},
    ]
    assert format_table(rows, hardware=False) == (
        "variant   time  ratio\n"
        "--------  ----  -----\n"
        "eager     2 ms  1\n"
        "compiled  2 ms  2.35"
    )
    lines = format_table(rows, title="T").splitlines()
    assert lines[0] == "T"
    assert lines[1:5] == format_table(rows, hardware=False).splitlines()
    assert len(lines) == 6 and lines[-1].startswith("Measured on: ")


def test_format_table_names_the_threads_the_timings_used(monkeypatch):
    monkeypatch.setattr(
        timing,
        "describe_hardware",
        lambda threads=None: f"test machine, threads={threads!r}",
    )
    one = Timing("a", 1e-3, 0.0, 7, "hw", threads=1)
    two = Timing("b", 1e-3, 0.0, 7, "hw", threads=2)
    rows = [
        {"x": "1 thread", "t": one},
        {"x": "2 threads", "t": two},
        {"x": "again", "t": two},
    ]
    assert (
        format_table(rows).splitlines()[-1]
        == "Measured on: test machine, threads='1 and 2'"
    )
    assert (
        format_table(rows[1:]).splitlines()[-1]
        == "Measured on: test machine, threads='2'"
    )
    assert (
        format_table(rows, threads=4).splitlines()[-1]
        == "Measured on: test machine, threads=4"
    )
    no_timings = format_table([{"x": 1.0}])
    assert (
        no_timings.splitlines()[-1] == "Measured on: test machine, threads=None"
    )  # the current setting


def test_format_table_of_one_row():
    # no trailing spaces where a value is wider than the last column's name
    assert (
        format_table([{"a": 1, "n": "long"}], hardware=False)
        == "a  n\n-  ----\n1  long"
    )
    assert (
        format_table([{"models": 8, "note": "x"}], hardware=False)
        == "models  note\n------  ----\n8       x"
    )


def test_format_table_of_no_rows_is_the_title():
    assert format_table([], title="Nothing measured") == "Nothing measured"
    assert format_table([]) == ""


def test_benchmark_interleaved_takes_turns_block_by_block(fake_timer):
    # Each fake timer replies with the same list: one call takes 1 ms, so
    # blocks of 0.03 s / 3 repeats hold 10 calls; the blocks take 1, 2, 3 ms.
    fake_timer += [1e-3, 1e-3, 2e-3, 3e-3]
    calls: list[str] = []
    result = timing.benchmark_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        warmup=1,
        repeats=3,
        min_run_time=0.03,
        num_threads=2,
    )
    timer_a, timer_b = FakeTimer.instances
    assert timer_a.numbers == timer_b.numbers == [1, 10, 10, 10]
    # a warms up and sizes its blocks, then b; then the blocks take turns
    assert calls[:4] == ["a", "a", "b", "b"]
    assert calls[4:] == (["a"] * 10 + ["b"] * 10) * 3
    assert list(result) == ["a", "b"]
    assert (result["a"].label, result["a"].median, result["a"].runs) == ("a", 2e-3, 3)
    assert (result["b"].label, result["b"].threads) == ("b", 2)
    assert timer_a.threads == {2}


def test_benchmark_interleaved_defaults_and_a_single_block(fake_timer):
    # The defaults: 2 warm-up calls, 7 blocks in 0.2 s. One call takes 1 ms,
    # so a block of 0.2 s / 7 holds 28 calls.
    fake_timer += [1e-3] * 8
    calls: list[int] = []
    result = timing.benchmark_interleaved({"a": lambda: calls.append(1)})
    (timer,) = FakeTimer.instances
    assert timer.numbers == [1] + [28] * 7
    assert len(calls) == 2 + 1 + 28 * 7 and result["a"].runs == 7
    FakeTimer.instances = []
    fake_timer += [1e-3] * 2
    one = timing.benchmark_interleaved({"a": lambda: None}, repeats=1)["a"]
    assert one.runs == 1


def test_benchmark_interleaved_sets_each_functions_own_threads(fake_timer):
    fake_timer += [1e-3] * 4
    before = torch.get_num_threads()
    result = timing.benchmark_interleaved(
        {"one": lambda: None, "two": lambda: None, "rest": lambda: None},
        repeats=3,
        num_threads={"one": 1, "two": before + 1},
    )
    one, two, rest = FakeTimer.instances
    assert (one.threads, two.threads, rest.threads) == ({1}, {before + 1}, {before})
    assert [t.threads for t in result.values()] == [1, before + 1, before]
    assert torch.get_num_threads() == before


@pytest.mark.skipif(
    len(psutil.Process().cpu_affinity()) < 2, reason="needs two cores to run on"
)
def test_other_load_counts_a_busy_process():
    spinner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend = time.time() + 30\nwhile time.time() < end: pass",
        ]
    )

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    try:
        time.sleep(0.3)  # the spinner is running
        with OtherLoad() as others:
            helper = threading.Thread(target=spin, args=(1.0,))  # this process
            helper.start()
            spin(1.0)
            helper.join()
    finally:
        spinner.kill()
        spinner.wait()
    # The spinner's share of the cores at least (with two cores and three busy
    # threads, about 2/3); whatever else runs may add to it.
    assert 0.4 <= others.cores <= others.available + 0.1
    assert others.available == len(psutil.Process().cpu_affinity())


def fake_cores(
    monkeypatch, readings: list[list[float]], affinity=None, own: float = 0.0
) -> None:
    """psutil reporting these busy seconds per core, call after call, and
    ``own`` CPU seconds of this process more at the end than at the start."""
    calls = iter(readings)
    monkeypatch.setattr(
        timing.psutil,
        "cpu_times",
        lambda percpu: [SimpleNamespace(user=u) for u in next(calls)],
    )
    monkeypatch.setattr(timing.psutil, "cpu_count", lambda: len(readings[0]))
    mine = iter([0.0, own])
    process = SimpleNamespace(
        cpu_times=lambda: SimpleNamespace(user=next(mine), system=0.0),
        cpu_affinity=(lambda: affinity) if affinity is not None else None,
        children=lambda recursive: [],
    )
    if affinity is None:
        del process.cpu_affinity  # as on macOS
    monkeypatch.setattr(timing.psutil, "Process", lambda: process)
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))


def test_other_load_ignores_cores_this_process_may_not_use(monkeypatch):
    """A program busy on a core outside this process's affinity is not counted."""
    fake_cores(monkeypatch, [[0.0, 0.0], [0.0, 0.0], [10.0, 1.0]], affinity=[1])
    with OtherLoad() as others:
        pass
    assert (others.cores, others.available) == (1.0, 1)  # core 1's second only


def test_other_load_watches_every_core_where_there_is_no_affinity(monkeypatch):
    fake_cores(monkeypatch, [[0.0, 0.0], [0.0, 0.0], [0.5, 1.0]])
    with OtherLoad() as others:
        pass
    assert (others.cores, others.available) == (1.5, 2)


def test_other_load_leaves_out_this_processs_own_threads(monkeypatch):
    fake_cores(monkeypatch, [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]], own=1.5)
    with OtherLoad() as others:
        pass
    assert others.cores == 0.5  # 2 busy core-seconds, 1.5 of them this process's


def test_other_load_with_a_tree_counts_its_descendants_as_the_program(monkeypatch):
    """The ranks of a job are one program: with ``tree``, their time is not others'."""
    fake_cores(monkeypatch, [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    ranks = [iter([0.0, 0.75]), iter([0.0, 0.75])]
    agent = SimpleNamespace(
        cpu_times=lambda: SimpleNamespace(user=0.0, system=0.0),
        children=lambda recursive: [
            SimpleNamespace(
                cpu_times=lambda r=r: SimpleNamespace(user=next(r), system=0)
            )
            for r in ranks
        ],
    )
    with OtherLoad(tree=agent) as others:
        pass
    assert others.cores == 0.5  # 2 busy core-seconds, 1.5 of them the ranks'


def test_other_load_keeps_a_reaped_rank_s_time_and_is_unknown_without_its_root(
    monkeypatch,
):
    fake_cores(monkeypatch, [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    reaped = iter([0.0, 1.5])  # a rank that ended: its time moved to its parent
    agent = SimpleNamespace(
        cpu_times=lambda: SimpleNamespace(
            user=0.0, system=0.0, children_user=next(reaped), children_system=0.0
        ),
        children=lambda recursive: [],
    )
    with OtherLoad(tree=agent) as others:
        pass
    assert others.cores == 0.5

    def ended(recursive: bool) -> list:
        raise timing.psutil.NoSuchProcess(1)

    fake_cores(monkeypatch, [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    gone = SimpleNamespace(cpu_times=lambda: None, children=ended)
    with OtherLoad(tree=gone) as others:
        pass
    assert math.isnan(others.cores)  # so no verdict is excused by it


def test_other_load_is_unknown_until_the_block_ends():
    assert math.isnan(OtherLoad().cores)


def test_paired_difference_cancels_the_load_both_rounds_met():
    load = [0.0, 5.0, 0.1, 9.0, 0.2, 3.0, 0.0]  # a busy spell hits some rounds
    b = [1.0 + x for x in load]
    a = [3.0 + x for x in load]
    assert paired_difference(a, b) == (pytest.approx(2.0), pytest.approx(0.0))
    # unpaired, the IQRs of a and b would be seconds wide
    median, half_width = paired_difference([3, 4, 5, 6, 7], [1, 1, 1, 1, 1])
    assert median == 4 and half_width == pytest.approx(1.57 * 3 / 5**0.5)


def test_paired_difference_wants_the_same_rounds():
    with pytest.raises(ValueError, match="same rounds, at least 3; got 3 and 2"):
        paired_difference([1, 2, 3], [1, 2])


def test_median_interval_is_a_box_plots_notch():
    assert median_interval([1, 2, 3, 4, 5]) == (3, pytest.approx(1.57 * 3 / 5**0.5))
    with pytest.raises(ValueError, match="at least 3 values; got 2"):
        median_interval([1, 2])
