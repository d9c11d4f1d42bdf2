"""companion.long_context: every formula against a count made another way.

The scores of ring attention are counted here by walking the ring position by
position (which rank holds which positions, which block it holds at each
step, and whether any query of a block may see any key of it); the bytes by
walking the messages; the saved bytes are measured with autograd's
saved-tensor hooks; the capacity and the drops by routing choices one by one;
the merge by log-sum-exp against attention on all keys at once; the FLOPs per
byte with torch's FLOP counter.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pytest
import torch
import torch.nn.functional as F
from matplotlib.colors import to_rgba
from matplotlib.patches import Rectangle
from torch.utils.flop_counter import FlopCounterMode

from companion.harness.notebook import CourseError
from companion.long_context import (
    all_to_all_bytes_per_rank,
    attend_in_blocks,
    attention_saved_bytes,
    chunks_held,
    context_bytes_per_rank,
    dropless_bytes_per_rank,
    dropped_tokens,
    expert_capacity,
    expert_flops_per_byte,
    plot_causal_blocks,
    plot_ring_steps,
    plot_token_flow,
    ring_work_per_rank,
    ring_work_per_step,
)
from companion.memory import SavedTensors


def held_positions(seq_len: int, rank: int, world_size: int, split: str) -> list:
    """Each chunk a rank holds, as a range of positions."""
    n = world_size if split == "plain" else 2 * world_size
    size = seq_len // n
    chunks = [rank] if split == "plain" else [rank, n - 1 - rank]
    return [range(c * size, (c + 1) * size) for c in chunks]


def walked(seq_len: int, world_size: int, split: str, causal: bool) -> list[list[int]]:
    """Scores per rank and step: every pair of chunks that holds one visible pair
    is computed whole."""
    work = []
    for rank in range(world_size):
        row = []
        for step in range(world_size):
            owner = (rank - step) % world_size
            row.append(
                sum(
                    len(q) * len(k)
                    for q in held_positions(seq_len, rank, world_size, split)
                    for k in held_positions(seq_len, owner, world_size, split)
                    if not causal or min(k) <= max(q)
                )
            )
        work.append(row)
    return work


@pytest.mark.parametrize("split", ["plain", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_ring_work_equals_a_walk_around_the_ring(split, causal, world_size):
    seq_len = 8 * world_size
    assert ring_work_per_step(seq_len, world_size, split, causal) == walked(
        seq_len, world_size, split, causal
    )


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_zigzag_balances_the_causal_work_and_plain_does_not(world_size):
    T = 16 * world_size
    plain = ring_work_per_rank(T, world_size, "plain", True)
    zigzag = ring_work_per_rank(T, world_size, "zigzag", True)
    assert len(set(zigzag)) == 1
    assert max(plain) / (sum(plain) / world_size) == pytest.approx(
        2 * world_size / (world_size + 1)
    )
    assert plain == [(r + 1) * (T // world_size) ** 2 for r in range(world_size)]
    assert zigzag[0] == (2 * world_size + 1) * (T // (2 * world_size)) ** 2
    # both cover every visible pair; the diagonal blocks compute a few hidden ones
    assert min(sum(plain), sum(zigzag)) >= T * (T + 1) // 2
    assert ring_work_per_rank(T, world_size, "plain", False) == [
        T * T // world_size
    ] * (world_size)


def walked_messages(method: str, N: int, block: int, grad: int) -> dict[str, int]:
    """Bytes rank 0 sends, message by message (block: one rank's keys or values)."""
    if method == "ring":  # K and V on to the next rank at steps 0 .. N-2, twice;
        forward = sum(2 * block for step in range(N - 1))  # gradients at 1 .. N-1
        gradients = sum(2 * grad for step in range(1, N))
        return {"forward": forward, "backward": forward + gradients}
    # a ring all-gather: at each of N-1 steps, forward the pair received last;
    # a ring reduce-scatter of 2N gradient blocks: N-1 steps of 2N/N blocks
    return {
        "forward": sum(2 * block for _ in range(N - 1)),
        "backward": sum(2 * N * block // N for _ in range(N - 1)),
    }


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("dtype_bytes", [2, 8])
def test_ring_and_allgather_bytes_walk_the_messages(method, dtype_bytes):
    B, H, T, D, N = 2, 3, 64, 8, 4
    block = B * H * (T // N) * D
    expected = walked_messages(
        method, N, block * dtype_bytes, block * max(dtype_bytes, 4)
    )
    assert context_bytes_per_rank(method, B, H, T, D, N, dtype_bytes) == expected
    alone = context_bytes_per_rank(method, B, H, T, D, 1, dtype_bytes)
    assert alone == {"forward": 0, "backward": 0}


def test_grouped_query_heads_shrink_the_ring_and_ulysses_sends_less():
    B, H, T, D, N = 1, 8, 64, 4, 4
    full = context_bytes_per_rank("ring", B, H, T, D, N, 2)
    gqa = context_bytes_per_rank("ring", B, H, T, D, N, 2, kv_heads=2)
    assert {k: 4 * v for k, v in gqa.items()} == full  # 8 / 2 heads travel
    # Ulysses: 4 tensors of B H T/N D values, (N-1)/N of each leaves
    ulysses = context_bytes_per_rank("ulysses", B, H, T, D, N, 2)
    assert ulysses["forward"] == 4 * B * H * (T // N) * D * 2 * (N - 1) // N
    assert ulysses["forward"] < full["forward"]
    with pytest.raises(CourseError, match="divisible"):
        context_bytes_per_rank("ulysses", B, 6, T, D, N, 2)
    with pytest.raises(CourseError, match="choose one of"):
        context_bytes_per_rank("striped", B, H, T, D, N, 2)


def test_blocks_merged_by_log_sum_exp_are_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 3, 24, 8, generator=g, dtype=torch.float64) for _ in "qkv"
    )
    whole = F.scaled_dot_product_attention(q, k, v)
    for blocks in (1, 2, 4):
        assert torch.allclose(attend_in_blocks(q, k, v, blocks), whole, atol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_saved_bytes_of_unsplit_attention_are_measured(causal):
    B, H, T, D = 2, 3, 16, 4
    q, k, v = (
        torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True) for _ in "qkv"
    )
    with SavedTensors() as fused:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert fused.nbytes == attention_saved_bytes("sdpa", B, H, T, D, 1, 8)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    with SavedTensors(exclude=[future]) as explicit:
        s = q @ k.transpose(-2, -1) / math.sqrt(D)
        (s.masked_fill(future, -math.inf) if causal else s).softmax(-1) @ v
    assert explicit.nbytes == attention_saved_bytes("explicit", B, H, T, D, 1, 8)


def test_saved_bytes_of_the_split_variants():
    B, H, T, D, N = 1, 2, 32, 8, 4
    assert attention_saved_bytes("ring", B, H, T, D, N, 4) * N == attention_saved_bytes(
        "sdpa", B, H, T, D, 1, 4
    )
    ring = attention_saved_bytes("ring", B, H, T, D, N, 8)
    assert attention_saved_bytes("ulysses", B, H, T, D, N, 8) == ring + 2 * T * 8
    gathered = attention_saved_bytes("allgather", B, H, T, D, N, 4, causal=False)
    assert gathered == (B * H * ((2 * D + 1) * T // N + 2 * D * T)) * 4
    mask = (T // N) * T * 4
    assert attention_saved_bytes("allgather", B, H, T, D, N, 4) == gathered + mask
    with pytest.raises(CourseError, match="choose one of"):
        attention_saved_bytes("flash", B, H, T, D, N, 4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fused_saved_bytes_with_grouped_query_heads_are_measured(dtype):
    """The CPU's fused kernel keeps k and v ungrouped, the log-sum-exp in float32
    at least."""
    B, H, kv, T, D = 2, 4, 2, 16, 8
    q = torch.randn(B, H, T, D, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, kv, T, D, dtype=dtype, requires_grad=True) for _ in "kv")
    with SavedTensors() as fused:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    b = dtype.itemsize
    assert fused.nbytes == attention_saved_bytes("sdpa", B, H, T, D, 1, b, kv_heads=kv)


def routed(counts: list[int], capacity: int) -> int:
    """Choices kept when each expert takes them one at a time up to its capacity."""
    kept = 0
    for count in counts:
        slots = capacity
        for _ in range(count):
            if slots:
                kept, slots = kept + 1, slots - 1
    return sum(counts) - kept


def test_capacity_and_drops():
    assert expert_capacity(512, 8, 2, 1.25) == 160  # 160.00000000000003 in floats
    assert expert_capacity(100, 8, 2, 1.0) == 25
    assert expert_capacity(101, 8, 2, 1.0) == 26
    assert expert_capacity(128, 4, 2, 2.0) == 128  # E / k: room for every token
    counts = [50, 3, 0, 27]
    assert dropped_tokens(counts, 20) == routed(counts, 20) == 30 + 7
    assert dropped_tokens(counts, 50) == 0
    with pytest.raises(CourseError, match="top_k"):
        expert_capacity(10, 2, 3, 1.0)
    with pytest.raises(CourseError, match="positive"):
        expert_capacity(10, 4, 2, 0.0)


def test_all_to_all_bytes_leave_out_the_own_slice():
    # 8 experts on 4 ranks, capacity 40, width 16, float64: 3 of 4 slices leave
    assert all_to_all_bytes_per_rank(8, 40, 16, 4, 8) == 3 * 2 * 40 * 16 * 8
    assert all_to_all_bytes_per_rank(8, 40, 16, 1, 8) == 0
    with pytest.raises(CourseError, match="divide evenly"):
        all_to_all_bytes_per_rank(6, 40, 16, 4, 8)


def test_dropless_bytes_follow_each_choice():
    counts = [[5, 0, 9, 1], [2, 2, 2, 2]]  # 2 ranks, experts 0-1 on rank 0
    row = 16 * 2
    dispatch, combine = [0, 0], [0, 0]
    for source, row_counts in enumerate(counts):  # one choice at a time
        for expert, count in enumerate(row_counts):
            home = expert // 2
            for _ in range(count):
                if home != source:
                    dispatch[source] += row  # there, from the source
                    combine[home] += row  # and back, from the expert's rank
    assert dropless_bytes_per_rank(counts, 16, 2) == [
        {"dispatch": d, "combine": c} for d, c in zip(dispatch, combine)
    ]


def test_flops_per_byte_of_an_expert_layer_are_counted():
    """FLOPs of one expert MLP over rows that (N - 1)/N of travel, there and back."""
    d, hidden, rows, N, b = 16, 64, 40, 4, 2
    x = torch.randn(rows, d)
    w1, w2 = torch.randn(d, hidden), torch.randn(hidden, d)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.gelu(x @ w1) @ w2
    sent = 2 * rows * (N - 1) // N * d * b
    assert counter.get_total_flops() / sent == pytest.approx(
        expert_flops_per_byte(hidden, b, N)
    )
    with pytest.raises(CourseError, match="world_size >= 2"):
        expert_flops_per_byte(hidden, b, 1)


def test_flops_per_byte_of_swiglu_experts_count_three_products():
    """A SwiGLU expert (gate, up, down: DeepSeek-V3's) computes 3/2 of the MLP's."""
    d, hidden, rows, N, b = 16, 64, 40, 4, 2
    x = torch.randn(rows, d)
    gate, up, down = (
        torch.randn(d, hidden),
        torch.randn(d, hidden),
        torch.randn(hidden, d),
    )
    with FlopCounterMode(display=False) as counter:
        (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down
    sent = 2 * rows * (N - 1) // N * d * b
    assert counter.get_total_flops() / sent == pytest.approx(
        expert_flops_per_byte(hidden, b, N, matrices=3)
    )
    with pytest.raises(CourseError, match="matrices must be at least 1"):
        expert_flops_per_byte(hidden, b, N, matrices=0)


def test_chunks_and_bad_splits():
    assert chunks_held(1, 4, "plain") == [1]
    assert chunks_held(1, 4, "zigzag") == [1, 6]
    with pytest.raises(CourseError, match="rank 4"):
        chunks_held(4, 4, "plain")
    with pytest.raises(CourseError, match="choose one of"):
        ring_work_per_rank(16, 2, "striped", True)
    with pytest.raises(CourseError, match="do not divide evenly"):
        ring_work_per_rank(12, 4, "zigzag", True)


def test_figures_draw_one_patch_per_block():
    try:
        ax = plot_ring_steps(4, "zigzag")
        assert sum(isinstance(p, Rectangle) for p in ax.patches) == 16
        ax = plot_causal_blocks(4, "plain")
        # 4 r + 4 chunk pairs on rank r: its r + 1 blocks of 2 x 2 chunks
        assert len(ax.patches) == sum(4 * (r + 1) for r in range(4))
        ax = plot_causal_blocks(4, "zigzag")
        assert len(ax.patches) == 8 * 9 // 2  # the blocks on and below the diagonal
        ax = plot_causal_blocks(2, "zigzag", causal=False)
        assert len(ax.patches) == 16
        counts = [[5, 0, 9, 1], [2, 2, 2, 2]]
        ax = plot_token_flow(counts, capacity=4)
        dropped = [p for p in ax.patches if p.get_hatch() == "///"]
        assert len(dropped) == 2  # expert 0 and expert 2 drop choices of rank 0
        assert sorted(p.get_height() for p in dropped) == [1, 5]  # 5 - 4, 9 - 4
        assert all(p.get_edgecolor() == to_rgba("C0") for p in dropped)  # rank 0's
        bars = [p for p in ax.patches if p not in dropped and p.get_width() < 0.5]
        assert sum(p.get_height() for p in bars) == 4 + 0 + 4 + 1 + 2 * 4  # kept
        assert len(ax.lines) == 4  # one dashed capacity line per expert
        with pytest.raises(CourseError, match="one row per rank"):
            plot_token_flow([[1, 2, 3, 4], [1, 2]], capacity=2)
    finally:
        plt.close("all")
