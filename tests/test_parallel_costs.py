"""companion.parallel_costs: the bubble formula, the timeline figure and the cost model."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from companion.gpt import GPT, CharText, GPTConfig, lm_loss
from companion.notebook import CourseError
from companion.parallel_costs import (
    DeviceAndLink,
    GPTWorkload,
    bubble_fraction,
    plot_pipeline_timeline,
    ring_all_reduce_seconds,
    step_costs,
)

FAST = DeviceAndLink("ideal", flops=1e12, bandwidth=float("inf"), latency=0.0)


@pytest.mark.parametrize(
    "p, m, v, expected",
    [(1, 8, 1, 0.0), (2, 1, 1, 1 / 2), (4, 8, 1, 3 / 11), (2, 4, 2, 1 / 9)],
)
def test_bubble_fraction(p, m, v, expected) -> None:
    assert bubble_fraction(p, m, v) == pytest.approx(expected)


def test_bubble_fraction_refuses_zero() -> None:
    with pytest.raises(CourseError, match="at least 1, not 2, 0 and 1"):
        bubble_fraction(2, 0)


def test_step_flops_match_the_flop_counter() -> None:
    """PyTorch's own FLOP counter over a real training step, minus the head."""
    text = CharText()
    config = GPTConfig(vocab_size=text.vocab_size, block_size=32, n_layer=2, n_embd=32)
    model = GPT(config)
    x, y = text.batch(3, 32, torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(x), y).backward()
    head = 3 * 2 * config.vocab_size * config.n_embd * x.numel()
    ours = GPTWorkload(n_layer=2, n_embd=32, seq_len=32, batch_size=3)
    assert counter.get_total_flops() - head == ours.step_flops


def test_ring_all_reduce() -> None:
    hw = DeviceAndLink("link", flops=1.0, bandwidth=100.0, latency=0.5)
    assert ring_all_reduce_seconds(400, 1, hw) == 0.0
    assert ring_all_reduce_seconds(400, 4, hw) == pytest.approx(1.5 * 4 + 6 * 0.5)


def test_step_costs_on_an_ideal_link_divide_the_compute() -> None:
    model = GPTWorkload(n_layer=4, n_embd=64, seq_len=64, batch_size=8)
    alone = model.step_flops / FAST.flops
    for layout in ("data", "tensor"):
        costs = step_costs(model, FAST, layout, 4)
        assert costs["total"] == pytest.approx(alone / 4)
        assert costs["communication"] == costs["bubble"] == 0
    pipe = step_costs(model, FAST, "pipeline", 4, microbatches=8)
    assert pipe["compute"] == pytest.approx(alone / 4)
    # 8 micro-batches of work in 11 slots: the bubble is 3 slots.
    assert pipe["bubble"] == pytest.approx(alone / 4 * 3 / 8)


def test_step_costs_count_the_bytes() -> None:
    model = GPTWorkload(n_layer=2, n_embd=8, seq_len=4, batch_size=2, dtype_bytes=4)
    hw = DeviceAndLink("slow", flops=float("inf"), bandwidth=1000.0, latency=0.01)
    # data: the 12 * 2 * 64 parameters' 4 bytes, all-reduced over 2 devices.
    assert step_costs(model, hw, "data", 2)["total"] == pytest.approx(
        6144 / 1000 + 2 * 0.01
    )
    # tensor: 4 all-reduces of 2 x 4 x 8 x 4 = 256 bytes per block.
    assert step_costs(model, hw, "tensor", 2)["total"] == pytest.approx(
        8 * (256 / 1000 + 2 * 0.01)
    )
    # pipeline, 4 micro-batches of 4 sequences: a quarter of the 4 x 4 x 8 x 4
    # bytes of activations across 1 boundary, each way.
    four = GPTWorkload(n_layer=2, n_embd=8, seq_len=4, batch_size=4, dtype_bytes=4)
    assert step_costs(four, hw, "pipeline", 2, microbatches=4)[
        "communication"
    ] == pytest.approx(2 * (128 / 1000 + 0.01))
    with pytest.raises(CourseError, match="not 'expert'"):
        step_costs(model, hw, "expert", 2)


def test_step_costs_refuse_more_micro_batches_than_sequences() -> None:
    model = GPTWorkload(n_layer=2, n_embd=8, seq_len=4, batch_size=8)
    assert step_costs(model, FAST, "pipeline", 2, microbatches=8)["bubble"] > 0
    with pytest.raises(
        CourseError,
        match=r"^9 micro-batches cannot split a batch of 8 sequences; use at most 8\.$",
    ):
        step_costs(model, FAST, "pipeline", 2, microbatches=9)


def test_the_timeline_draws_every_pass() -> None:
    timeline = {
        "makespan": 0.4,
        "events": [
            [["F", 0, 0, 0.0, 0.1], ["B", 0, 0, 0.3, 0.4]],
            [["F", 1, 0, 0.1, 0.2], ["B", 1, 0, 0.2, 0.3]],
        ],
    }
    ax = plot_pipeline_timeline(timeline, title="GPipe, m = 1")
    bars = [p for p in ax.patches if p.get_width() > 0]
    assert sorted((round(b.get_x()), round(b.get_width())) for b in bars) == [
        (0, 100),
        (100, 100),
        (200, 100),
        (300, 100),
    ]
    assert ax.get_xlim() == (0, 400) and ax.get_title() == "GPipe, m = 1"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["process 0", "process 1"]
    plt.close("all")
