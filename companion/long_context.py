"""Long sequences and many experts in numbers: formulas and figures.

Chapter 14 splits one sequence across processes (context parallelism: ring
attention, Llama 3's all-gather, DeepSpeed-Ulysses' all-to-all) and a
mixture-of-experts layer's experts across processes (expert parallelism).
Its scripts count what they compute and send; this module holds what the
notebook compares the counts with, and draws them:

- context parallelism: the query-key scores each rank computes at each step
  of the ring, under a plain or a zig-zag split, causal or not
  (``ring_work_per_step``, ``ring_work_per_rank``); the bytes each rank sends
  with each method (``context_bytes_per_rank``); the bytes attention keeps for
  backward (``attention_saved_bytes``); attention over blocks of keys merged
  by their log-sum-exp, as a ring of flash kernels does (``attend_in_blocks``);
- experts: the capacity of an expert (``expert_capacity``), the tokens a
  full expert drops (``dropped_tokens``), the bytes of the all-to-alls with
  fixed buffers (``all_to_all_bytes_per_rank``) and dropless
  (``dropless_bytes_per_rank``), and the arithmetic per byte sent
  (``expert_flops_per_byte``);
- figures: which key and value block each rank holds at each step
  (``plot_ring_steps``), who computes which block of a causal score matrix
  (``plot_causal_blocks``), and the choices each expert gets from each rank
  against its capacity (``plot_token_flow``).

Counts of scores are per sequence and head: one score is one query against
one key, 4 head_dim FLOPs in the forward pass (q.k and p.v). Used in
chapter 14.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from companion.harness.notebook import CourseError

if TYPE_CHECKING:  # matplotlib is imported by the figures only: the checks'
    from matplotlib.axes import Axes  # processes need the formulas alone

__all__ = [
    "METHODS",
    "SPLITS",
    "all_to_all_bytes_per_rank",
    "attend_in_blocks",
    "attention_saved_bytes",
    "chunks_held",
    "context_bytes_per_rank",
    "dropless_bytes_per_rank",
    "dropped_tokens",
    "expert_capacity",
    "expert_flops_per_byte",
    "plot_causal_blocks",
    "plot_ring_steps",
    "plot_token_flow",
    "ring_work_per_rank",
    "ring_work_per_step",
]

SPLITS = ("plain", "zigzag")
METHODS = ("ring", "allgather", "ulysses")


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


def context_bytes_per_rank(
    method: str,
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    world_size: int,
    dtype_bytes: int,
    kv_heads: int | None = None,
) -> dict[str, int]:
    """Bytes each rank sends to the others in one forward and one backward pass.

    A block is one rank's keys (or values): batch x kv_heads x T/N x head_dim
    values (grouped-query attention: kv_heads below heads, and only they travel).

    - ``"ring"``: forward, the keys and values pass N - 1 times, 2 (N - 1)
      blocks; backward, they pass N - 1 times again, and each block's
      gradients, summed in float32 at least, N - 1 times (the owner keeps its
      own share): 2 (N - 1) blocks and 2 (N - 1) gradient blocks.
    - ``"allgather"``: a ring all-gather forwards the N - 1 other ranks' keys
      and values, 2 (N - 1) blocks; backward, a reduce-scatter of all 2 N
      gradient blocks sends (N - 1)/N of them: 2 (N - 1) blocks again.
    - ``"ulysses"``: each all-to-all keeps 1/N of its tensor and sends the
      rest: q and the output (heads), k and v (kv_heads), T/N positions each,
      forward; their gradients backward.
    """
    if method not in METHODS:
        raise CourseError(f"no method {method!r}; choose one of {', '.join(METHODS)}.")
    _check_split(seq_len, world_size, "plain")
    N, kv = world_size, kv_heads or heads
    per_head = batch * (seq_len // N) * head_dim  # one head's T/N positions
    blocks = 2 * (N - 1) * per_head * kv  # keys and values, N - 1 times
    if method == "ring":
        gradients = blocks * max(dtype_bytes, 4)
        return {
            "forward": blocks * dtype_bytes,
            "backward": blocks * dtype_bytes + gradients,
        }
    if method == "allgather":
        return {"forward": blocks * dtype_bytes, "backward": blocks * dtype_bytes}
    if heads % N or kv % N:
        raise CourseError(f"Ulysses needs heads and kv_heads divisible by {N}.")
    sent = (N - 1) * per_head * (2 * heads + 2 * kv) // N * dtype_bytes
    return {"forward": sent, "backward": sent}


def attention_saved_bytes(
    method: str,
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    world_size: int = 1,
    dtype_bytes: int = 4,
    causal: bool = True,
    kv_heads: int | None = None,
) -> int:
    """Bytes one rank's attention keeps for backward (the projections aside).

    The log-sum-exp is float32 at least, as fused kernels keep it.

    - ``"explicit"`` (one process, ``softmax(q k^T) v`` written out): q, k, v
      and the T x T probabilities;
    - ``"sdpa"`` (one process, a fused kernel): q, k, v, the output and a
      log-sum-exp per position and head;
    - ``"ring"``: the same, for T/N positions;
    - ``"ulysses"``: the same again (T positions of heads/N heads), and the two
      int64 permutations of the T positions that order the gathered sequence;
    - ``"allgather"``: q, the output and the log-sum-exp for T/N positions,
      the gathered keys and values for all T, and, if causal, the script's
      mask: an additive (T/N) x T matrix of zeros and -inf (production
      versions keep no mask: they call flash kernels on blocks instead).
    """
    B, H, T, D, N = batch, heads, seq_len, head_dim, world_size
    kv, lse_bytes = kv_heads or heads, max(dtype_bytes, 4)
    _check_split(T, N, "plain")
    L = T // N
    fused = (2 * H + 2 * kv) * B * L * D * dtype_bytes + B * H * L * lse_bytes
    saved = {
        "explicit": ((H + 2 * kv) * B * T * D + B * H * T * T) * dtype_bytes,
        "sdpa": (2 * H + 2 * kv) * B * T * D * dtype_bytes + B * H * T * lse_bytes,
        "ring": fused,
        "ulysses": fused + 2 * T * 8,
        "allgather": 2 * B * H * L * D * dtype_bytes
        + 2 * B * kv * T * D * dtype_bytes
        + B * H * L * lse_bytes
        + (L * T * dtype_bytes if causal else 0),
    }
    if method not in saved:
        raise CourseError(
            f"no formula for {method!r}; choose one of {', '.join(saved)}."
        )
    return saved[method]


def attend_in_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: int
) -> torch.Tensor:
    """Attention of q over k and v cut into ``blocks`` blocks of keys, merged
    as a ring of flash kernels merges them: each block's call returns its
    normalised output and its log-sum-exp, and two partial results combine as

        lse = log(exp(lse_a) + exp(lse_b)),
        out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

    in float32 at least. The calls are to the CPU's flash kernel, the one
    ``scaled_dot_product_attention`` dispatches to on a CPU (a private op; the
    GPU's flash kernel returns the log-sum-exp the same way). q, k, v: CPU
    tensors (batch, heads, positions, head_dim), no mask.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    acc = torch.promote_types(q.dtype, torch.float32)
    out = lse = None
    for kb, vb in zip(k.chunk(blocks, dim=2), v.chunk(blocks, dim=2)):
        block_out, block_lse = flash(q, kb, vb, 0.0, False)[:2]
        block_out, block_lse = block_out.to(acc), block_lse.to(acc)
        if out is None:
            out, lse = block_out, block_lse
            continue
        new = torch.logaddexp(lse, block_lse)
        out = (lse - new).exp()[..., None] * out + (block_lse - new).exp()[
            ..., None
        ] * block_out
        lse = new
    return out.to(q.dtype)


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


def dropless_bytes_per_rank(
    counts: Sequence[Sequence[int]], width: int, dtype_bytes: int
) -> list[dict[str, int]]:
    """Bytes each rank sends to the others in a dropless layer's forward pass.

    ``counts[r][e]`` is the number of choices rank r routes to expert e; the
    experts lie in equal, contiguous groups on the ranks. Dispatch: rank r
    sends its choices of the other ranks' experts; combine: it sends back the
    results of the other ranks' choices of its own experts (the counts' own
    all-to-all, a few integers, aside).
    """
    N, E = len(counts), len(counts[0])
    if E % N or any(len(row) != E for row in counts):
        raise CourseError("counts need one row per rank, the experts divisible by N.")
    local, row = E // N, width * dtype_bytes

    def home(e: int) -> int:
        return e // local

    return [
        {
            "dispatch": row * sum(c for e, c in enumerate(counts[r]) if home(e) != r),
            "combine": row
            * sum(
                counts[s][e]
                for s in range(N)
                if s != r
                for e in range(E)
                if home(e) == r
            ),
        }
        for r in range(N)
    ]


def expert_flops_per_byte(
    hidden: int, dtype_bytes: int, world_size: int, matrices: int = 2
) -> float:
    """FLOPs of the experts per byte the all-to-alls send, forward, per rank.

    Each row (a token's choice) costs 2 x matrices x d x hidden FLOPs in an
    expert (2 FLOPs per multiply-add; ``matrices`` products of d x hidden: 2
    for the scripts' MLP, 3 for a SwiGLU expert's gate, up and down) and
    travels twice, d values to the expert and d back; (N - 1)/N of a rank's
    rows travel: the ratio is matrices x hidden N / ((N - 1) dtype_bytes),
    whatever the width d. A transfer hides behind the experts' arithmetic when
    the device computes more FLOPs in the time the link sends a byte than this
    ratio.
    """
    if world_size < 2:
        raise CourseError("with one rank nothing travels: give world_size >= 2.")
    if matrices < 1:
        raise CourseError(f"matrices must be at least 1 (got {matrices}).")
    return matrices * hidden * world_size / ((world_size - 1) * dtype_bytes)


def plot_ring_steps(world_size: int, split: str, *, ax: Axes | None = None) -> Axes:
    """Which rank's keys and values each rank holds at each step of the ring.

    One row per rank, one column per step; a cell is coloured by the rank
    whose block it holds and labelled with that block's chunks. Arrows show
    each block moving to the next rank after a step.
    """
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from companion.harness.plotting import new_axes

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
    from matplotlib.patches import Patch, Rectangle

    from companion.harness.plotting import new_axes

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
    """The choices each expert gets from each rank, against its capacity.

    ``counts[r][e]`` is the number of choices rank r routes to expert e
    (before capacity). For each expert, one bar per source rank, in the
    rank's colour, on one scale: the part up to ``capacity`` (the dashed
    line) is kept, travels to the expert's rank and back; the part above it
    (hatched, unfilled) is dropped. The experts are grouped, on a shaded band, by
    the rank that holds them.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    from companion.harness.plotting import new_axes

    world_size, n_experts = len(counts), len(counts[0])
    if any(len(row) != n_experts for row in counts) or n_experts % world_size:
        raise CourseError(
            "counts must have one row per rank and one column per expert, with "
            "the experts divisible by the ranks."
        )
    ax = ax or new_axes(width=7.0, height=3.0)[0]
    local, width = n_experts // world_size, 0.8 / world_size
    top = max(max(max(row) for row in counts), capacity)
    for e in range(n_experts):
        holder = e // local
        ax.axvspan(e - 0.5, e + 0.5, color=f"C{holder}", alpha=0.08, lw=0)
        ax.plot([e - 0.45, e + 0.45], [capacity] * 2, "k--", lw=0.8)
        for r in range(world_size):
            x = e - 0.4 + (r + 0.5) * width
            kept = min(counts[r][e], capacity)
            ax.add_patch(Rectangle((x - width / 2, 0), width, kept, color=f"C{r}"))
            if counts[r][e] > capacity:
                ax.add_patch(
                    Rectangle(
                        (x - width / 2, capacity),
                        width,
                        counts[r][e] - capacity,
                        facecolor="white",
                        hatch="///",
                        edgecolor=f"C{r}",
                        lw=0.8,
                    )
                )
    ax.set(
        xlim=(-0.5, n_experts - 0.5),
        ylim=(0, 1.08 * top),
        ylabel="choices from each rank",
    )
    ax.set_xticks(
        range(n_experts),
        [f"expert {e}\non rank {e // local}" for e in range(n_experts)],
        fontsize=7,
    )
    ax.legend(
        handles=[
            Patch(color=f"C{r}", label=f"from rank {r}") for r in range(world_size)
        ]
        + [
            Patch(facecolor="white", edgecolor="0.3", hatch="///", label="dropped"),
            Line2D(
                [], [], color="k", ls="--", lw=0.8, label=f"capacity C = {capacity}"
            ),
        ],
        fontsize=7,
        ncol=world_size + 2,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2),
    )
    return ax
