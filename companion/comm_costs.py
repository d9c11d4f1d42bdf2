"""The cost of talking: alpha-beta fits of collectives, and DDP's buckets and overlap.

Chapter 16 times collectives with ``companion/scripts/collective_bench.py``
and DDP's steps with ``companion/checks/cost_of_talking.py``; this module holds
what it predicts with (no matplotlib: the checks import it):

- ``bus_factor``: nccl-tests' bus bandwidth over algorithm bandwidth,
  2 (n - 1) / n for an all-reduce and (n - 1) / n for the other collectives;
- ``fit_alpha_beta`` and ``CollectiveFit``: a collective's time as
  alpha + size / bandwidth, fitted to measured times by least squares on
  relative errors, so that bytes and megabytes weigh alike;
  ``fit_collectives`` fits every collective and group of a sweep;
- ``CollectiveFit.as_link``: an all-reduce fit as chapter 13's
  ``DeviceAndLink``, so that its cost model uses this machine's link;
- ``ddp_bucket_caps`` and ``assign_buckets``: how DDP groups gradients
  into buckets (in the order they become ready, never splitting one);
- ``overlap_schedule``: each bucket's all-reduce started when its last
  gradient is ready and the one before it is done, and the communication
  left exposed after the backward pass.

Used in chapter 16.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from companion.harness.notebook import CourseError
from companion.harness.timing import median_interval
from companion.parallel_costs import DeviceAndLink

__all__ = [
    "KINDS",
    "BucketSchedule",
    "CollectiveFit",
    "MiB",
    "assign_buckets",
    "bus_factor",
    "ddp_bucket_caps",
    "exposed_communication",
    "fit_alpha_beta",
    "fit_collectives",
    "measured_contention",
    "overlap_schedule",
]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
MiB = 2**20
DEFAULT_BUCKET_CAP_MB = 25  # DDP's bucket_cap_mb when none is given
FIRST_BUCKET_BYTES = MiB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def bus_factor(kind: str, processes: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth for ``kind`` on n processes.

    In a ring, each process's link carries 2 (n - 1) / n of an all-reduce's
    buffer and (n - 1) / n of an all-gather's, a reduce-scatter's or an
    all-to-all's; a send carries its message once.
    """
    if kind not in KINDS:
        raise CourseError(f"no bus factor for {kind!r}; the collectives: {KINDS}.")
    if processes < 2:
        raise CourseError(f"a collective needs 2 processes or more, not {processes}.")
    if kind == "send_recv":
        return 1.0
    return (2 if kind == "all_reduce" else 1) * (processes - 1) / processes


def fit_alpha_beta(
    sizes: Sequence[float], seconds: Sequence[float]
) -> tuple[float, float]:
    """Fit t = alpha + beta x size; return ``(alpha, beta)`` in seconds and s/byte.

    Least squares on relative errors (each point weighted by 1 / t^2), so that
    a 64-byte message counts as much as a 16 MiB one. A negative alpha, which
    noise can produce, is refitted as zero; a time that does not grow with
    the size has no bandwidth and raises ``CourseError``.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise CourseError("fit at least two (size, time) pairs, as many of each.")
    if min(seconds) <= 0:
        raise CourseError("every measured time must be positive.")
    w = [1 / t**2 for t in seconds]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes))
    sy = sum(wi * t for wi, t in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * t for wi, x, t in zip(w, sizes, seconds))
    det = sw * sxx - sx * sx
    if det <= 0:
        raise CourseError("fit messages of at least two different sizes.")
    beta = (sw * sxy - sx * sy) / det
    alpha = (sy - beta * sx) / sw
    if alpha < 0:
        alpha, beta = 0.0, sxy / sxx
    if beta <= 0:
        raise CourseError(
            "the measured times do not grow with the message size: no bandwidth "
            "can be fitted (was the machine busy?)."
        )
    return alpha, beta


@dataclass(frozen=True)
class CollectiveFit:
    """A collective's time on n processes as ``latency + bytes / bandwidth``."""

    kind: str
    processes: int
    latency: float  # alpha, seconds per call
    bandwidth: float  # 1 / beta: algorithm bandwidth, bytes/s (nccl-tests' algbw)

    @property
    def bus_bandwidth(self) -> float:
        """The link's bytes/s that the fit implies (nccl-tests' busbw)."""
        return self.bandwidth * bus_factor(self.kind, self.processes)

    def predict(self, nbytes: float) -> float:
        """Seconds for one call on a message of ``nbytes`` (sized as nccl-tests does)."""
        return self.latency + nbytes / self.bandwidth

    def as_link(self, flops: float, name: str = "") -> DeviceAndLink:
        """This all-reduce fit as chapter 13's ``DeviceAndLink``.

        ``ring_all_reduce_seconds(S, n, link)`` charges 2 (n - 1) / n x S /
        bandwidth + 2 (n - 1) x latency; with the bus bandwidth and alpha
        spread over the ring's 2 (n - 1) steps it equals ``predict(S)``.
        ``flops`` is one device's sustained FLOP/s (measure it separately).
        """
        if self.kind != "all_reduce":
            raise CourseError(
                f"chapter 13's link is described by an all-reduce fit, not {self.kind}."
            )
        steps = 2 * (self.processes - 1)
        return DeviceAndLink(
            name or f"all-reduce fit, {self.processes} processes",
            flops=flops,
            bandwidth=self.bus_bandwidth,
            latency=self.latency / steps,
        )


