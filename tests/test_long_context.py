"""companion.long_context: every formula against a count made another way.

The scores of ring attention are counted here by walking the ring position by
position (which rank holds which positions, which block it holds at each
step, and whether any query of a block may see any key of it); the saved
bytes are measured with autograd's saved-tensor hooks; the capacity and the
drops by routing choices one by one.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pytest
import torch
import torch.nn.functional as F
from matplotlib.colors import to_rgba
from matplotlib.patches import Rectangle

from companion.long_context import (
    all_to_all_bytes_per_rank,
    attention_saved_bytes,
    chunks_held,
    dropped_tokens,
    expert_capacity,
    plot_causal_blocks,
    plot_ring_steps,
    plot_token_flow,
    ring_bytes_per_rank,
    ring_work_per_rank,
    ring_work_per_step,
)
from companion.memory import SavedTensors
from companion.notebook import CourseError


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


def test_ring_bytes_count_the_passes():
    block = 2 * 3 * (64 // 4) * 8 * 2  # batch, heads, T/N, head_dim, bf16
    assert ring_bytes_per_rank(2, 3, 64, 8, 4, 2) == {
        "forward": 3 * 2 * block,  # K and V pass N - 1 = 3 times
        "backward": 3 * 2 * block + 4 * 2 * block,  # and their gradients N times
    }
    assert ring_bytes_per_rank(2, 3, 64, 8, 1, 2) == {
        "forward": 0,
        "backward": 2 * (2 * 3 * 64 * 8 * 2),
    }


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
    gathered = attention_saved_bytes("allgather", B, H, T, D, N, 4, causal=False)
    assert gathered == (B * H * ((2 * D + 1) * T // N + 2 * D * T)) * 4
    mask = (T // N) * T * 4
    assert attention_saved_bytes("allgather", B, H, T, D, N, 4) == gathered + mask
    with pytest.raises(CourseError, match="choose one of"):
        attention_saved_bytes("flash", B, H, T, D, N, 4)


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
        red = [p for p in ax.patches if p.get_facecolor() == to_rgba("tab:red")]
        assert len(red) == 2  # expert 0 and expert 2 drop choices of rank 0
        with pytest.raises(CourseError, match="one row per rank"):
            plot_token_flow([[1, 2, 3, 4], [1, 2]], capacity=2)
    finally:
        plt.close("all")
