"""Long sequences and many experts in numbers: formulas and figures.

Chapter 14 splits one sequence across processes (context parallelism, with
ring attention) and a mixture-of-experts layer's experts across processes
(expert parallelism). Its scripts count what they compute and send; this
module holds what the notebook compares the counts with, and draws them:

- ring attention: the query-key scores each rank computes at each step of
  the ring, under a plain or a zig-zag split, causal or not
  (``ring_work_per_step``, ``ring_work_per_rank``); the bytes each rank
  sends (``ring_bytes_per_rank``); the bytes attention keeps for backward
  (``attention_saved_bytes``);
- experts: the capacity of an expert (``expert_capacity``), the tokens a
  full expert drops (``dropped_tokens``), and the bytes of the all-to-alls
  (``all_to_all_bytes_per_rank``);
- figures: which key and value block each rank holds at each step
  (``plot_ring_steps``), who computes which block of a causal score matrix
  (``plot_causal_blocks``), and tokens travelling to experts and back
  (``plot_token_flow``).

Counts of scores are per sequence and head: one score is one query against
one key, 4 head_dim FLOPs in the forward pass (q.k and p.v). Used in
chapter 14.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from companion.notebook import CourseError
from companion.plotting import new_axes

__all__ = [
    "SPLITS",
    "all_to_all_bytes_per_rank",
    "attention_saved_bytes",
    "chunks_held",
    "dropped_tokens",
    "expert_capacity",
    "plot_causal_blocks",
    "plot_ring_steps",
    "plot_token_flow",
    "ring_bytes_per_rank",
    "ring_work_per_rank",
    "ring_work_per_step",
]

SPLITS = ("plain", "zigzag")


def _check_split(seq_len: int, world_size: int, split: str) -> int:
    """The length of one chunk, after checking that the split is possible."""
    if split not in SPLITS:
        raise CourseError(f"no split {split!r}; choose one of {', '.join(SPLITS)}.")
    if world_size < 1:
        raise CourseError(f"world_size must be at least 1, not {world_size}.")
    chunks = world_size * (1 if split == "plain" else 2)
    if seq_len < 1 or seq_len % chunks:
        raise CourseError(
            f"a {split} split over {world_size} ranks cuts the sequence into "
            f"{chunks} chunks; {seq_len} positions do not divide evenly."
        )
    return seq_len // chunks


def chunks_held(rank: int, world_size: int, split: str) -> list[int]:
    """The chunks a rank holds: r of N (plain), or r and 2N - 1 - r of 2N (zig-zag)."""
    _check_split(2 * world_size, world_size, split)
    if not 0 <= rank < world_size:
        raise CourseError(f"rank {rank} is not in 0..{world_size - 1}.")
    return [rank] if split == "plain" else [rank, 2 * world_size - 1 - rank]


def ring_work_per_step(
    seq_len: int, world_size: int, split: str, causal: bool
) -> list[list[int]]:
    """Scores each rank computes at each step of the ring, ``[rank][step]``.

    At step i rank r holds the keys and values of rank r - i (mod N).
    Without a mask every step is a (T/N) x (T/N) block. With a causal mask a
    block of key chunks that all lie after the query chunk is skipped, and a
    block on the diagonal is computed whole (masked inside):

    - plain split, L = T/N: L^2 at step 0, then L^2 while i <= r, else 0;
    - zig-zag split, c = T/(2N): 3 c^2 at step 0 (two diagonal blocks and the
      late chunk against the early one), then 2 c^2 at every step.
    """
    chunk = _check_split(seq_len, world_size, split)
    block = (seq_len // world_size) ** 2
    if not causal:
        return [[block] * world_size for _ in range(world_size)]
    if split == "plain":
        return [
            [block if step <= rank else 0 for step in range(world_size)]
            for rank in range(world_size)
        ]
    return [
        [(3 if step == 0 else 2) * chunk**2 for step in range(world_size)]
        for _ in range(world_size)
    ]


def ring_work_per_rank(
    seq_len: int, world_size: int, split: str, causal: bool
) -> list[int]:
    """Scores each rank computes in the forward pass (the backward pass again).

    T^2/N without a mask; causal: (r + 1) (T/N)^2 with the plain split,
    (2N + 1) (T/2N)^2 on every rank with the zig-zag split.
    """
    return [sum(row) for row in ring_work_per_step(seq_len, world_size, split, causal)]


def ring_bytes_per_rank(
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    world_size: int,
    dtype_bytes: int,
) -> dict[str, int]:
    """Bytes each rank sends to the next in one forward and one backward pass.

    A block is one rank's keys (or values): batch x heads x T/N x head_dim.
    Forward: the keys and values pass N - 1 times. Backward: they pass N - 1
    times again, and their gradients N times (the last pass brings them home).
    """
    _check_split(seq_len, world_size, "plain")
    block = batch * heads * (seq_len // world_size) * head_dim * dtype_bytes
    return {
        "forward": 2 * (world_size - 1) * block,
        "backward": (2 * (world_size - 1) + 2 * world_size) * block,
    }


def attention_saved_bytes(
    method: str,
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    world_size: int = 1,
    dtype_bytes: int = 4,
    causal: bool = True,
) -> int:
    """Bytes one rank's attention keeps for backward (the projections aside).

    - ``"explicit"`` (one process, ``softmax(q k^T) v`` written out): q, k, v
      and the T x T probabilities, (3 D + T) per position and head;
    - ``"sdpa"`` (one process, a fused kernel): q, k, v, the output and a
      log-sum-exp, 4 D + 1;
    - ``"ring"``: the same, for T/N positions;
    - ``"allgather"``: q, the output and the log-sum-exp for T/N positions
      (2 D + 1), the gathered keys and values for all T (2 D), and, if
      causal, the mask: an additive (T/N) x T matrix of zeros and -inf.
    """
    B, H, T, D, N = batch, heads, seq_len, head_dim, world_size
    _check_split(T, N, "plain")
    local = T // N
    per_position = {
        "explicit": (3 * D + T) * T,
        "sdpa": (4 * D + 1) * T,
        "ring": (4 * D + 1) * local,
        "allgather": (2 * D + 1) * local + 2 * D * T,
    }
    if method not in per_position:
        raise CourseError(
            f"no formula for {method!r}; choose one of {', '.join(per_position)}."
        )
    mask = local * T if method == "allgather" and causal else 0
    return (B * H * per_position[method] + mask) * dtype_bytes


def expert_capacity(
    tokens: int, n_experts: int, top_k: int, capacity_factor: float
) -> int:
    """Slots per expert: ceil(capacity_factor x top_k x tokens / n_experts).

    ``tokens`` is the group that is routed together (one rank's batch). A
    capacity factor of n_experts / top_k gives every expert room for every
    token: nothing can be dropped.
    """
    if min(tokens, n_experts, top_k) < 1 or top_k > n_experts:
        raise CourseError(
            "tokens, experts and top_k must be at least 1, and top_k at most the "
            f"experts; not {tokens}, {n_experts} and {top_k}."
        )
    if capacity_factor <= 0:
        raise CourseError(
            f"the capacity factor must be positive, not {capacity_factor}."
        )
    # round first: 1.25 * 2 * 512 / 8 is 160.00000000000003 in floating point
    return math.ceil(round(capacity_factor * top_k * tokens / n_experts, 9))


def dropped_tokens(counts: Sequence[int], capacity: int) -> int:
    """Assignments an expert cannot take: the sum of max(0, count - capacity)."""
    return sum(max(0, count - capacity) for count in counts)


def all_to_all_bytes_per_rank(
    n_experts: int, capacity: int, width: int, world_size: int, dtype_bytes: int
) -> int:
    """Bytes one rank sends to the others in one all-to-all of expert buffers.

    Each rank fills a buffer of n_experts x capacity slots of ``width``
    values and keeps the slice of its own experts: (N - 1)/N of the buffer
    leaves. A mixture-of-experts layer makes two in the forward pass
    (dispatch, combine) and two in the backward pass.
    """
    if world_size < 1 or n_experts % world_size:
        raise CourseError(
            f"{n_experts} experts do not divide evenly over {world_size} ranks."
        )
    return (world_size - 1) * (n_experts // world_size) * capacity * width * dtype_bytes


def plot_ring_steps(world_size: int, split: str, *, ax: Axes | None = None) -> Axes:
    """Which rank's keys and values each rank holds at each step of the ring.

    One row per rank, one column per step; a cell is coloured by the rank
    whose block it holds and labelled with that block's chunks. Arrows show
    each block moving to the next rank after a step.
    """
    chunks_held(0, world_size, split)
    ax = ax or new_axes(width=1.3 * world_size + 1.5, height=0.6 * world_size + 1)[0]
    for step in range(world_size):
        for rank in range(world_size):
            owner = (rank - step) % world_size
            chunks = ",".join(map(str, chunks_held(owner, world_size, split)))
            ax.add_patch(
                Rectangle((step, rank), 0.8, 0.8, color=f"C{owner}", alpha=0.55, lw=0)
            )
            ax.text(
                step + 0.4,
                rank + 0.4,
                f"KV {chunks}",
                ha="center",
                va="center",
                fontsize=8,
            )
            if step < world_size - 1:
                target = (rank + 1) % world_size
                ax.add_patch(
                    FancyArrowPatch(
                        (step + 0.8, rank + 0.4),
                        (step + 1.0, target + 0.4),
                        arrowstyle="->",
                        mutation_scale=8,
                        color="0.4",
                        lw=0.8,
                    )
                )
    ax.set(
        xlim=(-0.1, world_size),
        ylim=(world_size, -0.2),
        xticks=[s + 0.4 for s in range(world_size)],
        xticklabels=[f"step {s}" for s in range(world_size)],
        yticks=[r + 0.4 for r in range(world_size)],
        yticklabels=[f"rank {r}" for r in range(world_size)],
    )
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    return ax


def plot_causal_blocks(
    world_size: int, split: str, *, causal: bool = True, ax: Axes | None = None
) -> Axes:
    """The score matrix in chunks, each computed block coloured by its rank.

    Rows are query chunks, columns key chunks, in sequence order (2N chunks
    for both splits, so that the two pictures compare). A block is computed
    by the rank that holds its query chunk. Under a causal mask the blocks
    after it are skipped (white), and a rank's diagonal block is computed
    whole and masked inside (hatched): for the plain split that block is
    two chunks wide.
    """
    chunks_held(0, world_size, split)
    n = 2 * world_size
    owner = {
        c: rank
        for rank in range(world_size)
        for c in (
            chunks_held(rank, world_size, split)
            if split == "zigzag"
            else [2 * rank, 2 * rank + 1]
        )
    }
    ax = ax or new_axes(width=3.2, height=3.2)[0]
    width = 2 if split == "plain" else 1  # chunks per block of the ring
    for q in range(n):
        for k in range(n):
            if causal and k // width > q // width:
                continue
            ax.add_patch(
                Rectangle(
                    (k, q),
                    1,
                    1,
                    facecolor=f"C{owner[q]}",
                    alpha=0.6,
                    edgecolor="white",
                    hatch="////" if causal and k // width == q // width else None,
                )
            )
    ax.set(
        xlim=(0, n),
        ylim=(n, 0),
        aspect="equal",
        xlabel="key chunk",
        ylabel="query chunk",
    )
    ax.set_xticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)], fontsize=7)
    ax.set_yticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)], fontsize=7)
    ax.legend(
        handles=[
            Patch(color=f"C{r}", alpha=0.6, label=f"rank {r}")
            for r in range(world_size)
        ],
        fontsize=7,
        loc="upper right",
    )
    return ax


def plot_token_flow(
    counts: Sequence[Sequence[int]], capacity: int, *, ax: Axes | None = None
) -> Axes:
    """Tokens travelling from ranks to experts and back.

    ``counts[r][e]`` is the number of assignments rank r routes to expert e
    (before capacity). Lines from each rank on the left to each expert in the
    middle (drawn beside the rank that holds it) are as thick as the tokens
    that expert keeps from that rank; the experts' bars show the kept tokens
    against each rank's capacity (dashed) and the dropped ones in red; lines
    on the right take the results back to the ranks they came from. Each
    expert has ``capacity`` slots for each rank (between the dashed lines).
    """
    world_size, n_experts = len(counts), len(counts[0])
    if any(len(row) != n_experts for row in counts) or n_experts % world_size:
        raise CourseError(
            "counts must have one row per rank and one column per expert, with "
            "the experts divisible by the ranks."
        )
    ax = ax or new_axes(width=7.0, height=0.45 * n_experts + 1.2)[0]
    kept = [[min(c, capacity) for c in row] for row in counts]
    most = max(max(row) for row in counts) or 1
    rank_y = [(r + 0.5) * n_experts / world_size - 0.5 for r in range(world_size)]
    local = n_experts // world_size
    for e in range(n_experts):
        holder = e // local
        ax.add_patch(
            Rectangle((2.6, e - 0.45), 1.8, 0.9, color=f"C{holder}", alpha=0.15, lw=0)
        )
        overflow = 4.45
        for r in range(world_size):  # capacity slots for each source rank
            left, width = 2.7 + 1.6 * r / world_size, 1.6 / world_size
            share = width * kept[r][e] / capacity
            ax.add_patch(
                Rectangle((left, e - 0.3), share, 0.6, color=f"C{r}", alpha=0.7)
            )
            drop = counts[r][e] - kept[r][e]
            if drop:  # beyond the capacity: dropped, stacked to the right
                size = 0.6 * drop / most
                ax.add_patch(Rectangle((overflow, e - 0.3), size, 0.6, color="tab:red"))
                overflow += size
        for r in range(world_size):
            ax.plot(
                [2.7 + 1.6 * (r + 1) / world_size] * 2,
                [e - 0.4, e + 0.4],
                "k--",
                lw=0.6,
            )
        ax.text(2.65, e, f"expert {e}", ha="right", va="center", fontsize=7)
        for r in range(world_size):
            if kept[r][e]:
                lw = 0.5 + 4 * kept[r][e] / most
                ax.plot([0.7, 2.0], [rank_y[r], e], color=f"C{r}", lw=lw, alpha=0.5)
                ax.plot([5.2, 6.5], [e, rank_y[r]], color=f"C{r}", lw=lw, alpha=0.5)
    for r in range(world_size):
        for x, label in ((0.0, f"rank {r}"), (6.6, f"rank {r}")):
            ax.text(
                x,
                rank_y[r],
                label,
                va="center",
                fontsize=8,
                color=f"C{r}",
                weight="bold",
            )
    ax.text(1.35, -1.0, "dispatch (all-to-all)", ha="center", fontsize=8)
    ax.text(5.85, -1.0, "combine (all-to-all)", ha="center", fontsize=8)
    ax.set(xlim=(-0.1, 7.4), ylim=(n_experts - 0.4, -1.4))
    ax.axis("off")
    ax.legend(
        handles=[Patch(color="tab:red", label="dropped (over capacity)")],
        fontsize=7,
        loc="lower center",
        bbox_to_anchor=(0.5, -0.12),
    )
    return ax