def fit_collectives(
    measurements: Iterable[Mapping], sizes: Iterable[int] | None = None
) -> dict[tuple[str, int], CollectiveFit]:
    """One fit per (collective, processes) of a ``collective_bench.py`` sweep.

    ``measurements`` are its rows (``kind``, ``processes``, ``bytes``,
    ``seconds``); with ``sizes`` only rows of those sizes are fitted, so
    that the others can test the fit's predictions.
    """
    keep = None if sizes is None else set(sizes)
    points: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for row in measurements:
        if keep is None or row["bytes"] in keep:
            key = (row["kind"], row["processes"])
            points.setdefault(key, []).append((row["bytes"], row["seconds"]))
    fits = {}
    for (kind, n), pairs in points.items():
        alpha, beta = fit_alpha_beta(*zip(*pairs))
        fits[kind, n] = CollectiveFit(kind, n, alpha, 1 / beta)
    return fits


def ddp_bucket_caps(bucket_cap_mb: float | None = None) -> tuple[int, int]:
    """The byte caps of DDP's first bucket and of the others, for ``bucket_cap_mb``.

    Without a ``bucket_cap_mb`` DDP uses 25 MiB, and a first bucket of 1 MiB
    (the gradients that are ready first start their all-reduce early); with
    one, every bucket, the first included, has that cap (torch 2.10 to 2.14).
    """
    if bucket_cap_mb is None:
        return FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MiB
    if bucket_cap_mb <= 0:
        raise CourseError(f"bucket_cap_mb must be positive, not {bucket_cap_mb}.")
    cap = int(bucket_cap_mb * MiB)
    return cap, cap


def assign_buckets(sizes: Sequence[int], caps: tuple[int, int]) -> list[list[int]]:
    """Group gradients into DDP's buckets; return lists of positions in ``sizes``.

    ``sizes`` are the gradients' bytes in the order they become ready in the
    backward pass; ``caps`` the first bucket's cap and the others'. Like
    DDP's reducer, fill a bucket with the next gradient, whole, until it
    holds at least its cap, then start the next: a bucket can exceed its
    cap, and a gradient larger than the cap is a bucket of its own.
    """
    first, cap = caps
    if min(first, cap) <= 0:
        raise CourseError("bucket caps must be positive numbers of bytes.")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for position, nbytes in enumerate(sizes):
        current.append(position)
        filled += nbytes
        if filled >= (cap if buckets else first):
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class BucketSchedule:
    """When each bucket's all-reduce ran, and what it left exposed (seconds)."""

    ready: list[float]  # when each bucket's last gradient was ready
    start: list[float]
    end: list[float]
    backward: float  # when the backward pass's computation ends

    @property
    def exposed(self) -> float:
        """Communication after the last computation: the step's wait for the link."""
        return max(0.0, (self.end[-1] if self.end else 0.0) - self.backward)

    @property
    def communication(self) -> float:
        """Seconds the link was busy, hidden or not."""
        return sum(e - s for s, e in zip(self.start, self.end))

    def cost(self, contention: float = 0.0) -> float:
        """Seconds the step loses to communication: the exposed part, and
        ``contention`` times the hidden part.

        ``contention`` is how much of a hidden all-reduce's time the backward
        pass loses anyway: about 0 where the link works on its own (a GPU's
        nccl), about 1 where the cores that compute also move the bytes (gloo
        on a CPU whose cores all compute).
        """
        if not 0 <= contention <= 1:
            raise CourseError(f"contention lies between 0 and 1, not {contention}.")
        return self.exposed + contention * (self.communication - self.exposed)


