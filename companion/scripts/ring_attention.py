"""Context parallelism: one long sequence split across processes.

    python ring_attention.py                                          # one process
    torchrun --standalone --nproc-per-node=2 ring_attention.py        # two, here
    torchrun --standalone --nproc-per-node=4 ring_attention.py --split zigzag
    torchrun --standalone --nproc-per-node=4 ring_attention.py --method ulysses
    srun --ntasks=8 python ring_attention.py --seq-len 4096 --split zigzag

Each of the N processes holds seq_len / N positions of every sequence, and
their queries, keys and values. Attention needs every key and value; three
methods bring them (--method):

- "ring" (ring attention): blocks of keys and values travel around a ring of
  processes; at each of N steps a process computes its queries against the
  block it holds and passes that block on, while the partial softmaxes are
  combined with a running maximum and sum (online softmax). The backward pass
  sends the blocks round again, followed by their gradients.
- "allgather" (Llama 3's variant): every process gathers all keys and
  values, then attends once; the backward pass reduce-scatters their gradients.
- "ulysses" (DeepSpeed-Ulysses): an all-to-all trades the split of positions
  for a split of heads; each process attends with all positions of heads / N
  heads, and a second all-to-all trades back. Needs heads (and key-value
  heads) divisible by N.

Keys and values may have fewer heads than queries (--n-kv-head: grouped-query
attention); only those travel. With a causal mask, the "plain" split (process
r holds the r-th N-th of the sequence) gives the last process the most work;
the "zigzag" split (chunks r and 2N - 1 - r of 2N) balances it. The script
trains a one-layer model to copy the first half of each sequence into its
second half, which it can only learn if keys and values cross the processes.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import json
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from distributed_setup import fail, setup_distributed, where_it_ran


def chunks_of(rank: int, world_size: int, split: str) -> list[int]:
    """The chunks of the sequence ``rank`` holds, in order: "plain" cuts it into
    N chunks and gives rank r chunk r; "zigzag" cuts it into 2N and gives rank
    r chunks r and 2N - 1 - r, one early and one late."""
    return [rank] if split == "plain" else [rank, 2 * world_size - 1 - rank]


def shard(
    x: torch.Tensor, dim: int, rank: int, world_size: int, split: str
) -> torch.Tensor:
    """This rank's part of ``x`` along the sequence dim ``dim``."""
    pieces = x.chunk(world_size * (1 if split == "plain" else 2), dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, world_size, split)], dim)


def positions(seq_len: int, rank: int, world_size: int, split: str) -> torch.Tensor:
    """The positions in the whole sequence of this rank's part (for embeddings)."""
    return shard(torch.arange(seq_len), 0, rank, world_size, split)


def ring_pass(tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Start sending ``tensor`` to the next rank and receiving the previous
    rank's into a new buffer; wait on the requests before reading the buffer."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, (rank + 1) % world_size),
        dist.P2POp(dist.irecv, received, (rank - 1) % world_size),
    ]
    return received, dist.batch_isend_irecv(ops)


def wait(requests: list) -> None:
    for request in requests:
        request.wait()


def scores(q, k, q_chunk: int, k_chunk: int, causal: bool) -> torch.Tensor:
    """Scaled scores of a chunk of queries against a chunk of keys; a query
    may not see later keys, which only matters when the chunks are the same."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal and q_chunk == k_chunk:
        later = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(later, float("-inf"))
    return s


def block_pairs(
    rank: int, step: int, world_size: int, split: str, causal: bool
) -> list[tuple[int, int, int, int]]:
    """(i, j, query chunk, key chunk) for each pair of chunks this rank computes
    at ``step``, when it holds the keys and values of rank (rank - step) mod N;
    under a causal mask, a query chunk skips key chunks that lie after it."""
    owner = (rank - step) % world_size
    return [
        (i, j, qc, kc)
        for i, qc in enumerate(chunks_of(rank, world_size, split))
        for j, kc in enumerate(chunks_of(owner, world_size, split))
        if not causal or kc <= qc
    ]


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """float32 at least: flash kernels keep their running sums, outputs and
    gradients in float32 whatever the inputs' precision."""
    return torch.promote_types(dtype, torch.float32)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each key-value head serves ``groups`` query heads."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def fold_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``repeat_kv``: the sum over each group of query heads."""
    return x.unflatten(1, (-1, groups)).sum(2) if groups > 1 else x


