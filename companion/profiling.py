"""Profiler traces as timelines: which thread or stream ran what, and when.

``make_profiler`` returns a ``torch.profiler.profile`` that records every
thread (and CUDA kernels when there is a GPU) without log noise;
``trace_intervals`` turns its trace (or a saved Chrome-trace JSON file) into
``Interval`` records; ``plot_timeline`` draws them as a Gantt chart with one
row per thread or stream; ``concurrency`` says how many rows were busy at
once on average. Used in chapter 06.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from torch.profiler import ProfilerActivity, profile

from companion.harness.plotting import new_axes

__all__ = [
    "Interval",
    "DEFAULT_CATEGORIES",
    "make_profiler",
    "trace_intervals",
    "concurrency",
    "plot_timeline",
]

# Chrome-trace categories worth a bar: record_function() labels, GPU kernels
# and copies. Add "cpu_op" to see every ATen operator.
DEFAULT_CATEGORIES = ("user_annotation", "gpu_user_annotation", "kernel", "gpu_memcpy")
_GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}


@dataclass(frozen=True)
class Interval:
    """One bar of a timeline: ``name`` ran on ``row`` from ``start`` to ``end`` (ms)."""

    row: str  # "thread 0", "thread 1", ... or "cuda:0 stream 7"
    name: str
    start: float  # milliseconds since the first selected event
    end: float

    @property
    def duration(self) -> float:
        """Length of the interval in milliseconds."""
        return self.end - self.start


def make_profiler(*, all_threads: bool = True) -> profile:
    """Return a ``torch.profiler.profile`` for CPU ops (and CUDA kernels on a GPU).

    Args:
        all_threads: record ops on every thread, including Python threads the
            profiled code starts; by default the profiler sees only the thread
            that entered it and the tasks it hands to PyTorch's own pools.

    Kineto, the profiler's backend, prints status lines (and on a CUDA build
    without a GPU an error about the device count) to stderr; they are
    silenced unless ``KINETO_LOG_LEVEL`` is already set. It must be set before
    the first profile in a process.
    """
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # 6: above ERROR, prints nothing
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    if not all_threads:
        return profile(activities=activities)
    try:  # an experimental option of recent PyTorch versions
        config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # older PyTorch: the calling thread and PyTorch's pools only
        return profile(activities=activities)
    return profile(activities=activities, experimental_config=config)


# A profile can export its trace only once: keep each export for later calls.
_EXPORTED: weakref.WeakKeyDictionary[profile, Any] = weakref.WeakKeyDictionary()


def _load_events(trace: profile | str | Path) -> list[dict[str, Any]]:
    if isinstance(trace, profile):
        if trace not in _EXPORTED:
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "trace.json"
                trace.export_chrome_trace(str(path))
                _EXPORTED[trace] = json.loads(path.read_text())
        data = _EXPORTED[trace]
    else:
        path = Path(trace)
        if not path.is_file():
            raise FileNotFoundError(
                f"No trace file at {path}; export one with prof.export_chrome_trace()."
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path} is not a JSON Chrome trace ({error.msg})."
            ) from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError("A Chrome trace holds a list of events under 'traceEvents'.")
    return events


def trace_intervals(
    trace: profile | str | Path,
    *,
    categories: Sequence[str] = DEFAULT_CATEGORIES,
    names: Sequence[str] | None = None,
) -> list[Interval]:
    """Turn a profiler trace into intervals, one per recorded event.

    Args:
        trace: a finished ``torch.profiler.profile``, or the path of a Chrome
            trace it exported.
        categories: event categories to keep (``"cpu_op"`` for ATen ops).
        names: keep only events whose name starts with one of these.

    CPU threads become rows ``thread 0``, ``thread 1``, ... in the order they
    first appear; GPU events become ``cuda:<device> stream <stream>``. Times
    are in milliseconds from the first kept event, sorted by start.
    """
    kept = []
    for event in _load_events(trace):
        if event.get("ph") != "X" or event.get("cat") not in categories:
            continue
        if names is not None and not str(event.get("name", "")).startswith(
            tuple(names)
        ):
            continue
        kept.append(event)
    kept.sort(key=lambda e: float(e["ts"]))
    if not kept:
        return []
    origin = float(kept[0]["ts"])
    threads: dict[tuple[Any, Any], str] = {}
    intervals = []
    for event in kept:
        if event["cat"] in _GPU_CATEGORIES:
            args = event.get("args", {})
            row = f"cuda:{args.get('device', event['pid'])} stream {args.get('stream', event['tid'])}"
        else:
            row = threads.setdefault(
                (event["pid"], event["tid"]), f"thread {len(threads)}"
            )
        start = (float(event["ts"]) - origin) / 1e3
        intervals.append(
            Interval(
                row, str(event["name"]), start, start + float(event.get("dur", 0)) / 1e3
            )
        )
    return intervals


def _union_length(spans: Iterable[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def concurrency(intervals: Sequence[Interval]) -> float:
    """Return how many rows were busy at once, on average over the busy time.

    1.0 means the rows took turns (or there is one row); 2.0 means two rows
    were busy the whole time. Overlapping bars on the same row count once.
    """
    if not intervals:
        raise ValueError(
            "No intervals: was anything recorded in the selected categories?"
        )
    rows = {i.row for i in intervals}
    busy = sum(
        _union_length((i.start, i.end) for i in intervals if i.row == row)
        for row in rows
    )
    span = _union_length((i.start, i.end) for i in intervals)
    return busy / span if span > 0 else 1.0


def _row_order(row: str) -> tuple[bool, list[str | int]]:
    """CPU threads before GPU streams; "thread 10" after "thread 2"."""
    parts = re.split(r"(\d+)", row)
    return row.startswith("cuda"), [int(p) if p.isdigit() else p for p in parts]


def plot_timeline(
    intervals: Sequence[Interval], *, ax: Axes | None = None, title: str = ""
) -> Axes:
    """Draw intervals as a Gantt chart: one row per thread or stream, one colour per name."""
    if ax is None:
        (ax,) = new_axes(width=7.0, height=2.4)
    rows = sorted({i.row for i in intervals}, key=_row_order)
    names = list(dict.fromkeys(i.name for i in intervals))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, name in enumerate(names):
        label: str | None = name  # one legend entry per name
        for y, row in enumerate(rows):
            bars = [
                (i.start, i.duration)
                for i in intervals
                if i.name == name and i.row == row
            ]
            if bars:
                ax.broken_barh(
                    bars,
                    (y - 0.4, 0.8),
                    facecolors=colors[k % len(colors)],
                    edgecolor="white",
                    linewidth=0.5,
                    label=label,
                )
                label = None
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    if names and len(names) <= 10:
        ax.legend(
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize="small",
            frameon=False,
        )
    return ax
