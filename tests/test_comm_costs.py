"""companion.comm_costs: alpha-beta fits, DDP's buckets, the overlap schedule, traces."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from companion.comm_costs import (
    MiB,
    assign_buckets,
    bus_factor,
    ddp_bucket_caps,
    exposed_communication,
    fit_alpha_beta,
    fit_collectives,
    measured_contention,
    merge_intervals,
    overlap_schedule,
)
from companion.gpt import GPT, GPTConfig
from companion.harness.notebook import CourseError
from companion.parallel_costs import ring_all_reduce_seconds


def test_bus_factors_are_nccl_tests() -> None:
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 8) == 7 / 8
    assert bus_factor("all_to_all", 2) == 0.5
    assert bus_factor("send_recv", 2) == 1.0
    with pytest.raises(CourseError, match="2 processes or more"):
        bus_factor("all_reduce", 1)
    with pytest.raises(CourseError, match="no bus factor"):
        bus_factor("broadcast", 2)


def test_the_fit_recovers_alpha_and_beta() -> None:
    sizes = [64, 4096, 2**18, 2**24]
    alpha, beta = fit_alpha_beta(sizes, [5e-5 + s / 2e9 for s in sizes])
    assert alpha == pytest.approx(5e-5)
    assert 1 / beta == pytest.approx(2e9)


def test_the_fit_weighs_sizes_by_relative_error() -> None:
    """Doubling the smallest time moves alpha, not the bandwidth the large sizes set."""
    sizes = [64, 4096, 2**18, 2**24]
    times = [5e-5 + s / 2e9 for s in sizes]
    times[0] *= 2
    alpha, beta = fit_alpha_beta(sizes, times)
    assert 5e-5 < alpha < 1e-4
    assert 1 / beta == pytest.approx(2e9, rel=0.05)


def test_a_negative_alpha_is_refitted_as_zero() -> None:
    alpha, beta = fit_alpha_beta([1000, 2000], [0.5e-6, 2e-6])
    assert alpha == 0 and beta > 0


@pytest.mark.parametrize(
    "sizes, times, said",
    [
        ([1], [1.0], "at least two"),
        ([1, 1], [1.0, 2.0], "two different sizes"),
        ([1, 2], [2.0, 1.0], "do not grow"),
        ([1, 2], [0.0, 1.0], "positive"),
    ],
)
def test_a_fit_that_cannot_be_made_says_why(sizes, times, said) -> None:
    with pytest.raises(CourseError, match=said):
        fit_alpha_beta(sizes, times)


def rows(kind: str, n: int, alpha: float, bw: float) -> list[dict]:
    return [
        {"kind": kind, "processes": n, "bytes": s, "seconds": alpha + s / bw}
        for s in (64, 512, 4096, 32768)
    ]


def test_fit_collectives_fits_each_kind_and_group_on_the_sizes_given() -> None:
    measured = rows("all_reduce", 2, 1e-4, 1e9) + rows("all_gather", 4, 2e-4, 4e9)
    measured[1]["seconds"] *= 10  # 512 B: left out of the fit below
    fits = fit_collectives(measured, sizes=[64, 4096, 32768])
    assert set(fits) == {("all_reduce", 2), ("all_gather", 4)}
    assert fits["all_reduce", 2].latency == pytest.approx(1e-4)
    assert fits["all_gather", 4].bandwidth == pytest.approx(4e9)
    assert fits["all_gather", 4].bus_bandwidth == pytest.approx(3e9)
    assert fits["all_reduce", 2].predict(1e6) == pytest.approx(1e-4 + 1e-3)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_an_all_reduce_fit_is_a_link_for_chapter_13(n: int) -> None:
    fit = fit_collectives(rows("all_reduce", n, 3e-4, 2e9))["all_reduce", n]
    link = fit.as_link(flops=1e11)
    for nbytes in (1e3, 1e6, 1e8):
        assert ring_all_reduce_seconds(nbytes, n, link) == pytest.approx(
            fit.predict(nbytes)
        )
    other = fit_collectives(rows("all_gather", n, 3e-4, 2e9))["all_gather", n]
    with pytest.raises(CourseError, match="all-reduce fit"):
        other.as_link(flops=1e11)


def test_bucket_caps_follow_ddp() -> None:
    assert ddp_bucket_caps(None) == (MiB, 25 * MiB)
    assert ddp_bucket_caps(4) == (4 * MiB, 4 * MiB)
    assert ddp_bucket_caps(0.5) == (MiB // 2, MiB // 2)
    with pytest.raises(CourseError, match="positive"):
        ddp_bucket_caps(0)


def test_buckets_close_once_full_and_never_split_a_gradient() -> None:
    sizes = [300, 300, 500, 2000, 100, 100]
    assert assign_buckets(sizes, (500, 1000)) == [[0, 1], [2, 3], [4, 5]]
    assert assign_buckets(sizes, (10_000, 10_000)) == [[0, 1, 2, 3, 4, 5]]
    assert assign_buckets(sizes, (1, 1)) == [[0], [1], [2], [3], [4], [5]]


@pytest.mark.parametrize("cap", [None, 0.25, 1.0, 4.0])
def test_buckets_equal_the_reducers_own_assignment(cap) -> None:
    """torch's C++ rule, called as DDP calls it when it rebuilds its buckets."""
    model = GPT(GPTConfig(n_layer=2, n_embd=128, block_size=64, vocab_size=64))
    ready = list(reversed(list(model.parameters())))  # as a backward pass makes them
    indices = list(range(len(ready)))
    theirs, _ = dist._compute_bucket_assignment_by_size(
        ready, list(ddp_bucket_caps(cap)), [False] * len(ready), indices
    )
    sizes = [p.numel() * p.element_size() for p in ready]
    assert assign_buckets(sizes, ddp_bucket_caps(cap)) == [list(b) for b in theirs]