def ring_forward(q, k, v, causal: bool, split: str):
    """Attention output and log-sum-exp of this rank's queries against all keys.

    q: this rank's (batch, heads, positions, head_dim); k, v: the same with
    kv_heads heads, a divisor of heads (grouped-query attention: only these
    travel). Each query chunk keeps a running maximum ``m``, sum ``l`` and
    unnormalised output ``o``, in float32 at least; a new block rescales them
    by exp(m_old - m_new) (FlashAttention's trick).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    acc, groups = accumulator(q.dtype), q.shape[1] // k.shape[1]
    n = len(chunks_of(rank, world_size, split))
    qs = q.to(acc).chunk(n, dim=2)
    m = [torch.full(c.shape[:-1], -math.inf, dtype=acc, device=q.device) for c in qs]
    l = [torch.zeros_like(mi) for mi in m]
    o = [torch.zeros_like(c) for c in qs]
    kv = torch.stack([k, v])  # one message per step, in the inputs' dtype
    for step in range(world_size):
        if step < world_size - 1:  # send this block on while computing with it
            incoming, requests = ring_pass(kv)
        ks, vs = (repeat_kv(t.to(acc), groups).chunk(n, dim=2) for t in kv)
        for i, j, qc, kc in block_pairs(rank, step, world_size, split, causal):
            s = scores(qs[i], ks[j], qc, kc, causal)
            m_new = torch.maximum(m[i], s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            rescale = torch.exp(m[i] - m_new)
            l[i] = l[i] * rescale + p.sum(dim=-1)
            o[i] = o[i] * rescale[..., None] + p @ vs[j]
            m[i] = m_new
        if step < world_size - 1:
            wait(requests)
            kv = incoming
    out = torch.cat([oi / li[..., None] for oi, li in zip(o, l)], dim=2)
    lse = torch.cat([mi + li.log() for mi, li in zip(m, l)], dim=2)
    return out.to(q.dtype), lse  # the log-sum-exp stays in float32 at least


def ring_backward(dout, q, k, v, out, lse, causal: bool, split: str):
    """Gradients of q, k and v. The blocks go round again; each rank keeps its
    own block's share of the key and value gradients, and a block's sum of the
    other ranks' shares (float32 at least) follows it from the next rank on,
    arriving home after N - 1 passes."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    acc, groups = lse.dtype, q.shape[1] // k.shape[1]
    n = len(chunks_of(rank, world_size, split))
    qs, dos, lses = q.to(acc).chunk(n, 2), dout.to(acc).chunk(n, 2), lse.chunk(n, 2)
    ds_ = (dout.to(acc) * out.to(acc)).sum(dim=-1).chunk(n, 2)  # FlashAttention's D
    dq = [torch.zeros_like(c) for c in qs]
    kv = torch.stack([k, v])
    own = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # never leaves
    grad_incoming, grad_requests = own, []
    for step in range(world_size):
        if step < world_size - 1:
            incoming, requests = ring_pass(kv)
        if step <= 1:  # this rank's own block, then a sum that starts travelling
            dkv = own if step == 0 else torch.zeros_like(own)
        else:  # the sum the previous rank passed on with this block
            wait(grad_requests)
            dkv = grad_incoming
        ks, vs = (repeat_kv(t.to(acc), groups).chunk(n, dim=2) for t in kv)
        dks, dvs = dkv[0].chunk(n, dim=2), dkv[1].chunk(n, dim=2)  # views
        for i, j, qc, kc in block_pairs(rank, step, world_size, split, causal):
            p = torch.exp(scores(qs[i], ks[j], qc, kc, causal) - lses[i][..., None])
            ds = p * (dos[i] @ vs[j].transpose(-2, -1) - ds_[i][..., None])
            ds = ds / math.sqrt(q.shape[-1])
            dq[i] += ds @ ks[j]
            dvs[j].add_(fold_kv(p.transpose(-2, -1) @ dos[i], groups))
            dks[j].add_(fold_kv(ds.transpose(-2, -1) @ qs[i], groups))
        if step > 0:  # this block's gradients follow it to the next rank
            grad_incoming, grad_requests = ring_pass(dkv)
        if step < world_size - 1:
            wait(requests)
            kv = incoming
    if world_size > 1:  # the other ranks' shares of this rank's block
        wait(grad_requests)
        own += grad_incoming
    return torch.cat(dq, dim=2).to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd function: it keeps only this rank's q, k,
    v, output and log-sum-exp for backward, never a score matrix."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, split: str):
        out, lse = ring_forward(q, k, v, causal, split)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.split = causal, split
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = ring_backward(dout, *ctx.saved_tensors, ctx.causal, ctx.split)
        return *grads, None, None


