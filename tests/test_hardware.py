"""Tests of companion.hardware: the clock, the peak estimate, measured limits."""

from __future__ import annotations

import math

import psutil
import pytest
import torch

from companion import hardware
from companion.hardware import (
    FP32_FLOPS_PER_CYCLE,
    UNKNOWN,
    MachineLimits,
    PeakEstimate,
    bf16_matmul_support,
    bf16_matmul_units,
    cpu_flags,
    estimate_cpu_peak,
    measure_bandwidth,
    measure_limits,
    measure_matmul_gflops,
    read_cpu_clock,
)
from companion.harness.devices import cpu_count
from companion.harness.timing import Timing


def test_read_cpu_clock_prefers_sysfs_then_cpuinfo(tmp_path):
    cpufreq = tmp_path / "cpuinfo_max_freq"
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Test CPU\ncpu MHz\t\t: 2600.000\n"
    )
    assert read_cpu_clock(cpufreq, cpuinfo) == (2.6, "current clock from /proc/cpuinfo")
    cpufreq.write_text("3500000\n")
    assert read_cpu_clock(cpufreq, cpuinfo) == (3.5, "maximum clock from sysfs")
    clock, why = read_cpu_clock(tmp_path / "none", tmp_path / "none")
    assert (clock, why) == (None, "the CPU clock could not be read on this system")
    cpufreq.write_text("0\n")  # no frequency scaling information: use cpuinfo
    assert read_cpu_clock(cpufreq, cpuinfo) == (2.6, "current clock from /proc/cpuinfo")
    cpuinfo.write_text("cpu MHz\t\t: 0.000\n")
    assert read_cpu_clock(cpufreq, cpuinfo)[0] is None


@pytest.mark.parametrize(
    "capability, expected",
    [
        ((7, 0), None),  # a V100: is_bf16_supported() says True, by emulation
        ((7, 5), None),  # a T4, the same
        ((8, 0), "tensor cores (compute capability 8.0)"),  # an A100
        ((9, 0), "tensor cores (compute capability 9.0)"),  # an H100
    ],
)
def test_bf16_units_of_a_gpu_follow_its_compute_capability(
    capability, expected, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert bf16_matmul_units("cuda:0") == expected


def test_bf16_units_of_a_cpu_are_its_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512_bf16\n")
    assert bf16_matmul_units("cpu", cpuinfo) == "avx512_bf16"
    cpuinfo.write_text("flags\t\t: fpu avx2\n")
    assert bf16_matmul_units(torch.device("cpu"), cpuinfo) is None
    assert bf16_matmul_units("cpu", tmp_path / "none") == UNKNOWN
    assert bf16_matmul_units("meta") == UNKNOWN


def test_cpu_flags_and_bf16_support(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16 amx_bf16\nbugs\t\t: "
        "spectre_v1\n"
    )
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512_bf16", "amx_bf16"}
    assert (
        bf16_matmul_support(cpuinfo) == "amx_bf16"
    )  # AMX first: it is the faster path
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512_bf16\n")
    assert bf16_matmul_support(cpuinfo) == "avx512_bf16"
    cpuinfo.write_text("flags\t\t: fpu avx2\n")
    assert bf16_matmul_support(cpuinfo) is None
    # Arm lists its extensions on a Features line: Graviton 3 has bf16, Graviton 2 not.
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd sve i8mm bf16\n")
    assert bf16_matmul_support(cpuinfo) == "bf16"
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd atomics\n")
    assert bf16_matmul_support(cpuinfo) is None
    # macOS and Windows have no /proc/cpuinfo: not "none", but unknown.
    assert cpu_flags(tmp_path / "none") is None
    assert bf16_matmul_support(tmp_path / "none") == UNKNOWN


def test_estimate_cpu_peak_arithmetic(tmp_path):
    intel = tmp_path / "cpuinfo"
    intel.write_text("vendor_id\t: GenuineIntel\ncpu family\t: 6\n")
    peak = estimate_cpu_peak(cores=2, clock_ghz=2.5, isa="AVX512", cpuinfo=intel)
    assert peak.gflops == pytest.approx(2 * 2.5 * 64)
    assert "320 GFLOP/s = 2 cores x 2.50 GHz x 64 FLOP/cycle (AVX512" in str(peak)
    assert estimate_cpu_peak(
        cores=4, clock_ghz=3.0, isa="AVX2"
    ).gflops == pytest.approx(384)


@pytest.mark.parametrize(
    "vendor, family, isa, flops",
    [
        ("AuthenticAMD", 25, "AVX512", 32),  # Zen 4: two 256-bit halves
        ("AuthenticAMD", 26, "AVX512", 64),  # Zen 5: full 512-bit units
        ("GenuineIntel", 6, "AVX512", 64),
        ("AuthenticAMD", 25, "AVX2", 32),  # Zen 3
    ],
)
def test_estimate_cpu_peak_halves_avx512_on_zen4(tmp_path, vendor, family, isa, flops):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\n\n"
        "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n"
    )
    peak = estimate_cpu_peak(cores=1, clock_ghz=1.0, isa=isa, cpuinfo=cpuinfo)
    assert peak.flops_per_cycle == flops
    assert ("Zen 4" in str(peak)) == (flops == 32 and isa == "AVX512")
    missing = estimate_cpu_peak(cores=1, clock_ghz=1.0, isa=isa, cpuinfo=tmp_path / "x")
    assert missing.flops_per_cycle == FP32_FLOPS_PER_CYCLE[isa]