def overlap_schedule(
    ready_times: Sequence[float],
    sizes: Sequence[int],
    buckets: Sequence[Sequence[int]],
    cost: Callable[[float], float],
    backward: float,
) -> BucketSchedule:
    """Replay DDP's all-reduces against a measured backward pass.

    ``ready_times[i]`` is when gradient i (bytes ``sizes[i]``) was ready,
    from the start of the backward pass, which computes until ``backward``;
    ``buckets`` lists positions as ``assign_buckets`` returns them, in the
    order DDP launches them; ``cost(bytes)`` is one all-reduce's seconds. A
    bucket's all-reduce starts when its last gradient is ready and the link
    has finished the bucket before it (one all-reduce at a time, in order,
    as one nccl stream runs them; gloo's two worker threads per process
    group can run two at once, which this model leaves out); the
    computation is assumed not to slow down while the link works, which
    holds better on a GPU than on a CPU whose cores also move the bytes
    (``BucketSchedule.cost`` charges that separately).
    """
    ready, start, end = [], [], []
    free = 0.0
    for bucket in buckets:
        if not bucket:
            raise CourseError("a bucket holds at least one gradient.")
        r = max(ready_times[i] for i in bucket)
        s = max(r, free)
        free = s + cost(sum(sizes[i] for i in bucket))
        ready.append(r)
        start.append(s)
        end.append(free)
    return BucketSchedule(ready, start, end, backward)


def measured_contention(steps: Mapping[str, Mapping]) -> tuple[float, float]:
    """The share of a hidden all-reduce's time that the backward pass beside it
    loses, from ``checks/cost_of_talking.py``'s step times: (both - backward) /
    all-reduce, round by round; its median and noise (``median_interval``)."""
    return median_interval(
        [
            (both - backward) / all_reduce
            for both, backward, all_reduce in zip(
                steps["backward beside an all-reduce"]["rounds"],
                steps["no communication"]["rounds"],
                steps["all-reduce alone"]["rounds"],
            )
        ]
    )


def merge_intervals(spans: Iterable[Sequence[float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals, as sorted, disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted((float(s), float(e)) for s, e in spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(spans: Sequence[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _overlap(
    a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
) -> float:
    """Length of the intersection of two unions of disjoint, sorted intervals."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def _subtract(
    a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """Union ``a`` minus union ``b`` (both sorted and disjoint), as intervals."""
    result = []
    for start, end in a:
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                result.append((start, b_start))
            start = max(start, b_end)
            if start >= end:
                break
        if start < end:
            result.append((start, end))
    return result


COMM_PREFIXES = ("gloo:", "nccl:")  # the backends' record_function names (CPU side)


def _is_wait(event: Mapping) -> bool:
    """A collective's launch or a wait for one, not computation."""
    name = str(event["name"])
    return name.startswith("c10d") or "wait" in name.lower()


def exposed_communication(events: Sequence[Mapping], *, gpu: bool = False) -> dict:
    """Split a profiled step's time into computation and exposed communication.

    ``events`` are a Chrome trace's ``traceEvents``. On a CPU, communication
    is what the backend's threads record for each collective (``gloo:...``)
    and computation every operator the other threads run, except the
    collectives' own launches and waits (``c10d::...``, ``...wait...``); on a
    GPU, nccl's kernels and every other kernel. Exposed communication is
    communication during which no computation runs. Returns seconds, and the
    merged intervals (ms from the first event) for a figure.
    """
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if gpu:
        kernels = [e for e in spans if e.get("cat") == "kernel"]
        comm = [e for e in kernels if "nccl" in str(e["name"]).lower()]
        work = [e for e in kernels if "nccl" not in str(e["name"]).lower()]
        waiting: list = []  # kernels never wait: the streams do
    else:
        comm = [e for e in spans if str(e["name"]).startswith(COMM_PREFIXES)]
        comm_threads = {(e["pid"], e["tid"]) for e in comm}
        ops = [
            e
            for e in spans
            if e.get("cat") == "cpu_op" and (e["pid"], e["tid"]) not in comm_threads
        ]
        waiting = [e for e in ops if _is_wait(e)]
        work = [e for e in ops if not _is_wait(e)]
    if not comm and not work:
        raise CourseError("the trace holds no computation and no communication.")
    origin = min(float(e["ts"]) for e in comm + work)

    def union(chosen: list) -> list[tuple[float, float]]:
        return merge_intervals(
            (
                (float(e["ts"]) - origin) / 1e3,
                (float(e["ts"]) + float(e["dur"]) - origin) / 1e3,
            )
            for e in chosen
        )

    comm_spans = union(comm)
    # An operator that encloses a wait for the network (a compiled region)
    # does not compute while it waits.
    work_spans = _subtract(union(work), union(waiting))
    communication = _length(comm_spans)
    return {
        "computation": _length(work_spans) / 1e3,
        "communication": communication / 1e3,
        "exposed": (communication - _overlap(comm_spans, work_spans)) / 1e3,
        "collectives": len(comm),
        "communication_ms": [[round(s, 3), round(e, 3)] for s, e in comm_spans],
        "computation_ms": [[round(s, 3), round(e, 3)] for s, e in work_spans],
    }


def relative_error(predicted: float, measured: float) -> float:
    """How far apart two positive numbers are, as a factor: max(a/b, b/a) - 1."""
    if predicted <= 0 or measured <= 0:
        return math.inf
    return max(predicted / measured, measured / predicted) - 1
