"""Tests of companion.profiling: traces to intervals, concurrency, the timeline figure."""

from __future__ import annotations

import json
import os
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


# Edges and exact texts: each test below fails on a mutant that survived a
# mutmut run of companion.profiling.


def test_gpu_events_without_device_or_stream_and_events_without_duration(tmp_path):
    copy = {"ph": "X", "name": "copy", "cat": "gpu_memcpy", "ts": 0.0}
    path = write_trace(
        tmp_path / "t.json",
        [
            copy | {"dur": 2000.0, "pid": 1, "tid": 3},  # no "args" at all
            event("gemm", "kernel", 500.0, 1000.0, pid=4, tid=5),  # empty args
            event("fill", "kernel", 600.0, 10.0, pid=4, tid=5, device=1, stream=9),
            {"ph": "X", "name": "mark", "cat": "user_annotation", "ts": 1000.0}
            | {"pid": 100, "tid": 7},  # no "dur": a zero-length bar
        ],
    )
    assert trace_intervals(path) == [
        Interval("cuda:1 stream 3", "copy", 0.0, 2.0),
        Interval("cuda:4 stream 5", "gemm", 0.5, 1.5),
        Interval("cuda:1 stream 9", "fill", 0.6, 0.61),
        Interval("thread 0", "mark", 1.0, 1.0),
    ]


def test_a_name_filter_skips_events_without_a_name(tmp_path):
    nameless = {"ph": "X", "cat": "user_annotation", "ts": 0.0, "dur": 1.0}
    path = write_trace(
        tmp_path / "t.json",
        [nameless | {"pid": 1, "tid": 1}, event("Xfer", "user_annotation", 5, 1)],
    )
    assert [i.name for i in trace_intervals(path, names=["N", "X"])] == ["Xfer"]


def test_a_bare_list_of_events_and_a_dict_without_them(tmp_path):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([event("a", "user_annotation", 0.0, 1000.0)]))
    assert trace_intervals(bare) == [Interval("thread 0", "a", 0.0, 1.0)]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"events": []}))
    with pytest.raises(
        ValueError,
        match=r"^A Chrome trace holds a list of events under 'traceEvents'\.$",
    ):
        trace_intervals(other)


def test_concurrency_of_short_and_of_zero_length_spans():
    side_by_side = [
        Interval("thread 0", "a", 0, 0.5),
        Interval("thread 1", "b", 0, 0.5),
    ]
    assert concurrency(side_by_side) == 2.0  # a span under 1 ms counts too
    instants = [Interval("thread 0", "a", 1, 1), Interval("thread 1", "b", 1, 1)]
    assert concurrency(instants) == 1.0  # nothing to divide by: no overlap claimed
    with pytest.raises(
        ValueError,
        match=r"^No intervals: was anything recorded in the selected categories\?$",
    ):
        concurrency([])


def test_make_profiler_activities_and_quiet_kineto(monkeypatch):
    from torch.profiler import ProfilerActivity

    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    for all_threads in (True, False):
        assert set(make_profiler(all_threads=all_threads).activities) == {
            ProfilerActivity.CPU
        }
    assert os.environ["KINETO_LOG_LEVEL"] == "6"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for all_threads in (True, False):
        assert set(make_profiler(all_threads=all_threads).activities) == {
            ProfilerActivity.CPU,
            ProfilerActivity.CUDA,
        }


def test_plot_timeline_layout():
    intervals = [Interval("thread 0", "a", 0, 1), Interval("thread 1", "b", 1, 3)]
    ax = plot_timeline(intervals, title="two threads")
    assert ax.get_ylim() == (1.5, -0.5)  # the first row on top
    assert (ax.get_xlabel(), ax.get_title()) == ("time (ms)", "two threads")
    (bar,) = ax.collections[1].get_paths()
    assert bar.get_extents().bounds == pytest.approx((1.0, 0.6, 2.0, 0.8))
    many = [Interval("thread 0", str(k), k, k + 1) for k in range(11)]
    ten = plot_timeline(many[:10])
    assert len(ten.get_legend().get_texts()) == 10 and ten.get_title() == ""
    assert plot_timeline(many).get_legend() is None  # 11 names: no legend
