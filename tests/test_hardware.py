"""Tests of companion.hardware: the clock, the peak estimate, measured limits."""

from __future__ import annotations

import math

import pytest

from companion.hardware import (
    MachineLimits,
    PeakEstimate,
    estimate_cpu_peak,
    measure_bandwidth,
    measure_limits,
    measure_matmul_gflops,
    read_cpu_clock,
)


def test_read_cpu_clock_prefers_sysfs_then_cpuinfo(tmp_path):
    cpufreq = tmp_path / "cpuinfo_max_freq"
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU\ncpu MHz\t\t: 2600.000\n")
    assert read_cpu_clock(cpufreq, cpuinfo) == (2.6, "current clock from /proc/cpuinfo")
    cpufreq.write_text("3500000\n")
    assert read_cpu_clock(cpufreq, cpuinfo) == (3.5, "maximum clock from sysfs")
    clock, why = read_cpu_clock(tmp_path / "none", tmp_path / "none")
    assert clock is None and "could not be read" in why


def test_estimate_cpu_peak_arithmetic():
    peak = estimate_cpu_peak(cores=2, clock_ghz=2.5, isa="AVX512")
    assert peak.gflops == pytest.approx(2 * 2.5 * 64)
    assert "320 GFLOP/s = 2 cores x 2.50 GHz x 64 FLOP/cycle (AVX512" in str(peak)
    assert estimate_cpu_peak(cores=4, clock_ghz=3.0, isa="AVX2").gflops == pytest.approx(384)


def test_estimate_cpu_peak_says_when_unknown():
    unknown_isa = estimate_cpu_peak(cores=2, clock_ghz=2.5, isa="DEFAULT")
    assert unknown_isa.gflops is None and "'DEFAULT'" in str(unknown_isa)
    no_clock = PeakEstimate(2, None, 64, "AVX512", "the CPU clock could not be read")
    assert no_clock.gflops is None and str(no_clock).startswith("unknown: the CPU clock")
    with pytest.raises(ValueError, match="at least one core"):
        estimate_cpu_peak(cores=0)
    with pytest.raises(ValueError, match="must be positive"):
        estimate_cpu_peak(clock_ghz=-1.0)


def test_estimate_cpu_peak_on_this_machine():
    peak = estimate_cpu_peak()
    assert peak.cores >= 1
    assert peak.gflops is None or peak.gflops > 0


def test_measurements_are_positive_rates():
    gflops = measure_matmul_gflops(128, min_run_time=0.02)
    gbs = measure_bandwidth(2**20, min_run_time=0.02)
    assert math.isfinite(gflops) and gflops > 0
    assert math.isfinite(gbs) and gbs > 0
    with pytest.raises(ValueError, match="positive"):
        measure_matmul_gflops(0)
    with pytest.raises(ValueError, match="at least 4 bytes"):
        measure_bandwidth(2)


def test_measure_limits_and_compare():
    limits = measure_limits(n=128, nbytes=2**20, min_run_time=0.02)
    text = str(limits)
    assert "fp32 matmul (128 x 128)" in text and "copy of 1 MiB" in text
    assert text.splitlines()[-1].startswith("Measured on: ")
    if limits.peak is not None and limits.peak.gflops is not None:
        assert limits.peak_fraction == pytest.approx(limits.matmul_gflops / limits.peak.gflops)


def test_compare_against_limits():
    limits = MachineLimits(
        device="cpu", matmul_gflops=200.0, matmul_size=2048, bandwidth_gbs=20.0,
        copy_bytes=2**28, peak=PeakEstimate(2, 2.5, 64, "AVX512", "given"), hardware="test",
    )
    assert limits.peak_fraction == pytest.approx(200 / 320)
    assert limits.compare(100.0) == (
        "100 GFLOP/s is 0.50x the matmul rate and 0.31x the estimated peak of this machine."
    )
    assert limits.compare(gbs=5.0) == "5 GB/s is 0.25x the copy bandwidth of this machine."
    with pytest.raises(ValueError, match="Give an achieved"):
        limits.compare()
    no_peak = MachineLimits("cuda:0", 200.0, 2048, 20.0, 2**28, None, "test")
    assert no_peak.peak_fraction is None and "not estimated" in str(no_peak)
