"""Expert parallelism: a GPT whose mixture-of-experts layers span processes.

    python expert_parallel.py                                        # one process
    torchrun --standalone --nproc-per-node=2 expert_parallel.py      # two, here
    torchrun --standalone --nproc-per-node=4 expert_parallel.py --experts 8
    torchrun --standalone --nproc-per-node=4 expert_parallel.py --experts 8 \\
        --capacity-factor 0 --normalize-gates --shared-experts 1
    srun --ntasks=8 python expert_parallel.py --experts 16

Every block's MLP becomes a mixture of experts: a router scores n_experts
MLPs for each token, the token goes to its top_k, and their outputs are
summed, weighted by the router's probabilities. Each of the N processes holds
n_experts / N experts and trains on its 1/N of each global batch of
--batch-size sequences (data parallel for the rest of the model; each expert
has one copy, so its gradients need no all-reduce: with more processes than
expert groups they would be summed over each expert's copies). Tokens travel
to the process that holds their expert and back by two all-to-alls per layer
(dispatch and combine), and two more in the backward pass. With a capacity
factor, an expert takes at most ceil(capacity_factor x top_k x tokens /
n_experts) tokens from each process (fixed buffers); the others are dropped (the residual connection carries them
on). With --capacity-factor 0 the layer is dropless: every choice travels, in
all-to-all slices as long as the routing makes them. --normalize-gates rescales
each token's top-k probabilities to sum to 1; --shared-experts adds experts
that every token goes through. A load-balancing loss pushes the router towards
equal loads. The script trains the model on the Zen of Python and prints the
loss and the busiest expert's load.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import codecs
import contextlib
import io
import json
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from distributed_setup import fail, setup_distributed, where_it_ran


@dataclass(frozen=True)
class GPTConfig:
    """companion.gpt's GPT (with SDPA), whose MLPs may be mixtures of experts."""

    vocab_size: int = 64
    block_size: int = 64  # the longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_experts: int = 4  # 0: a plain MLP in every block
    top_k: int = 2  # experts per token
    capacity_factor: float = 1.25  # slots per even share of an expert; 0: dropless
    normalize_gates: bool = False  # the top-k probabilities rescaled to sum to 1
    n_shared: int = 0  # shared experts, which every token goes through


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.head_dim = d // config.n_head
        self.q, self.k, self.v, self.proj = (
            nn.Linear(d, d, bias=False) for _ in "qkvp"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (
            f(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, hidden: int = 0) -> None:
        super().__init__()
        hidden = hidden or 4 * config.n_embd
        self.fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def send_slices(x: torch.Tensor, send: list | None = None, recv: list | None = None):
    """All-to-all along dim 0: slice i goes to rank i, and slice i of the result
    comes from rank i. Slices are equal, or ``send`` and ``recv`` rows long."""
    x = x.contiguous()  # and so the output: empty_like keeps a view's strides
    out = x.new_empty(sum(recv), *x.shape[1:]) if recv else torch.empty_like(x)
    dist.all_to_all_single(out, x, recv, send)
    return out


class AllToAll(torch.autograd.Function):
    """``send_slices`` forward; backward, the gradients go back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send=None, recv=None) -> torch.Tensor:
        ctx.sizes = send, recv
        return send_slices(x, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send, recv = ctx.sizes
        return send_slices(grad, recv, send), None, None


def expert_weights(expert: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert MLP's two weights, drawn from the expert's own seed, so that
    it starts the same whichever process holds it."""
    g = torch.Generator().manual_seed(expert)
    return torch.randn(d, 4 * d, generator=g) * 0.02, torch.randn(
        4 * d, d, generator=g
    ) * 0.02


class MoE(nn.Module):
    """Top-k mixture of expert MLPs; this process holds ``n_experts / world_size``
    of them (experts rank x local ... rank x local + local - 1)."""

    def __init__(self, config: GPTConfig, rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        self.config, self.world_size = config, world_size
        self.local = config.n_experts // world_size
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        mine = range(rank * self.local, (rank + 1) * self.local)
        w = [expert_weights(e, config.n_embd) for e in mine]
        self.fc = nn.Parameter(torch.stack([fc for fc, _ in w]))  # (local, d, 4d)
        self.proj = nn.Parameter(torch.stack([proj for _, proj in w]))  # (local, 4d, d)
        hidden = 4 * config.n_embd * config.n_shared  # replicated, like attention
        self.shared = MLP(config, hidden) if config.n_shared else None

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a group of ``tokens`` (rounded before ceil:
        1.25 x 2 x 512 / 8 is 160.00000000000003 in floating point); dropless,
        as many as tokens: an expert can take every token."""
        c = self.config
        if c.capacity_factor == 0:
            return tokens
        return math.ceil(round(c.capacity_factor * c.top_k * tokens / c.n_experts, 9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        E, k = self.config.n_experts, self.config.top_k
        tokens = x.reshape(-1, x.shape[-1])  # this process's tokens: one group
        probs = self.router(tokens).softmax(dim=-1)  # (S, E)
        gate, expert = probs.topk(k, dim=-1)  # (S, k)
        if self.config.normalize_gates:  # GShard's top-2, Mixtral (V3: on sigmoids)
            gate = gate / gate.sum(dim=-1, keepdim=True)
        expert = expert.t().reshape(-1)  # (k S,), choice-major
        chosen = F.one_hot(expert, E)
        source = tokens.repeat(k, 1)
        if self.config.capacity_factor == 0:
            rows, keep = self.dropless(source, expert), torch.ones_like(expert)
        else:
            rows, keep = self.padded(source, expert, chosen)
        weight = gate.t().reshape(-1) * keep  # a dropped choice adds nothing
        y = (rows * weight[:, None]).view(k, -1, tokens.shape[1]).sum(dim=0)
        if self.shared is not None:
            y = y + self.shared(tokens)
        # The load-balancing loss (Switch Transformer, Megatron-Core): n_experts x
        # sum over experts of (share of choices) x (mean probability); 1 when
        # either is even, up to n_experts when both favour the same experts.
        self.aux_loss = E * (chosen.float().mean(dim=0) * probs.mean(dim=0)).sum()
        self.load = chosen.sum(dim=0).detach()  # choices per expert, before capacity
        return y.view(x.shape)

    def experts(self, h: torch.Tensor) -> torch.Tensor:
        """Every local expert on its rows: h is (local, rows, d)."""
        return F.gelu(h @ self.fc) @ self.proj

    def padded(self, source, expert, chosen) -> tuple[torch.Tensor, torch.Tensor]:
        """GShard's fixed buffers: each (choice, token) takes the next free slot of
        its expert, first choices before second ones; beyond the capacity C it is
        dropped. Each row's result, and which rows were kept."""
        E, N, d = self.config.n_experts, self.world_size, source.shape[1]
        C = self.capacity(len(source) // self.config.top_k)
        slot = ((chosen.cumsum(dim=0) - 1) * chosen).sum(dim=-1)
        keep = slot < C
        where = expert * C + slot.clamp(max=C - 1)  # row in the (E C, d) buffer
        buffer = source.new_zeros(E * C, d).index_add(0, where[keep], source[keep])
        if N > 1:  # dispatch: rows of rank i's experts go to rank i
            buffer = AllToAll.apply(buffer)
        h = buffer.view(N, self.local, C, d).transpose(0, 1).reshape(self.local, -1, d)
        out = self.experts(h).view(self.local, N, C, d).transpose(0, 1).reshape(-1, d)
        if N > 1:  # combine: the results go back to the tokens' ranks
            out = AllToAll.apply(out)
        return out.index_select(0, where), keep

    def dropless(self, source: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Every choice kept: the rows travel sorted by expert, in slices as long
        as the routing makes them. The counts travel first, and the host must
        know them to size the buffers: a device sync in every layer."""
        N, local = self.world_size, self.local
        order = torch.argsort(expert, stable=True)  # the rows, grouped by expert
        counts = torch.bincount(expert, minlength=self.config.n_experts)
        theirs = send_slices(counts) if N > 1 else counts  # rank i's, for my experts
        sent, got = counts.view(N, local), theirs.view(N, local)
        sizes = sent.sum(dim=1).tolist(), got.sum(dim=1).tolist()  # host sync
        rows = AllToAll.apply(source[order], *sizes) if N > 1 else source[order]
        owner = torch.arange(local, device=rows.device).repeat(N)
        by_expert = torch.argsort(owner.repeat_interleave(got.flatten()), stable=True)
        parts = rows[by_expert].split(got.sum(dim=0).tolist())
        h = torch.cat(  # one product per expert, as a grouped GEMM does in one call
            [F.gelu(p @ self.fc[e]) @ self.proj[e] for e, p in enumerate(parts)]
        )
        h = h[torch.argsort(by_expert)]  # back in the order they came
        out = AllToAll.apply(h, sizes[1], sizes[0]) if N > 1 else h
        return out[torch.argsort(order)]  # each choice's row, in choice order


class Block(nn.Module):
    def __init__(self, config: GPTConfig, rank: int, world_size: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=False)
        self.mlp = MoE(config, rank, world_size) if config.n_experts else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(
            Block(config, rank, world_size) for _ in range(config.n_layer)
        )
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(
            torch.arange(idx.shape[1], device=idx.device)
        )
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def zen_of_python() -> tuple[torch.Tensor, int]:
    """The Zen of Python as character ids, and the number of distinct characters."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing it prints it
        import this
    text = codecs.decode(this.s, "rot13")
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text]), len(chars)


def batch(ids: torch.Tensor, size: int, seq_len: int, generator: torch.Generator):
    """``size`` random windows of ``seq_len`` ids and their next-character targets."""
    starts = torch.randint(len(ids) - seq_len, (size,), generator=generator).tolist()
    windows = torch.stack([ids[s : s + seq_len + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def train(model, args, rank: int, world_size: int, device, groups: int = 1) -> dict:
    """Adam on the Zen of Python. Every step draws one global batch; rank r
    trains on its r-th slice, routed as ``groups`` groups (one process with
    groups=N does what N processes do). The experts' gradients are complete
    already; the other weights are data parallel: their gradients are summed,
    with the step's statistics, in one all-reduce."""
    ids, _ = zen_of_python()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)  # the same on every rank
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    experts = {id(p) for m in moes for p in (m.fc, m.proj)}
    shared = [p for p in model.parameters() if id(p) not in experts]
    dtype, parts = shared[0].dtype, groups * world_size
    log: dict[str, list] = {"loss": [], "aux_loss": [], "dropped": [], "load": []}
    for _ in range(args.steps):
        x, y = batch(ids, args.batch_size, args.seq_len, generator)
        loss, stats = 0, torch.zeros(3 + len(moes) * args.experts, dtype=dtype)
        stats = stats.to(device)  # loss, balance loss, dropped, load per expert
        mine = slice(rank * groups, (rank + 1) * groups)
        for xs, ys in zip(x.chunk(parts)[mine], y.chunk(parts)[mine]):
            logits = model(xs.to(device))
            lm = F.cross_entropy(logits.flatten(0, 1), ys.to(device).flatten())
            aux = sum(m.aux_loss for m in moes) / len(moes)
            loss = loss + (lm + args.aux_weight * aux) / parts
            load = torch.stack([m.load for m in moes]).to(dtype)  # (layers, experts)
            dropped = (load - moes[0].capacity(xs.numel())).clamp(min=0).sum()
            first = torch.stack([lm / parts, aux / parts, dropped]).detach()
            stats += torch.cat([first, load.flatten()])
        optimizer.zero_grad()
        loss.backward()
        if world_size > 1:
            grads = [p.grad for p in shared]
            flat = torch.cat([stats, *(g.flatten() for g in grads)])
            dist.all_reduce(flat)
            stats, rest = flat[: stats.numel()], flat[stats.numel() :]
            for g, new in zip(grads, rest.split([g.numel() for g in grads])):
                g.copy_(new.view_as(g))
        optimizer.step()
        values = stats.tolist()
        for key, value in zip(log, values[:3]):
            log[key].append(value)
        E = args.experts
        log["load"].append(
            [values[3 + i * E : 3 + (i + 1) * E] for i in range(len(moes))]
        )
    return log


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--experts", type=int, default=4, help="experts per layer (a multiple of N)")
    add("--top-k", type=int, default=2, help="experts per token")
    add("--capacity-factor", type=float, default=1.25, help="0: dropless")
    add("--normalize-gates", action="store_true", help="top-k gates summing to 1")
    add("--shared-experts", type=int, default=0, help="experts every token uses")
    add("--aux-weight", type=float, default=0.01, help="of the load-balancing loss")
    add("--n-layer", type=int, default=2, help="transformer blocks")
    add("--n-embd", type=int, default=64, help="model width d")
    add("--n-head", type=int, default=4, help="attention heads")
    add("--seq-len", type=int, default=64, help="characters per sequence")
    add("--batch-size", type=int, default=32, help="global batch: sequences per step")
    add("--steps", type=int, default=30, help="training steps")
    add("--lr", type=float, default=3e-3, help="Adam's learning rate")
    add("--seed", type=int, default=0, help="seed of the weights and the data")
    add("--timeout", type=float, default=600, help="seconds to wait for the others")
    add("--results", help="a JSON file for rank 0's results")
    return parser.parse_args(argv)


def build(args: argparse.Namespace, rank: int, world_size: int) -> GPT:
    """The model of ``args``, with this rank's experts."""
    config = GPTConfig(
        vocab_size=zen_of_python()[1],
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        n_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        normalize_gates=args.normalize_gates,
        n_shared=args.shared_experts,
    )
    torch.manual_seed(args.seed)  # the replicated weights: the same on every rank
    return GPT(config, rank, world_size)


@record
def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_distributed(args.timeout)
    if args.experts < 1 or args.experts % world_size:
        fail(f"--experts {args.experts} must be a positive multiple of {world_size}")
    if args.batch_size % world_size:
        fail(
            f"--batch-size {args.batch_size} does not split over {world_size} processes"
        )
    if not 1 <= args.top_k <= args.experts or args.n_embd % args.n_head:
        fail("--top-k must be 1 to --experts, and --n-embd a multiple of --n-head")
    model = build(args, rank, world_size).to(device)
    log = train(model, args, rank, world_size, device)
    if rank == 0:
        factor = args.capacity_factor
        print(
            f"{world_size} process(es) on {device.type}: {args.experts} experts per "
            f"layer, {args.experts // world_size} on each, top-{args.top_k}, "
            + (f"capacity factor {factor}" if factor else "dropless")
        )
        routed = args.batch_size * args.seq_len * args.top_k
        for step in sorted({0, args.steps // 2, args.steps - 1}):
            busiest = max(max(layer) for layer in log["load"][step])
            print(
                f"step {step:3d}: loss {log['loss'][step]:.3f}, balance loss "
                f"{log['aux_loss'][step]:.3f}, busiest expert {busiest / routed:.0%} "
                f"of a layer's choices, {log['dropped'][step]:.0f} dropped"
            )
        if args.results:
            with open(args.results, "w") as f:
                json.dump({**where_it_ran(device), **log, **vars(args)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