def test_the_schedule_overlaps_buckets_with_the_backward_pass() -> None:
    # Three gradients ready at 1, 2, 3 s; the backward pass ends at 4 s.
    plan = overlap_schedule(
        [1.0, 2.0, 3.0],
        [10, 10, 10],
        [[0], [1, 2]],
        lambda nbytes: nbytes / 10,
        backward=4.0,
    )
    assert plan.ready == [1.0, 3.0]
    assert plan.start == [1.0, 3.0] and plan.end == [2.0, 5.0]
    assert plan.exposed == pytest.approx(1.0) and plan.communication == 3.0
    assert plan.cost(0.0) == pytest.approx(1.0)
    assert plan.cost(1.0) == pytest.approx(3.0)
    with pytest.raises(CourseError, match="between 0 and 1"):
        plan.cost(1.5)


def test_a_busy_link_delays_the_next_bucket() -> None:
    plan = overlap_schedule([1.0, 1.5], [40, 10], [[0], [1]], lambda b: b / 10, 2.0)
    assert plan.start == [1.0, 5.0] and plan.end == [5.0, 6.0]
    assert plan.exposed == pytest.approx(4.0)


def test_merged_intervals() -> None:
    assert merge_intervals([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]


def event(name, ts, dur, tid, cat="cpu_op") -> dict:
    return {
        "ph": "X",
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": 1,
        "tid": tid,
        "cat": cat,
    }


def test_exposed_communication_on_a_cpu_trace() -> None:
    events = [
        event("aten::mm", 0, 1000, tid=1),  # computation, 0 to 1 ms
        event("aten::add", 1000, 500, tid=1),  # to 1.5 ms
        event("c10d::allreduce_", 1500, 10, tid=1),  # a launch: not computation
        event("gloo:all_reduce", 500, 2000, tid=7, cat="user_annotation"),  # to 2.5
        {"ph": "i", "name": "marker", "ts": 0, "pid": 1, "tid": 1},
    ]
    split = exposed_communication(events)
    assert split["computation"] == pytest.approx(1.5e-3)
    assert split["communication"] == pytest.approx(2e-3)
    assert split["exposed"] == pytest.approx(1e-3)  # 1.5 ms to 2.5 ms
    assert split["collectives"] == 1
    assert split["communication_ms"] == [[0.5, 2.5]]


def test_an_operator_that_encloses_a_wait_does_not_compute_while_it_waits() -> None:
    events = [
        event("CompiledFunctionBackward", 0, 3000, tid=1),  # encloses everything
        event("_c10d_functional::wait_tensor", 1000, 1500, tid=1),
        event("gloo:all_reduce", 500, 2000, tid=7, cat="user_annotation"),
    ]
    split = exposed_communication(events)
    assert split["exposed"] == pytest.approx(1.5e-3)  # the wait, 1 to 2.5 ms


def test_exposed_communication_on_a_gpu_trace() -> None:
    events = [
        event("void gemm_kernel", 0, 1000, tid=7, cat="kernel"),
        event("ncclDevKernel_AllReduce_Sum_f32", 600, 800, tid=20, cat="kernel"),
        event("aten::mm", 0, 50, tid=1),  # the CPU's launch: not the GPU's work
    ]
    split = exposed_communication(events, gpu=True)
    assert split["computation"] == pytest.approx(1e-3)
    assert split["exposed"] == pytest.approx(0.4e-3)


def test_an_empty_trace_is_one_sentence() -> None:
    with pytest.raises(CourseError, match="no computation and no communication"):
        exposed_communication([])


def test_the_reducer_rule_holds_for_a_real_ddp_model() -> None:
    """One process of DDP (gloo): its rebuilt buckets, against the rule."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = GPT(GPTConfig(n_layer=2, n_embd=128, block_size=16, vocab_size=32))
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
        x = torch.randint(0, 32, (2, 16))
        for _ in range(3):  # rebuilt after the first; logged after the next
            ddp(x).sum().backward()
        text = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
        theirs = [[int(i) for i in part.split()] for part in text.split(",")]
        params = list(model.parameters())
        order = [i for bucket in theirs for i in bucket]  # the ready order DDP saw
        sizes = [params[i].numel() * 4 for i in order]
        ours = assign_buckets(sizes, ddp_bucket_caps(0.25))
        assert [[order[i] for i in bucket] for bucket in ours] == theirs
    finally:
        dist.destroy_process_group()


def test_measured_contention_is_taken_round_by_round():
    # round 2 is slow for everything: per round the share lost is 0.5 each time
    steps = {
        "no communication": {"rounds": [1.0, 5.0, 1.0]},
        "backward beside an all-reduce": {"rounds": [1.5, 7.0, 1.5]},
        "all-reduce alone": {"rounds": [1.0, 4.0, 1.0]},
    }
    assert measured_contention(steps) == (pytest.approx(0.5), pytest.approx(0.0))