# torch 2.14 renamed these two collectives (the old names warn); 2.10 has the old ones
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)


class GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (rank by rank); backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty(dist.get_world_size() * x.shape[0], *x.shape[1:])
        all_gather_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[0] // dist.get_world_size(), *grad.shape[1:])
        reduce_scatter_single(out, grad.contiguous())
        return out


def allgather_attention(q, k, v, causal: bool, split: str) -> torch.Tensor:
    """Llama 3's variant: gather all keys and values, then attend once. Under a
    causal mask, an additive (T/N) x T mask (0 or -inf) built from the positions
    each rank holds, in every layer; a mask of any shape rules out the flash
    kernels on GPUs (they take only is_causal), not the memory-efficient one.
    Production versions keep no mask: they call flash kernels on blocks
    (torch's context_parallel: one per gathered block of keys, merged by
    log-sum-exp; Transformer Engine: one per chunk of queries, on its prefix).
    Nothing overlaps the gather: it sits on the critical path."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seq_len = q.shape[2] * world_size
    kv = GatherSequence.apply(torch.stack([k, v]).movedim(3, 0))
    k_all, v_all = kv.movedim(0, 3).unbind(0)  # positions in rank order
    mask = None
    if causal:
        k_pos = torch.cat(
            [positions(seq_len, r, world_size, split) for r in range(world_size)]
        )
        q_pos = positions(seq_len, rank, world_size, split)
        later = (k_pos[None, :] > q_pos[:, None]).to(q.device)
        mask = torch.zeros(later.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill(later, float("-inf"))
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(
        q, k_all, v_all, attn_mask=mask, enable_gqa=gqa
    )


def send_slices(x: torch.Tensor) -> torch.Tensor:
    """All-to-all: the i-th of N equal slices of dim 0 goes to rank i, and
    slice i of the result comes from rank i."""
    x = x.contiguous()  # and so the output: empty_like keeps a view's strides
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return out


class AllToAll(torch.autograd.Function):
    """``send_slices`` forward; backward, the gradients go back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return send_slices(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return send_slices(grad)


def heads_for_positions(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T/N, D) of every head -> (B, H/N, T, D): all positions, in rank
    order, of this rank's H/N heads (heads r H/N ... (r + 1) H/N - 1)."""
    N = dist.get_world_size()
    parts = AllToAll.apply(x.unflatten(1, (N, -1)).movedim(1, 0))  # (N, B, H/N, L, D)
    return parts.movedim(0, 2).flatten(2, 3)


def positions_for_heads(x: torch.Tensor) -> torch.Tensor:
    """The inverse of ``heads_for_positions``."""
    N = dist.get_world_size()
    parts = AllToAll.apply(x.unflatten(2, (N, -1)).movedim(2, 0))  # (N, B, H/N, L, D)
    return parts.movedim(0, 1).flatten(1, 2)


def ulysses_attention(q, k, v, causal: bool, split: str) -> torch.Tensor:
    """DeepSpeed-Ulysses: an all-to-all of q, k and v turns this rank's positions
    of every head into all positions of H/N heads; attention runs locally, on
    the sequence in its order, and a last all-to-all brings the output back."""
    world_size = dist.get_world_size()
    seq_len = q.shape[2] * world_size
    order = torch.cat(
        [positions(seq_len, r, world_size, split) for r in range(world_size)]
    ).to(q.device)  # the position of each row after the all-to-all
    in_order = torch.argsort(order)
    q, k, v = (heads_for_positions(t)[:, :, in_order] for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return positions_for_heads(out[:, :, order])


def attention(q, k, v, causal: bool, split: str, method: str) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence: "ring",
    "allgather", "ulysses", or "local" (plain SDPA on what this process holds:
    the whole sequence when it runs alone)."""
    if method == "ring":
        return RingAttention.apply(q, k, v, causal, split)
    if method == "allgather":
        return allgather_attention(q, k, v, causal, split)
    if method == "ulysses":
        return ulysses_attention(q, k, v, causal, split)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def torch_context_parallel(
    q, k, v, device: torch.device, rotate: str = "allgather"
) -> torch.Tensor:
    """Causal attention with torch's own context parallelism (experimental).

    ``context_parallel`` shards the whole q, k, v along the sequence itself,
    head and tail chunks together (the zig-zag) whatever the mask (without a
    causal mask its attention raises while load balancing is on, the default),
    and swaps SDPA for its own version while the block runs: one flash (or
    memory-efficient, or cuDNN) call per block, merged by log-sum-exp in
    float32. ``rotate``: "allgather" (torch's default) gathers all keys and
    values at once, like ``allgather_attention``; "alltoall" passes them round
    a ring. The CPU's SDPA kernel has no context-parallel version.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import (
        _disable_context_parallel_dispatcher,
        context_parallel_unshard,
        set_rotate_method,
    )

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    q, k, v = (t.detach().clone() for t in (q, k, v))  # sharded in place
    sdpa = F.scaled_dot_product_attention
    set_rotate_method(rotate)  # a global setting: put the default back after
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        set_rotate_method("allgather")
        if F.scaled_dot_product_attention is not sdpa:
            # torch 2.10's context_parallel leaves its SDPA and DTensor rules
            # in place when the block raises (later releases restore them in a
            # finally): every later SDPA call of this process would fail.
            F.scaled_dot_product_attention = sdpa
            _disable_context_parallel_dispatcher()
    return context_parallel_unshard(mesh, [out], [2])[0]  # the whole output


class CopyModel(nn.Module):
    """Token and position embeddings, one attention layer with a residual, a head."""

    def __init__(
        self, vocab: int, seq_len: int, d: int, n_head: int, method: str, kv_heads=0
    ):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        d_kv = d // n_head * (kv_heads or n_head)
        self.q, self.proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k, self.v = nn.Linear(d, d_kv, bias=False), nn.Linear(d, d_kv, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.n_head, self.method = n_head, method

    def forward(self, idx: torch.Tensor, pos: torch.Tensor, split: str) -> torch.Tensor:
        B, T = idx.shape
        x = self.tok_emb(idx) + self.pos_emb(pos)  # pos: this rank's positions
        head_dim = x.shape[-1] // self.n_head
        q, k, v = (
            f(x).view(B, T, -1, head_dim).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        y = attention(q, k, v, True, split, self.method)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(B, T, -1)))


def copy_batch(
    batch: int, seq_len: int, vocab: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets whose second half repeats the first half."""
    half = torch.randint(vocab, (batch, seq_len // 2), generator=generator)
    seq = torch.cat([half, half, half[:, :1]], dim=1)
    return seq[:, :-1], seq[:, 1:]


def train(model, args, rank: int, world_size: int, device: torch.device) -> list[float]:
    """Adam on copy batches, each rank on its part of every sequence. What a
    split sequence needs: the same permutation for inputs, targets and
    positions; the loss as a mean over all ranks' tokens; and the gradients of
    the (replicated) weights summed over the ranks."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)  # the same on every rank
    pos = positions(args.seq_len, rank, world_size, args.split).to(device)
    tokens = args.batch_size * args.seq_len  # all ranks' targets
    losses = []
    for _ in range(args.steps):
        x, y = copy_batch(args.batch_size, args.seq_len, args.vocab, generator)
        x, y = (shard(t, 1, rank, world_size, args.split).to(device) for t in (x, y))
        logits = model(x, pos, args.split)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        loss = loss / tokens  # this rank's share of the mean over every token
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([loss.detach().view(1), *(g.flatten() for g in grads)])
        if world_size > 1:  # the loss and the gradients, in one all-reduce
            dist.all_reduce(flat)
            for g, new in zip(grads, flat[1:].split([g.numel() for g in grads])):
                g.copy_(new.view_as(g))
        optimizer.step()
        losses.append(flat[0].item())
    return losses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--split", default="zigzag", choices=["plain", "zigzag"], help="of positions")
    add("--method", default="ring", choices=["ring", "allgather", "ulysses"])
    add("--seq-len", type=int, default=32, help="positions per sequence (tokens)")
    add("--batch-size", type=int, default=32, help="sequences per step")
    add("--vocab", type=int, default=8, help="distinct tokens")
    add("--n-embd", type=int, default=32, help="model width d")
    add("--n-head", type=int, default=2, help="attention heads")
    add("--n-kv-head", type=int, default=0, help="key-value heads (0: --n-head)")
    add("--steps", type=int, default=40, help="training steps")
    add("--lr", type=float, default=0.03, help="Adam's learning rate")
    add("--seed", type=int, default=0, help="seed of the weights and the data")
    add("--timeout", type=float, default=600, help="seconds to wait for the others")
    add("--results", help="a JSON file for rank 0's results")
    return parser.parse_args(argv)


@record
def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_distributed(args.timeout)
    chunks = world_size * (1 if args.split == "plain" else 2)
    if args.seq_len % chunks or args.seq_len % 2:
        fail(f"--seq-len {args.seq_len} must be even and a multiple of {chunks}")
    kv_heads = args.n_kv_head or args.n_head
    if args.n_embd % args.n_head or args.n_head % kv_heads:
        fail("--n-embd must be a multiple of --n-head, and --n-head of --n-kv-head")
    if args.method == "ulysses" and kv_heads % world_size:
        fail(
            f"--method ulysses needs --n-head and --n-kv-head divisible by {world_size}"
        )
    torch.manual_seed(args.seed)
    model = CopyModel(
        args.vocab, args.seq_len, args.n_embd, args.n_head, args.method, kv_heads
    )
    losses = train(model.to(device), args, rank, world_size, device)
    if rank == 0:
        T, guess = args.seq_len, math.log(args.vocab)
        print(
            f"{world_size} process(es) on {device.type}, {args.split} split, "
            f"{args.method}: {T // world_size} of {T} positions each"
        )
        for step in sorted({0, args.steps // 2, args.steps - 1}):
            print(f"step {step:4d}: loss {losses[step]:.3f}")
        print(
            f"guessing: {guess:.3f}; copying the second half perfectly (the first "
            f"cannot be predicted): {(T // 2 - 1) / T * guess:.3f}"
        )
        if args.results:
            with open(args.results, "w") as f:
                json.dump({**where_it_ran(device), "losses": losses, **vars(args)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
