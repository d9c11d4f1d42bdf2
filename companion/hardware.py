"""The machine's limits: fp32 matmul throughput, memory bandwidth, peak FLOP/s.

Chapter 06 measures them; later chapters compare what they achieve against
them ("the training step ran at 0.40× this machine's matmul rate"):

>>> limits = measure_limits()
>>> print(limits)                 # the three numbers, and where they came from
>>> print(limits.compare(95.0))   # an achieved GFLOP/s against the limits

The CPU's peak is an estimate, cores x clock x FLOPs per cycle, where the
FLOPs per cycle follow from the vector instructions PyTorch uses
(``torch.backends.cpu.get_cpu_capability()``) and assume two fused
multiply-add units per core. When the clock or the FLOPs per cycle cannot be
known, the estimate says so and only measured numbers are reported.
Used in chapter 06 and cited by the chapters after it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from companion.harness.devices import cpu_count, describe_hardware
from companion.harness.timing import benchmark, format_ratio

__all__ = [
    "BF16_MATMUL_FLAGS",
    "UNKNOWN",
    "FP32_FLOPS_PER_CYCLE",
    "bf16_matmul_support",
    "bf16_matmul_units",
    "cpu_flags",
    "cache_bytes",
    "PeakEstimate",
    "MachineLimits",
    "read_cpu_clock",
    "estimate_cpu_peak",
    "measure_matmul_gflops",
    "measure_bandwidth",
    "measure_limits",
]

# fp32 FLOPs per core per clock cycle for PyTorch's CPU capability levels,
# assuming two fused multiply-add (FMA) units per core: 2 units x lanes x 2
# FLOPs (a multiply and an add). AVX-512: 16 fp32 lanes; AVX2: 8. Some
# AVX-512 CPUs have only one 512-bit FMA unit, and then the true peak is half:
# AMD's Zen 4 (family 0x19) runs each 512-bit FMA in two 256-bit halves, and
# ``estimate_cpu_peak`` counts 32 there; some Xeon Silver and Bronze parts have
# one 512-bit unit, which /proc/cpuinfo does not say.
FP32_FLOPS_PER_CYCLE = {"AVX512": 64, "AVX2": 32}

# CPU flags (as /proc/cpuinfo names them) of instructions that multiply
# bfloat16 matrices natively: Intel's AMX tiles and AVX-512 BF16 dot products
# on x86, the BF16 extension (BFMMLA) on Arm. Without any of them, PyTorch
# converts bfloat16 to float32 and back around the work.
BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
UNKNOWN = (
    "unknown"  # what bf16_matmul_support says where the CPU's flags cannot be read
)

_CPUFREQ_MAX = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"
_CPUINFO = "/proc/cpuinfo"
_CPU_SYSFS = "/sys/devices/system/cpu"


def cpu_flags(cpuinfo: str | Path = _CPUINFO) -> set[str] | None:
    """Return the CPU's feature flags from ``/proc/cpuinfo``, or None where there are none.

    x86 lists them on ``flags`` lines, Arm on ``Features`` lines; macOS and
    Windows have no ``/proc/cpuinfo``.
    """
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def bf16_matmul_support(cpuinfo: str | Path = _CPUINFO) -> str | None:
    """Return the first of ``BF16_MATMUL_FLAGS`` this CPU has, None, or ``UNKNOWN``.

    ``UNKNOWN`` where the flags cannot be read: a verdict that depends on
    them then says it was not judged. Used in chapters 01 and 12 to say
    whether bfloat16 matrix products should be faster than float32 ones.
    """
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return UNKNOWN
    return next((flag for flag in BF16_MATMUL_FLAGS if flag in flags), None)


def bf16_matmul_units(
    device: torch.device | str, cpuinfo: str | Path = _CPUINFO
) -> str | None:
    """Say what multiplies bfloat16 matrices natively on ``device``: None if nothing.

    One rule for both kinds of device. A GPU has bfloat16 tensor cores from
    compute capability 8.0 (NVIDIA's Ampere) on; ``torch.cuda.is_bf16_supported()``
    is no test of that, since it also says True where bfloat16 is only
    emulated (a V100 or a T4). A CPU has them when its flags list one of
    ``BF16_MATMUL_FLAGS`` (``bf16_matmul_support``, ``UNKNOWN`` where the
    flags cannot be read); any other device is ``UNKNOWN``. Used in chapter
    12, with the rule of chapter 01.
    """
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            return None
        return f"tensor cores (compute capability {major}.{minor})"
    if device.type == "cpu":
        return bf16_matmul_support(cpuinfo)
    return UNKNOWN


def read_cpu_clock(
    cpufreq_max: str | Path = _CPUFREQ_MAX, cpuinfo: str | Path = _CPUINFO
) -> tuple[float | None, str]:
    """Return the CPU clock in GHz and where it was read, or ``(None, why)``.

    The maximum frequency from sysfs (what ``lscpu`` shows as "CPU max MHz")
    comes first; else the "cpu MHz" line of ``/proc/cpuinfo``, which under a
    hypervisor is usually the nominal clock (cores may run faster in turbo).
    """
    try:
        khz = float(Path(cpufreq_max).read_text().strip())
        if khz > 0:
            return khz / 1e6, "maximum clock from sysfs"
    except (OSError, ValueError):
        pass
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("cpu mhz"):
                    mhz = float(line.split(":", 1)[1])
                    if mhz > 0:
                        return mhz / 1e3, "current clock from /proc/cpuinfo"
    except (OSError, ValueError, IndexError):
        pass
    return None, "the CPU clock could not be read on this system"


def _cache_size_bytes(text: str) -> int:
    """sysfs's cache size, such as ``32768K``, in bytes."""
    text = text.strip()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def cache_bytes(
    device: torch.device | str = "cpu", sysfs: str | Path = _CPU_SYSFS
) -> int | None:
    """The caches' total that data can stay in: a GPU's L2, or on Linux every
    data or unified cache level of the CPUs this process may run on, each
    separate cache counted once (a chip of several dies has an L3 per die).
    The levels are added up because most CPUs' caches are not inclusive: an
    L3 holds lines the L2s do not. ``None`` where it cannot be read (macOS,
    Windows). AMD's GPUs report their L2 alone, without the Infinity Cache."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    if device.type != "cpu":
        return None
    caches: dict[tuple[str, str], int] = {}  # (level, CPUs sharing it) -> bytes
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    for cpu in cpus:
        for index in Path(sysfs, f"cpu{cpu}", "cache").glob("index*"):
            try:
                if (index / "type").read_text().strip() == "Instruction":
                    continue
                level = (index / "level").read_text().strip()
                shared = (index / "shared_cpu_list").read_text().strip()
                caches[level, shared] = _cache_size_bytes((index / "size").read_text())
            except (OSError, ValueError):
                continue
    return sum(caches.values()) or None


def _physical_cores() -> int:
    """Cores this process may use, not counting SMT siblings (they share FMA units)."""
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except ImportError:
        physical = None
    return min(cpu_count(), physical) if physical else cpu_count()


def _halves_512_bit_fma(cpuinfo: str | Path = _CPUINFO) -> bool:
    """Whether this CPU is an AMD Zen 4, whose AVX-512 FMAs take two 256-bit passes.

    Zen 3 shares Zen 4's family number but has no AVX-512, so the caller asks
    only when the ISA is AVX-512.
    """
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return False
    # family 25 (0x19): Zen 3 and Zen 4
    return (fields.get("vendor_id"), fields.get("cpu family")) == ("AuthenticAMD", "25")


@dataclass(frozen=True)
class PeakEstimate:
    """The CPU's fp32 peak as cores x clock x FLOPs per cycle, or why it is unknown."""

    cores: int
    clock_ghz: float | None
    flops_per_cycle: int | None
    isa: str  # PyTorch's CPU capability, e.g. "AVX512"
    clock_source: str  # where the clock came from, or why it is unknown
    fma_units: str = "two FMA units assumed"  # what flops_per_cycle assumes

    @property
    def gflops(self) -> float | None:
        """The estimated peak in GFLOP/s, or None when it cannot be known."""
        if self.clock_ghz is None or self.flops_per_cycle is None:
            return None
        return self.cores * self.clock_ghz * self.flops_per_cycle

    def __str__(self) -> str:
        if self.clock_ghz is None:
            return f"unknown: {self.clock_source}"
        if self.flops_per_cycle is None:
            return f"unknown: no FLOPs-per-cycle figure for the vector ISA {self.isa!r}"
        return (
            f"{self.gflops:.0f} GFLOP/s = {self.cores} cores x {self.clock_ghz:.2f} "
            "GHz x "
            f"{self.flops_per_cycle} FLOP/cycle ({self.isa}, {self.fma_units}; "
            f"{self.clock_source})"
        )


def estimate_cpu_peak(
    *,
    cores: int | None = None,
    clock_ghz: float | None = None,
    isa: str | None = None,
    cpuinfo: str | Path = _CPUINFO,
) -> PeakEstimate:
    """Estimate the CPU's fp32 peak; arguments override what is detected.

    Args:
        cores: physical cores (default: those this process may use).
        clock_ghz: clock in GHz (default: ``read_cpu_clock()``).
        isa: PyTorch's CPU capability (default: ``torch.backends.cpu.get_cpu_capability()``).
        cpuinfo: where the CPU's vendor and family are read (an AMD Zen 4
            runs AVX-512 at half the FLOPs per cycle of two 512-bit units).
    """
    if cores is not None and cores < 1:
        raise ValueError(f"A CPU has at least one core, not {cores}.")
    if clock_ghz is not None and clock_ghz <= 0:
        raise ValueError(f"The clock must be positive, not {clock_ghz} GHz.")
    source = "clock given by the caller"
    if clock_ghz is None:
        clock_ghz, source = read_cpu_clock()
    isa = isa or torch.backends.cpu.get_cpu_capability()
    flops, units = FP32_FLOPS_PER_CYCLE.get(isa), "two FMA units assumed"
    if isa == "AVX512" and _halves_512_bit_fma(cpuinfo):
        flops, units = 32, "AMD Zen 4: 512-bit FMAs in two 256-bit halves"
    return PeakEstimate(
        cores=cores or _physical_cores(),
        clock_ghz=clock_ghz,
        flops_per_cycle=flops,
        isa=isa,
        clock_source=source,
        fma_units=units,
    )


def measure_matmul_gflops(
    n: int = 2048,
    *,
    device: torch.device | str = "cpu",
    min_run_time: float = 0.3,
    num_threads: int | None = None,
) -> float:
    """Measure fp32 ``n x n`` matrix-multiply throughput in GFLOP/s (2 n^3 FLOPs a call).

    Args:
        n: matrix size; large matrices come closest to the peak.
        device: where to multiply.
        min_run_time: seconds spent measuring, at least.
        num_threads: intra-op CPU threads (default: the current setting).
    """
    if n < 1:
        raise ValueError(f"The matrix size must be positive, not {n}.")
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    timing = benchmark(
        torch.mm,
        a,
        b,
        out=out,
        label="matmul",
        min_run_time=min_run_time,
        num_threads=num_threads,
    )
    return 2 * n**3 / timing.median / 1e9


def measure_bandwidth(
    nbytes: int = 2**27,
    *,
    device: torch.device | str = "cpu",
    min_run_time: float = 0.3,
) -> float:
    """Measure memory bandwidth in GB/s: the best of a copy and an add on ``nbytes`` buffers.

    As the STREAM benchmark does, bytes read plus bytes written are counted:
    2 x ``nbytes`` per copy (``dst = src``), 3 x ``nbytes`` per add
    (``out = a + b``). The faster of the two is the bandwidth: simple kernels
    differ in how well they stream, and a limit that another simple kernel
    beats is no limit. Use buffers much larger than the caches (the default,
    128 MiB each, exceeds the last-level cache of most CPUs), or the number
    measures the caches.
    """
    if nbytes < 4:
        raise ValueError(f"Copy at least 4 bytes (one float32), not {nbytes}.")
    a = torch.ones(nbytes // 4, device=device)
    b = torch.ones_like(a)
    out = torch.empty_like(a)
    copy = benchmark(out.copy_, a, label="copy", min_run_time=min_run_time)
    add = benchmark(torch.add, a, b, out=out, label="add", min_run_time=min_run_time)
    return max(2 * a.nbytes / copy.median, 3 * a.nbytes / add.median) / 1e9


@dataclass(frozen=True)
class MachineLimits:
    """Measured matmul throughput and bandwidth, and (on a CPU) the estimated peak."""

    device: str
    matmul_gflops: float  # measured fp32 matmul throughput
    matmul_size: int  # n of the n x n matrices
    bandwidth_gbs: float  # measured bandwidth, best of copy and add, read + write
    copy_bytes: int  # size of each buffer the bandwidth was measured on
    peak: PeakEstimate | None  # None on accelerators
    hardware: str

    @property
    def peak_fraction(self) -> float | None:
        """Measured matmul throughput as a fraction of the estimated peak, if known."""
        if self.peak is None or self.peak.gflops is None:
            return None
        return self.matmul_gflops / self.peak.gflops

    def compare(self, gflops: float | None = None, gbs: float | None = None) -> str:
        """Say how close an achieved GFLOP/s and/or GB/s come to these limits."""
        parts = []
        if gflops is not None:
            text = f"{gflops:.3g} GFLOP/s is {format_ratio(gflops / self.matmul_gflops)} the matmul rate"
            if self.peak is not None and self.peak.gflops is not None:
                text += (
                    f" ({format_ratio(gflops / self.peak.gflops)} the estimated peak)"
                )
            parts.append(text)
        if gbs is not None:
            parts.append(
                f"{gbs:.3g} GB/s is {format_ratio(gbs / self.bandwidth_gbs)} the "
                "memory bandwidth"
            )
        if not parts:
            raise ValueError("Give an achieved gflops or gbs to compare.")
        return "; ".join(parts) + " of this machine."

    def __str__(self) -> str:
        lines = [
            (
                f"fp32 matmul ({self.matmul_size} x {self.matmul_size}): "
                f"{self.matmul_gflops:.3g} GFLOP/s"
            ),
            (
                "memory bandwidth (best of copy and add, "
                f"{self.copy_bytes / 2**20:.0f} "
                "MiB buffers): "
                f"{self.bandwidth_gbs:.3g} GB/s"
            ),
        ]
        if self.peak is None:
            lines.append(
                "peak fp32: not estimated on an accelerator (see its datasheet)"
            )
        else:
            lines.append(f"peak fp32 estimate: {self.peak}")
            if self.peak_fraction is not None:
                lines.append(
                    f"matmul reaches {format_ratio(self.peak_fraction)} the estimated "
                    "peak"
                )
            else:
                lines.append(
                    "matmul vs peak: unknown, only measured numbers are reported"
                )
        lines.append(f"Measured on: {self.hardware}")
        return "\n".join(lines)


def measure_limits(
    device: torch.device | str = "cpu",
    *,
    n: int = 2048,
    nbytes: int = 2**27,
    min_run_time: float = 0.3,
) -> MachineLimits:
    """Measure matmul throughput and memory bandwidth on ``device`` (about 3 s).

    On a CPU the peak is estimated too; on an accelerator it is left out.
    """
    device = torch.device(device)
    return MachineLimits(
        device=str(device),
        matmul_gflops=measure_matmul_gflops(
            n, device=device, min_run_time=min_run_time
        ),
        matmul_size=n,
        bandwidth_gbs=measure_bandwidth(
            nbytes, device=device, min_run_time=min_run_time
        ),
        copy_bytes=nbytes,
        peak=estimate_cpu_peak() if device.type == "cpu" else None,
        hardware=describe_hardware(),
    )
