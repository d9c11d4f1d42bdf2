"""companion.timing: formatting, the benchmark wrapper and the context manager."""

import math
import time

import pytest
import torch

from companion.timing import Benchmark, Timing, benchmark, format_table, format_time


@pytest.mark.parametrize(
    "seconds, text",
    [(2.5, "2.5 s"), (0.0123, "12.3 ms"), (4.56e-5, "45.6 us"), (7e-8, "70 ns"), (math.nan, "n/a")],
)
def test_format_time_picks_unit(seconds, text):
    assert format_time(seconds) == text


def test_benchmark_measures_a_known_duration():
    result = benchmark(time.sleep, 0.01, label="sleep", warmup=1, min_run_time=0.1)
    assert isinstance(result, Timing)
    assert result.label == "sleep"
    assert 0.009 < result.median < 0.05  # sleep(10 ms) cannot take less than 10 ms
    assert result.runs == 7
    assert "cores" in result.hardware


def test_benchmark_tells_small_from_large_work():
    small, large = torch.randn(32, 32), torch.randn(256, 256)
    t_small = benchmark(torch.mm, small, small, min_run_time=0.05)
    t_large = benchmark(torch.mm, large, large, min_run_time=0.05)
    assert t_large.median > t_small.median  # 512x the flops


def test_benchmark_warms_up_before_timing():
    calls = []
    benchmark(calls.append, 1, warmup=3, min_run_time=0.01)
    assert len(calls) > 3


def test_benchmark_context_manager_prints_and_stores(capsys):
    with Benchmark("nap") as b:
        time.sleep(0.02)
    assert 0.019 < b.elapsed < 0.5
    assert capsys.readouterr().out.startswith("nap: ")


def test_benchmark_context_manager_silent_on_error(capsys):
    with pytest.raises(ZeroDivisionError):
        with Benchmark("fails"):
            1 / 0
    assert capsys.readouterr().out == ""


def test_format_table_aligns_and_names_hardware():
    t = Timing("x", 0.002, 0.0001, 10, "hw")
    text = format_table([{"variant": "eager", "time": t, "ratio": 1.0}, {"variant": "compiled", "time": t, "ratio": 2.345}], title="T")
    lines = text.splitlines()
    assert lines[0] == "T"
    assert lines[1].split() == ["variant", "time", "ratio"]
    assert "2 ms" in lines[3] and "2.35" in lines[4]
    assert lines[-1].startswith("Measured on: ")
