"""What the check programs of ``companion/checks/`` share.

A check runs a standalone script's own functions in several processes,
measures around them, and judges the measurements against formulas on rank 0
(see ``companion/checks/__init__.py``). This module holds the pieces every
check needs: the tolerance of a comparison with the plain model, a clock
that waits for the device, the processes' records gathered, marks on the
device's own timeline that time a step's parts without waiting for the
device inside it (``DeviceClock``), and one ending
for all of them (rank 0's results file, and exit code 3 with one sentence
when a check missed). Used in chapters 12, 13 and 17.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from companion.harness.timing import synchronize

__all__ = [
    "TOLERANCES",
    "DeviceClock",
    "clock",
    "every_rank",
    "finish",
    "first_miss",
    "print0",
    "tolerance",
]

# Largest loss difference from the plain model that counts as equal. float64:
# a few Adam steps land about 1e-15 from one process, on CPUs with gloo and on
# GPUs with nccl (which sums in another order), so 1e-10 leaves a wide margin;
# float32 differs by about 1e-6 on CPUs, and more where a GPU's kernels or
# TF32 change the rounding: checks compare in float64 by default.
TOLERANCES = {"float64": 1e-10, "float32": 1e-4}


def tolerance(dtype: str, given: float | None = None) -> float:
    """``given``, else the tolerance of ``dtype`` (``"float32"`` or ``"float64"``)."""
    return TOLERANCES[dtype] if given is None else given


def first_miss(checks: dict[str, bool]) -> str:
    """The sentence a check ends with when a comparison missed ("" when none did)."""
    missed = [name for name, ok in checks.items() if not ok]
    return (
        f"{missed[0]}: measured and predicted differ; see the results" if missed else ""
    )


def clock() -> float:
    """Seconds on a monotonic clock, read once the device's queued work is done.

    On a GPU a host clock read without waiting would time kernel launches.
    """
    synchronize()
    return time.perf_counter()


class DeviceClock:
    """Marks on the device's own timeline, read once its work is done.

    On a GPU ``mark()`` records a CUDA event in the current stream: the host
    neither waits for the GPU nor stops queueing work, so marks around every
    pass of a step leave its overlap (of kernel launches with kernels, of
    communication with computation) as it was, where a host clock would
    have to synchronise the device at each mark; ``seconds(a, b)`` waits for
    mark ``b``, so read the marks after the step. On a CPU, whose operations
    are synchronous, a mark is the host clock.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self) -> Any:
        """A point in time: a recorded CUDA event, or the host clock's reading."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from mark ``start`` to mark ``end`` (on a GPU: once ``end`` ran)."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time: milliseconds


def print0(*args: object) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(*args, flush=True)


def every_rank(record: Any) -> list[Any]:
    """Every rank's ``record`` (anything picklable), in rank order, on every rank."""
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def finish(results: dict[str, Any] | None, failure: str, path: str | None) -> None:
    """End the check alike on every rank.

    Rank 0 writes ``results`` to ``path`` (when both are given) and tells the
    others ``failure``: "" ends every rank normally; a sentence ends every
    rank with exit code 3, and rank 0 prints it.
    """
    if dist.get_rank() == 0 and results is not None and path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    verdict = [failure]
    dist.broadcast_object_list(verdict, src=0)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if verdict[0]:
        if rank == 0:
            name = os.path.basename(sys.argv[0])
            print(f"{name}: error: {verdict[0]}", file=sys.stderr, flush=True)
        sys.exit(3)
