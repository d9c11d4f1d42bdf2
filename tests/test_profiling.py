"""Tests of companion.profiling: traces to intervals, concurrency, the timeline figure."""

from __future__ import annotations

import json
import threading

import matplotlib
import pytest
import torch
from torch.profiler import record_function

from companion.profiling import (
    Interval,
    concurrency,
    make_profiler,
    plot_timeline,
    trace_intervals,
)

matplotlib.use("Agg")


def write_trace(path, events):
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def event(name, cat, ts, dur, pid=100, tid=7, **args):
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "ts": ts,
        "dur": dur,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def test_trace_intervals_from_a_file(tmp_path):
    path = write_trace(
        tmp_path / "t.json",
        [
            event("work B", "user_annotation", 3000.0, 1000.0, tid=9),
            event("work A", "user_annotation", 1000.0, 2500.0, tid=7),
            event("aten::mm", "cpu_op", 1100.0, 100.0, tid=7),  # category not kept
            event("gemm", "kernel", 2000.0, 500.0, pid=0, tid=7, device=0, stream=7),
            {
                "ph": "i",
                "name": "marker",
                "cat": "user_annotation",
                "ts": 0.0,
                "pid": 100,
                "tid": 7,
            },
        ],
    )
    intervals = trace_intervals(path)
    assert [i.name for i in intervals] == ["work A", "gemm", "work B"]
    first = intervals[0]
    assert (first.row, first.start, first.end) == ("thread 0", 0.0, 2.5)
    assert intervals[1].row == "cuda:0 stream 7"
    assert intervals[2].row == "thread 1" and intervals[2].start == pytest.approx(2.0)
    assert trace_intervals(path, names=["work B"]) == [
        Interval("thread 0", "work B", 0.0, 1.0)
    ]
    assert [i.name for i in trace_intervals(path, categories=["cpu_op"])] == [
        "aten::mm"
    ]


def test_trace_intervals_rejects_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="No trace file"):
        trace_intervals(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON Chrome trace"):
        trace_intervals(bad)
    assert trace_intervals(write_trace(tmp_path / "empty.json", [])) == []


def test_concurrency():
    one_row = [Interval("thread 0", "a", 0, 2), Interval("thread 0", "b", 1, 3)]
    assert concurrency(one_row) == pytest.approx(1.0)
    side_by_side = [Interval("thread 0", "a", 0, 4), Interval("thread 1", "b", 0, 4)]
    assert concurrency(side_by_side) == pytest.approx(2.0)
    half_overlap = [Interval("thread 0", "a", 0, 4), Interval("thread 1", "b", 2, 6)]
    assert concurrency(half_overlap) == pytest.approx(8 / 6)
    with pytest.raises(ValueError, match="No intervals"):
        concurrency([])


def test_profiler_sees_python_threads():
    x = torch.rand(64, 64)

    def work(label):
        with record_function(label):
            for _ in range(5):
                x @ x

    with make_profiler() as prof:
        work("main")
        threads = [
            threading.Thread(target=work, args=(f"worker {k}",)) for k in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    intervals = trace_intervals(prof)
    assert sorted(i.name for i in intervals) == ["main", "worker 0", "worker 1"]
    assert len({i.row for i in intervals}) == 3
    assert all(i.end > i.start for i in intervals)
    # A profile exports its trace once; asking again gives the same intervals.
    again = trace_intervals(prof, names=["worker"])
    workers = [i for i in intervals if i.name != "main"]
    assert [i.name for i in again] == [i.name for i in workers]
    assert len({i.row for i in again}) == 2
    assert [i.duration for i in again] == pytest.approx([i.duration for i in workers])


def test_plot_timeline_one_row_per_thread():
    intervals = [
        Interval("thread 0", "a", 0, 1),
        Interval("thread 10", "b", 0.5, 2),
        Interval("thread 2", "a", 1, 3),
        Interval("cuda:0 stream 7", "k", 0, 1),
    ]
    ax = plot_timeline(intervals, title="t")
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "thread 0",
        "thread 2",
        "thread 10",
        "cuda:0 stream 7",
    ]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b", "k"]
    assert len(ax.collections) == 4  # one bar group per (name, row)
