"""Honest timing: warm-up, device synchronisation, repeats, median and spread.

``benchmark`` times blocks of calls the way ``torch.utils.benchmark.Timer``
does (Python's ``timeit`` with a clock that synchronises the accelerator, a
set number of intra-op threads) and reports the median over the blocks.
``Benchmark`` is a d2l-style context manager for one-off timings of a block.
Every result carries the hardware it was measured on. Used in chapters 05 to 11.
"""

from __future__ import annotations

import math
import statistics
import time
import timeit
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from companion.harness.devices import describe_hardware

__all__ = [
    "Timing",
    "Benchmark",
    "OtherLoad",
    "benchmark",
    "benchmark_interleaved",
    "format_ratio",
    "format_time",
    "format_table",
    "median_interval",
    "paired_difference",
    "synchronize",
]

# McGill, Tukey and Larsen (1978): a box plot's notch, median ± 1.57 IQR / √n.
# Two medians whose notches do not overlap differ at about the 5% level; for
# one median of n values it is roughly a 90% interval.
NOTCH = 1.57


def synchronize() -> None:
    """Wait until every queued accelerator kernel has finished (no-op on a CPU)."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def format_time(seconds: float) -> str:
    """Format a duration with a unit that keeps 3 significant digits: ``12.3 ms``.

    A negative one (a difference of two times) keeps its sign: ``-2.73 ms``.
    """
    if not math.isfinite(seconds):
        return "n/a"
    if seconds < 0:
        return f"-{format_time(-seconds)}"
    seconds = float(f"{seconds:.3g}")  # 999.7 us rounds to 1 ms, not "1e+03 us"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_ratio(ratio: float, digits: int = 2) -> str:
    """Format a *measured* ratio with the multiplication sign: ``1.62×``.

    The course writes measured ratios with ``×`` and constants (a target, a
    bound in a claim) with ``x``, so that the notebook checks can mask the
    first, which vary between machines, and compare the second. From 100 up,
    three significant digits (``5170×``): more would claim a precision that
    no timing has.
    """
    if not math.isfinite(ratio):
        return "n/a"
    if abs(ratio) >= 100:
        return f"{float(f'{ratio:.3g}'):.0f}×"
    return f"{ratio:.{digits}f}×"


@dataclass(frozen=True)
class Timing:
    """A measured duration: median and interquartile range over ``runs`` runs."""

    label: str
    median: float  # seconds per call
    iqr: float  # seconds, interquartile range of the per-call times
    runs: int  # timed blocks the median is over
    hardware: str
    threads: int = 0  # intra-op threads while timing (0: not recorded)

    @classmethod
    def from_samples(
        cls, label: str, seconds: Sequence[float], *, threads: int | None = None
    ) -> Timing:
        """Summarise repeated measurements (e.g. one per epoch) as a median and IQR."""
        if not seconds:
            raise ValueError(f"No measurements for {label!r}.")
        times = sorted(seconds)
        q1, q3 = (
            statistics.quantiles(times, n=4)[::2]
            if len(times) > 1
            else (times[0], times[0])
        )
        threads = threads or torch.get_num_threads()
        return cls(
            label,
            statistics.median(times),
            q3 - q1,
            len(times),
            describe_hardware(threads),
            threads,
        )

    def __add__(self, other: Timing) -> Timing:
        """The two measured calls one after the other: medians add, and so do IQRs.

        Adding the IQRs bounds the spread of the sum from above, so a verdict
        against the sum errs on the side of "no measurable difference".
        """
        if not isinstance(other, Timing):
            return NotImplemented
        threads = self.threads if self.threads == other.threads else 0
        hardware = (
            self.hardware
            if self.hardware == other.hardware
            else f"{self.hardware}; {other.hardware}"
        )
        return Timing(
            f"{self.label} + {other.label}",
            self.median + other.median,
            self.iqr + other.iqr,
            min(self.runs, other.runs),
            hardware,
            threads,
        )

    def __str__(self) -> str:
        return (
            f"{self.label}: {format_time(self.median)} per call "
            f"(IQR {format_time(self.iqr)}, {self.runs} runs)"
        )


class OtherLoad:
    """Cores' worth of CPU time that other programs took while a block ran.

    ::

        with OtherLoad() as others:
            runs = benchmark_interleaved(...)
        others.cores      # about 0.0 on a quiet machine of few cores, 1.0 with
        others.available  # one of them kept busy; the cores it watched

    Everything the kernel counts as busy on the cores this process may run
    on (its CPU affinity, read where the system reports it: Linux and
    Windows; every core elsewhere, macOS among them), the hypervisor's
    ``steal`` on a virtual machine included, less this process's own CPU
    time (all its threads), per second of wall time. This process's children
    (a DataLoader's workers, launched scripts) count as other programs, and
    so does nothing on a hyperthread sibling outside the affinity, which
    slows these cores all the same. A comparison of thread counts means
    something only where ``cores`` is a small share of ``available``: two
    intra-op threads on two cores, one of which another program holds, run
    slower than one.

    With ``tree``, a process, the program is that process and all its
    descendants instead: the ranks of a job (``tree`` the process that started
    them, ``psutil.Process(os.getppid())`` in a rank: ``torchrun``'s agent, or
    the ``fast_start`` server that forked it) do not count as each other's
    other programs.
    """

    _FIELDS = ("user", "nice", "system", "irq", "softirq", "steal", "interrupt", "dpc")

    def __init__(self, tree: psutil.Process | None = None) -> None:
        self.cores = math.nan  # measured when the block ends
        self._tree = tree  # None: this process alone
        per_core = psutil.cpu_times(percpu=True)
        try:
            mine = set(psutil.Process().cpu_affinity())
        except (AttributeError, psutil.Error):  # macOS has no affinity
            mine = set(range(len(per_core)))
        if len(per_core) != psutil.cpu_count():  # an offline CPU: ids do not index
            mine = set(range(len(per_core)))
        self._mine = mine & set(range(len(per_core)))
        self.available = len(self._mine)

    @classmethod
    def measured(cls, cores: float, available: int) -> OtherLoad:
        """A measurement made elsewhere (a launched script's), as ``OtherLoad``."""
        load = cls.__new__(cls)  # reads nothing on this machine
        load.cores, load.available, load._tree = cores, available, None
        return load

    def as_dict(self) -> dict[str, float]:
        """``cores`` and ``available``, for JSON (``measured(**d)`` reads it back)."""
        return {"cores": self.cores, "available": self.available}

    def _busy(self) -> tuple[float, float, float]:
        """(wall clock, busy seconds of the watched cores, the program's CPU time)."""
        per_core = psutil.cpu_times(percpu=True)
        busy = sum(
            getattr(per_core[core], field, 0.0)
            for core in self._mine
            for field in self._FIELDS
        )
        return time.perf_counter(), busy, self._own_cpu_time()

    def _own_cpu_time(self) -> float:
        """CPU seconds of the program: ``tree`` and its descendants, or this process."""
        if self._tree is None:
            own = psutil.Process().cpu_times()
            return own.user + own.system
        try:
            processes = [self._tree, *self._tree.children(recursive=True)]
        except psutil.Error:  # the root has ended: the program's time is unknown
            return math.nan
        total = 0.0
        for process in processes:
            try:
                times = process.cpu_times()
            except psutil.Error:  # ended between the two calls: its parent counts it
                continue
            # a descendant that ended and was reaped moves its time into its
            # parent's children_* fields, which keep it in the total
            total += sum(
                getattr(times, field, 0.0)
                for field in ("user", "system", "children_user", "children_system")
            )
        return total

    def __enter__(self) -> OtherLoad:
        self._start = self._busy()
        return self

    def __exit__(self, *exc_info: object) -> None:
        (wall0, busy0, own0), (wall1, busy1, own1) = self._start, self._busy()
        others = (busy1 - busy0) - (own1 - own0)  # NaN where the program's is unknown
        self.cores = (
            others
            if math.isnan(others)
            else max(0.0, others) / max(wall1 - wall0, 1e-9)
        )


@contextmanager
def _intra_op_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads, then restore the setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _synchronized_clock() -> float:
    """``time.perf_counter`` once the accelerator's queued work is done."""
    synchronize()
    return time.perf_counter()


def _timed_blocks(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    warmup: int,
    repeats: int,
    min_run_time: float,
    threads: int,
) -> Callable[[], float]:
    """Warm ``fn`` up and return a function that times one block of calls.

    A block holds as many calls as fit in ``min_run_time / repeats`` seconds
    (at least one); the returned function gives its per-call time. Blocks are
    timed with ``timeit`` and a clock that synchronises the accelerator, as in
    ``torch.utils.benchmark.Timer``, whose ``timeit`` would also run two
    warm-up calls before every block: three times the cost of a block of one
    long call.
    """
    timer = timeit.Timer(lambda: fn(*args, **kwargs), timer=_synchronized_clock)

    def per_call(number: int) -> float:
        with _intra_op_threads(threads):
            return timer.timeit(number) / number

    with _intra_op_threads(threads):
        for _ in range(warmup):
            fn(*args, **kwargs)
    once = per_call(1)
    number = max(1, int(min_run_time / max(repeats, 1) / max(once, 1e-9)))
    return lambda: per_call(number)


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    label: str = "",
    warmup: int = 2,
    repeats: int = 7,
    min_run_time: float = 0.2,
    num_threads: int | None = None,
    **kwargs: Any,
) -> Timing:
    """Time ``fn(*args, **kwargs)`` and return its median time per call.

    After ``warmup`` calls, ``repeats`` blocks of calls are timed, each block
    about ``min_run_time / repeats`` seconds long; the median and the
    interquartile range are over the blocks' per-call times.

    Args:
        fn: the function to time; its result is discarded.
        label: a name for the result.
        warmup: calls made before timing (first calls allocate memory, pick
            kernels and compile).
        repeats: timed blocks (at least 1); more blocks, a better spread.
        min_run_time: seconds spent measuring, roughly; more time, less noise.
        num_threads: intra-op threads while timing (default: the current setting).
    """
    threads = num_threads or torch.get_num_threads()
    block = _timed_blocks(
        fn,
        args,
        kwargs,
        warmup=warmup,
        repeats=repeats,
        min_run_time=min_run_time,
        threads=threads,
    )
    times = [block() for _ in range(max(repeats, 1))]
    return Timing.from_samples(label, times, threads=threads)


def benchmark_interleaved(
    fns: dict[str, Callable[[], Any]],
    *,
    warmup: int = 2,
    repeats: int = 7,
    min_run_time: float = 0.2,
    num_threads: int | Mapping[str, int] | None = None,
) -> dict[str, Timing]:
    """Time several functions as ``benchmark`` does, taking turns block by block.

    Every function gets its warm-up and about ``min_run_time`` seconds, but
    block r of each is timed before block r + 1 of any. A machine that slows
    down for a while (a busy neighbour on a shared host) then slows every
    function alike, and comparisons between them stay fair. ``num_threads`` is
    one intra-op thread count for all, or one per key (a missing key gets the
    current setting). Returns one ``Timing`` per key, labelled with the key.
    """
    current = torch.get_num_threads()
    if isinstance(num_threads, Mapping):
        threads = {name: num_threads.get(name, current) for name in fns}
    else:
        threads = dict.fromkeys(fns, num_threads or current)
    blocks = {
        name: _timed_blocks(
            fn,
            (),
            {},
            warmup=warmup,
            repeats=repeats,
            min_run_time=min_run_time,
            threads=threads[name],
        )
        for name, fn in fns.items()
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(repeats, 1)):
        for name, block in blocks.items():
            times[name].append(block())
    return {
        name: Timing.from_samples(name, samples, threads=threads[name])
        for name, samples in times.items()
    }


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """The median of ``values`` and its noise: the half-width of a box plot's
    notch, 1.57 IQR / √n, roughly a 90% interval for the median.

    The IQR says how much the values spread; the notch, how well n of them pin
    their median down."""
    if len(values) < 3:
        raise ValueError(f"median_interval needs at least 3 values; got {len(values)}.")
    q1, median, q3 = statistics.quantiles(values, n=4)
    return median, NOTCH * (q3 - q1) / math.sqrt(len(values))


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """``median_interval`` of ``a[r] - b[r]``, over rounds in which both were timed.

    Two variants timed in the same round met the same load: the difference
    cancels what they shared, and the interval says what is left."""
    if len(a) != len(b) or len(a) < 3:
        raise ValueError(
            "paired_difference needs two lists of times from the same rounds, at "
            f"least 3; got {len(a)} and {len(b)}."
        )
    return median_interval([x - y for x, y in zip(a, b)])


def format_table(
    rows: Sequence[dict[str, Any]],
    *,
    title: str = "",
    hardware: bool = True,
    threads: int | str | None = None,
) -> str:
    """Lay out rows of equal keys as a plain-text table.

    A key with a line break is a header of two (or more) lines, aligned at the
    bottom, which keeps wide tables narrow. ``Timing`` values are shown as
    their median time; floats with 3 significant digits. A last line says which hardware the numbers came
    from, with the threads the measurements used: ``threads`` when given,
    else those of the table's ``Timing`` values, else the current setting.
    """
    if not rows:
        return title
    columns = list(rows[0])

    def cell(value: Any) -> str:
        if isinstance(value, Timing):
            return format_time(value.median)
        if isinstance(value, float):
            return f"{value:.3g}"
        return str(value)

    cells = [[cell(row[c]) for c in columns] for row in rows]
    headers = [c.split("\n") for c in columns]
    depth = max(len(h) for h in headers)
    headers = [[""] * (depth - len(h)) + h for h in headers]
    widths = [
        max(*(len(part) for part in h), *(len(r[i]) for r in cells))
        for i, h in enumerate(headers)
    ]
    lines = [title] if title else []
    for level in range(depth):
        parts = (h[level].ljust(w) for h, w in zip(headers, widths))
        lines.append("  ".join(parts).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    if hardware:
        if threads is None:
            used = sorted(
                {
                    v.threads
                    for row in rows
                    for v in row.values()
                    if isinstance(v, Timing)
                }
            )
            threads = " and ".join(map(str, used)) if used else None
        lines.append(f"Measured on: {describe_hardware(threads)}")
    return "\n".join(lines)


class Benchmark:
    """Time a block of code, synchronising the accelerator at both ends.

    >>> with Benchmark("matmul"):
    ...     y = x @ x
    matmul: 1.23 ms

    The duration stays available as ``.elapsed`` (seconds). One run only: for
    comparisons, use ``benchmark``, which repeats and reports the median.
    """

    def __init__(self, description: str = "Done", *, quiet: bool = False) -> None:
        self.description = description
        self.quiet = quiet
        self.elapsed = math.nan

    def __enter__(self) -> Benchmark:
        synchronize()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        synchronize()
        self.elapsed = time.perf_counter() - self._start
        if not self.quiet and exc_info[0] is None:
            print(f"{self.description}: {format_time(self.elapsed)}")