def test_estimate_cpu_peak_says_when_unknown():
    unknown_isa = estimate_cpu_peak(cores=2, clock_ghz=2.5, isa="DEFAULT")
    assert unknown_isa.gflops is None and "'DEFAULT'" in str(unknown_isa)
    no_clock = PeakEstimate(2, None, 64, "AVX512", "the CPU clock could not be read")
    assert no_clock.gflops is None and str(no_clock).startswith(
        "unknown: the CPU clock"
    )
    with pytest.raises(ValueError, match="at least one core"):
        estimate_cpu_peak(cores=0)
    with pytest.raises(ValueError, match="must be positive"):
        estimate_cpu_peak(clock_ghz=-1.0)
    with pytest.raises(ValueError, match="must be positive"):
        estimate_cpu_peak(clock_ghz=0.0)
    assert estimate_cpu_peak(cores=1, clock_ghz=1.0, isa="AVX2").gflops == 32


def test_estimate_cpu_peak_on_this_machine():
    peak = estimate_cpu_peak()
    assert 1 <= peak.cores <= cpu_count()
    assert peak.isa == torch.backends.cpu.get_cpu_capability()
    assert peak.gflops is None or peak.gflops > 0


@pytest.mark.parametrize(
    "usable, physical, cores",
    [(8, 4, 4), (2, 16, 2), (8, None, 8)],
    ids=["smt", "affinity", "unknown"],
)
def test_estimate_cpu_peak_detects_cores_clock_and_isa(
    monkeypatch, usable, physical, cores
):
    # SMT siblings share the FMA units: count physical cores, within those this
    # process may use.
    monkeypatch.setattr(hardware, "cpu_count", lambda: usable)
    monkeypatch.setattr(
        psutil,
        "cpu_count",
        lambda logical=True: physical if logical is False else 2 * usable,
    )
    monkeypatch.setattr(hardware, "read_cpu_clock", lambda: (2.0, "from the test"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    peak = estimate_cpu_peak()
    assert (peak.cores, peak.clock_ghz, peak.isa, peak.clock_source) == (
        cores,
        2.0,
        "AVX2",
        "from the test",
    )
    assert peak.gflops == cores * 2.0 * 32
    assert (
        estimate_cpu_peak(cores=3, clock_ghz=1.5).clock_source
        == "clock given by the caller"
    )


@pytest.fixture
def timed(monkeypatch):
    """Replace companion.hardware's benchmark: every call "takes" 1 ms; the calls are recorded."""
    calls = []

    def fake_benchmark(fn, *args, **kwargs):
        calls.append((fn, args, kwargs))
        return Timing("fake", 1e-3, 0.0, 7, "test machine")

    monkeypatch.setattr(hardware, "benchmark", fake_benchmark)
    return calls


def test_matmul_gflops_counts_two_n_cubed_flops(timed):
    # 2 x 100^3 = 2e6 FLOPs in 1 ms: 2 GFLOP/s.
    assert measure_matmul_gflops(100, min_run_time=0.5, num_threads=3) == pytest.approx(
        2.0, rel=1e-12
    )
    ((fn, (a, b), kwargs),) = timed
    assert fn is torch.mm and a.shape == b.shape == (100, 100)
    assert kwargs["out"].shape == (100, 100)
    measure_matmul_gflops(
        4, device="meta"
    )  # the tensors are made on the device asked for
    assert {t.device.type for t in (*timed[1][1], timed[1][2]["out"])} == {"meta"}
    assert (kwargs["min_run_time"], kwargs["num_threads"]) == (0.5, 3)


def test_bandwidth_is_the_best_of_copy_and_add_counting_bytes_read_and_written(timed):
    # Each call "takes" 1 ms. A copy of 4,000-byte buffers moves 8,000 bytes
    # (8e-3 GB/s), an add 12,000 (12e-3 GB/s): the add's is the bandwidth.
    assert measure_bandwidth(4000, min_run_time=0.5) == pytest.approx(12e-3)
    (copy_fn, (src,), copy_kwargs), (add_fn, (a, b), add_kwargs) = timed
    assert src.nbytes == 4000 and copy_fn.__self__.shape == src.shape
    assert (
        add_fn is torch.add
        and a.nbytes == b.nbytes == 4000
        and add_kwargs["out"].shape == a.shape
    )
    assert copy_kwargs["min_run_time"] == add_kwargs["min_run_time"] == 0.5
    assert measure_bandwidth(4003) == pytest.approx(12e-3)  # whole float32s only
    assert measure_bandwidth(4) == pytest.approx(12e-6)


def test_bandwidth_takes_the_copy_when_it_is_faster(monkeypatch):
    def fake_benchmark(fn, *args, **kwargs):
        seconds = 1e-3 if kwargs["label"] == "copy" else 3e-3  # the add is slow here
        return Timing("fake", seconds, 0.0, 7, "test machine")

    monkeypatch.setattr(hardware, "benchmark", fake_benchmark)
    assert measure_bandwidth(4000) == pytest.approx(8e-3)


def test_measurements_are_positive_rates():
    gflops = measure_matmul_gflops(128, min_run_time=0.02)
    gbs = measure_bandwidth(2**20, min_run_time=0.02)
    assert math.isfinite(gflops) and gflops > 0
    assert math.isfinite(gbs) and gbs > 0
    with pytest.raises(ValueError, match="positive"):
        measure_matmul_gflops(0)
    with pytest.raises(ValueError, match="at least 4 bytes"):
        measure_bandwidth(3)
    assert (
        measure_matmul_gflops(1, min_run_time=0.01) > 0
    )  # the smallest sizes are allowed


def test_measure_limits_uses_the_measurements(monkeypatch):
    seen = []

    def gflops(n, *, device, min_run_time):
        seen.append(("matmul", n, device, min_run_time))
        return 150.0

    def gbs(nbytes, *, device, min_run_time):
        seen.append(("copy", nbytes, device, min_run_time))
        return 12.0

    monkeypatch.setattr(hardware, "measure_matmul_gflops", gflops)
    monkeypatch.setattr(hardware, "measure_bandwidth", gbs)
    monkeypatch.setattr(
        hardware,
        "estimate_cpu_peak",
        lambda: PeakEstimate(2, 2.5, 64, "AVX512", "given"),
    )
    monkeypatch.setattr(hardware, "describe_hardware", lambda: "the test machine")
    limits = measure_limits(n=64, nbytes=2**21, min_run_time=0.1)
    cpu = torch.device("cpu")
    assert seen == [("matmul", 64, cpu, 0.1), ("copy", 2**21, cpu, 0.1)]
    assert (limits.device, limits.matmul_gflops, limits.matmul_size) == (
        "cpu",
        150.0,
        64,
    )
    assert (limits.bandwidth_gbs, limits.copy_bytes) == (12.0, 2**21)
    assert limits.hardware == "the test machine"
    assert limits.peak_fraction == pytest.approx(150 / 320)
    assert str(limits).splitlines()[:4] == [
        "fp32 matmul (64 x 64): 150 GFLOP/s",
        "memory bandwidth (best of copy and add, 2 MiB buffers): 12 GB/s",
        (
            "peak fp32 estimate: 320 GFLOP/s = 2 cores x 2.50 GHz x 64 FLOP/cycle "
            "(AVX512, two FMA units assumed; given)"
        ),
        "matmul reaches 0.47× the estimated peak",
    ]
    # On an accelerator the peak is not estimated (the tensors are never made here).
    assert measure_limits("meta", n=64).peak is None


def test_measure_limits_and_compare():
    limits = measure_limits(n=128, nbytes=2**20, min_run_time=0.02)
    text = str(limits)
    assert (
        "fp32 matmul (128 x 128)" in text
        and "best of copy and add, 1 MiB buffers" in text
    )
    assert text.splitlines()[-1].startswith("Measured on: ")
    if limits.peak is not None and limits.peak.gflops is not None:
        assert limits.peak_fraction == pytest.approx(
            limits.matmul_gflops / limits.peak.gflops
        )


def test_compare_against_limits():
    limits = MachineLimits(
        device="cpu",
        matmul_gflops=200.0,
        matmul_size=2048,
        bandwidth_gbs=20.0,
        copy_bytes=2**28,
        peak=PeakEstimate(2, 2.5, 64, "AVX512", "given"),
        hardware="test",
    )
    assert limits.peak_fraction == pytest.approx(200 / 320)
    assert limits.compare(100.0) == (
        "100 GFLOP/s is 0.50× the matmul rate (0.31× the estimated peak) of this "
        "machine."
    )
    assert (
        limits.compare(gbs=5.0)
        == "5 GB/s is 0.25× the memory bandwidth of this machine."
    )
    with pytest.raises(
        ValueError, match=r"^Give an achieved gflops or gbs to compare\.$"
    ):
        limits.compare()
    assert limits.compare(50.0, 40.0) == (
        "50 GFLOP/s is 0.25× the matmul rate (0.16× the estimated peak); "
        "40 GB/s is 2.00× the memory bandwidth of this machine."
    )
    no_peak = MachineLimits("cuda:0", 200.0, 2048, 20.0, 2**28, None, "test")
    assert no_peak.peak_fraction is None
    assert (
        str(no_peak).splitlines()[2]
        == "peak fp32: not estimated on an accelerator (see its datasheet)"
    )
    assert (
        no_peak.compare(100.0)
        == "100 GFLOP/s is 0.50× the matmul rate of this machine."
    )
    unknown = MachineLimits(
        "cpu",
        200.0,
        2048,
        20.0,
        2**28,
        PeakEstimate(2, None, 64, "AVX512", "no clock"),
        "test",
    )
    assert unknown.peak_fraction is None
    assert (
        unknown.compare(100.0)
        == "100 GFLOP/s is 0.50× the matmul rate of this machine."
    )
    assert str(unknown).splitlines()[2:] == [
        "peak fp32 estimate: unknown: no clock",
        "matmul vs peak: unknown, only measured numbers are reported",
        "Measured on: test",
    ]


def fake_cache(
    root, cpu: int, index: int, level: int, kind: str, size: str, shared: str
):
    folder = root / f"cpu{cpu}" / "cache" / f"index{index}"
    folder.mkdir(parents=True)
    fields = {"level": level, "type": kind, "size": size, "shared_cpu_list": shared}
    for name, value in fields.items():
        (folder / name).write_text(f"{value}\n")


def test_cache_bytes_adds_every_data_level_once_over_the_cpus_it_may_use(
    tmp_path, monkeypatch
):
    # Four CPUs, each with its own L1d and L2, on two dies of 32 MiB L3 each;
    # CPU 3 is not this process's; instruction caches do not count.
    for cpu in range(4):
        fake_cache(tmp_path, cpu, 0, 1, "Data", "48K", str(cpu))
        fake_cache(tmp_path, cpu, 1, 1, "Instruction", "32K", str(cpu))
        fake_cache(tmp_path, cpu, 2, 2, "Unified", "1024K", str(cpu))
        fake_cache(
            tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3"
        )
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    per_core = 48 * 2**10 + 2**20
    assert hardware.cache_bytes("cpu", tmp_path) == 3 * per_core + 64 * 2**20
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {1})
    assert hardware.cache_bytes("cpu", tmp_path) == per_core + 32 * 2**20
    assert hardware.cache_bytes("cpu", tmp_path / "missing") is None


def test_cache_bytes_skips_a_level_it_cannot_read(tmp_path, monkeypatch):
    fake_cache(tmp_path, 0, 0, 1, "Data", "48K", "0")
    fake_cache(tmp_path, 0, 1, 2, "Unified", "not a size", "0")
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0})
    assert hardware.cache_bytes("cpu", tmp_path) == 48 * 2**10


def test_cache_bytes_of_this_machine_is_a_plausible_size():
    size = hardware.cache_bytes()
    assert size is None or 2**18 <= size <= 2**33
