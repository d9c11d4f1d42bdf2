"""Pipeline parallelism on a small GPT: each process holds a few consecutive blocks.

    python pipeline_gpt.py                                            # one stage
    torchrun --standalone --nproc-per-node=2 pipeline_gpt.py --schedule gpipe
    torchrun --standalone --nproc-per-node=4 pipeline_gpt.py --microbatches 8
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=pipe pipeline_gpt.py  # on each node
    srun --ntasks=4 --gpus-per-task=1 python pipeline_gpt.py --microbatches 8

Every process builds the same GPT (the course's model, copied here so that the
script stands alone) from the same seed and keeps one contiguous part of it, a
stage: with p processes the first holds the embeddings and the first n_layer/p
blocks, the last the last blocks, the final LayerNorm and the head.
torch.distributed.pipelining cuts each global batch of the Zen of Python (read
as characters) into ``--microbatches`` m, sends activations forward and their
gradients backward between neighbouring stages, and computes each
micro-batch's loss on the last stage, in the order of ``--schedule``: gpipe
(all forward passes, then all backward passes), 1f1b (once the pipeline is
full, one forward and one backward pass in turn, so that stage s holds at most
p - s micro-batches) or interleaved (1F1B with two stages per process: process
r holds stages r and r + p). companion/checks/pipeline.py times the passes and
counts the activations each stage holds.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import atexit
import codecs
import contextlib
import datetime
import io
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

# ---- set-up: the same in every script of companion/scripts (a test checks it)


def fail(message: str) -> None:
    """Stop with one sentence on stderr and in torchrun's summary; exit code 2."""
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))):
        time.sleep(30)  # rank 0 says it, while torchrun or srun -K stops the others
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's summary
        said = {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}
        with open(error_file, "w") as f:  # as @record writes it, less the traceback
            json.dump({"message": said}, f)
    sys.exit(2)


def setup_distributed(timeout_s: float = 600) -> tuple[int, int, int, torch.device]:
    """Join the process group; return ``rank, local_rank, world_size, device``."""
    if torch.__version__ < (2, 10):
        fail(f"these scripts need PyTorch 2.10 or newer, not {torch.__version__}")
    env = os.environ  # set by torchrun or srun; plain python is one process
    rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
    world_size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    per_node = int(env.get("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", 1)))
    gpus = torch.cuda.device_count()  # a process takes GPU local_rank, except under
    own = gpus == 1 and "RANK" not in env  # srun --gpus-per-task=1 (its own, as 0)
    if not own and 0 < gpus < max(per_node, local_rank + 1):
        fail(f"this node has {gpus} GPU(s) for {per_node} processes")
    device = torch.device(f"cuda:{0 if own else local_rank}" if gpus else "cpu")
    if gpus:
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            dist.get_default_backend_for_device(device),
            store=dist.HashStore() if world_size == 1 else None,  # alone: no port
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if gpus else None,
        )
    except (dist.DistError, ValueError) as err:  # a busy port, a missing rank
        fail(f"the processes did not meet: {str(err).strip().splitlines()[0]}")
    # A gloo group still alive when python exits can abort it (SIGABRT, pytorch#179291);
    # destroying an nccl group waits for every rank, so nccl's is left to the exit.
    if dist.get_backend() == "gloo":
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return rank, local_rank, world_size, device


def where_it_ran(device: torch.device) -> dict:
    """The device, backend, processes and threads a result was measured with."""
    run = {"device": device.type, "world_size": dist.get_world_size()}
    return {**run, "backend": dist.get_backend(), "threads": torch.get_num_threads()}


# ---- end of set-up

# ---- the model: the course's GPT (companion/gpt.py), copied to stand alone


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 64  # the longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.head_dim = d // config.n_head
        self.q, self.k, self.v, self.proj = (
            nn.Linear(d, d, bias=False) for _ in range(4)
        )
        future = torch.ones(config.block_size, config.block_size, dtype=torch.bool)
        self.register_buffer("future", future.triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # -1 heads below: a tensor-parallel rank holds some
        q, k, v = (
            p(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(self.future[:T, :T], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=False)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (B, T) in, logits (B, T, vocab) out."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token predictions."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class CharText:
    """The Zen of Python as character ids, cut into (input, target) batches."""

    def __init__(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # importing it prints it
            import this
        text = codecs.decode(this.s, "rot13")
        self.chars = sorted(set(text))
        self.ids = torch.tensor([self.chars.index(c) for c in text])

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator):
        """``batch_size`` random windows of ``seq_len`` ids, and the next ids."""
        starts = torch.randint(
            len(self.ids) - seq_len, (batch_size,), generator=generator
        )
        windows = torch.stack([self.ids[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


# ---- settings and data

DTYPES = {"float32": torch.float32, "float64": torch.float64}
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
}
STAGES_PER_PROCESS = {"gpipe": 1, "1f1b": 1, "interleaved": 2}


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The model's sizes: the flags', and the text's vocabulary."""
    n = len(CharText().chars)
    return GPTConfig(n, args.seq_len, args.n_layer, args.n_head, args.n_embd)


def build_model(config: GPTConfig, seed: int, dtype: str, device) -> GPT:
    """The same GPT on every rank: initialised in float32 from ``seed``, then cast."""
    torch.manual_seed(seed)
    return GPT(config).to(device=device, dtype=DTYPES[dtype])


def global_batches(args: argparse.Namespace, device) -> list:
    """The ``--steps`` global batches, the same on every rank."""
    text, g = CharText(), torch.Generator().manual_seed(args.seed)
    batches = [text.batch(args.batch_size, args.seq_len, g) for _ in range(args.steps)]
    return [(x.to(device), y.to(device)) for x, y in batches]


# ---- parallelise: stages and a schedule


class GPTStage(nn.Module):
    """Blocks ``first`` to ``last - 1`` of ``model``; the embeddings too on the
    first stage, the final LayerNorm and the head on the last."""

    def __init__(self, model: GPT, first: int, last: int) -> None:
        super().__init__()
        self.is_first, self.is_last = first == 0, last == len(model.blocks)
        if self.is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleList(model.blocks[first:last])
        if self.is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # token ids in
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.is_last else x  # logits out


class Pipeline(NamedTuple):
    modules: list[GPTStage]  # this process's stages of the model
    stages: list[PipelineStage]  # the same, as torch.distributed.pipelining runs them
    schedule: object  # runs a step: every micro-batch through every stage


def build_pipeline(model: GPT, schedule: str, microbatches: int, device) -> Pipeline:
    """This process's stages of ``model`` (process r: stage r, and r + p when
    interleaved), and the schedule that runs them with ``microbatches``."""
    rank, p = dist.get_rank(), dist.get_world_size()
    v = STAGES_PER_PROCESS[schedule]
    per_stage = len(model.blocks) // (p * v)
    ids = [rank + k * p for k in range(v)]
    modules = [GPTStage(model, s * per_stage, (s + 1) * per_stage) for s in ids]
    stages = [PipelineStage(m, s, p * v, device) for s, m in zip(ids, modules)]
    run = SCHEDULES[schedule](
        stages if v > 1 else stages[0], n_microbatches=microbatches, loss_fn=lm_loss
    )
    return Pipeline(modules, stages, run)


# ---- train


def train_step(pipeline: Pipeline, optimizer, x: torch.Tensor, y: torch.Tensor):
    """One Adam step on a global batch; on the last stage's process its loss,
    detached (the mean of the equal micro-batches'), elsewhere None."""
    optimizer.zero_grad(set_to_none=True)
    first = any(m.is_first for m in pipeline.modules)
    last = any(m.is_last for m in pipeline.modules)
    losses: list[torch.Tensor] = []
    inputs = (x,) if first else ()  # token ids enter on the first stage
    targets = {"target": y, "losses": losses} if last else {}
    pipeline.schedule.step(*inputs, **targets, return_outputs=False)
    optimizer.step()
    return torch.stack(losses).mean().detach() if last else None


def loss_from_last_stage(loss: torch.Tensor | None, device) -> float:
    """The last process's loss, sent to every rank (rank 0 prints it)."""
    none = torch.zeros((), dtype=torch.float64, device=device)
    value = none if loss is None else loss.double()
    dist.broadcast(value, src=dist.get_world_size() - 1)
    return value.item()


# ---- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked before the processes meet."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--schedule", choices=SCHEDULES, default="1f1b", help="(default: 1f1b)")
    add("--microbatches", type=int, default=8, help="per global batch (default: 8)")
    add("--steps", type=int, default=4, help="training steps (default: 4)")
    add(
        "--batch-size",
        type=int,
        default=32,
        help="global batch, sequences (default: 32)",
    )
    add("--seq-len", type=int, default=64, help="characters per sequence (default: 64)")
    add("--lr", type=float, default=3e-3, help="Adam's learning rate (default: 3e-3)")
    add("--seed", type=int, default=0, help="of the model and batches (default: 0)")
    add("--dtype", choices=DTYPES, default="float64", help="(default: float64)")
    add("--n-layer", type=int, default=4, help="transformer blocks (default: 4)")
    add("--n-head", type=int, default=4, help="attention heads (default: 4)")
    add("--n-embd", type=int, default=64, help="width, in features (default: 64)")
    add("--timeout", type=float, default=600, help="seconds to wait for the others")
    add("--results", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    p = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    stages, m = p * STAGES_PER_PROCESS[args.schedule], args.microbatches
    if args.n_layer < 1 or args.n_layer % stages:
        fail(
            f"--n-layer {args.n_layer} does not split into {stages} equal stages "
            f"({args.schedule} on {p} processes); use a multiple of {stages}."
        )
    if args.n_embd % args.n_head:
        fail(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}.")
    if (
        m < 1 or args.batch_size % m
    ):  # unequal micro-batches weigh their losses unequally
        fail(
            f"--batch-size {args.batch_size} does not split into {m} equal "
            "micro-batches; use a multiple of --microbatches."
        )
    if args.schedule != "gpipe" and (m < p or args.schedule == "interleaved" and m % p):
        fail(
            f"the {args.schedule} schedule needs a multiple of {p} micro-batches "
            f"(at least one per process), not {m}."
        )
    if not 0 < args.seq_len < 856:  # the text's characters
        fail(f"--seq-len {args.seq_len} must be 1 to 855.")
    return args


@record
def main() -> None:
    args = parse_args()
    rank, _, _, device = setup_distributed(args.timeout)
    model = build_model(model_config(args), args.seed, args.dtype, device)
    pipeline = build_pipeline(model, args.schedule, args.microbatches, device)
    params = [q for m in pipeline.modules for q in m.parameters()]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    losses = []
    for step, (x, y) in enumerate(global_batches(args, device)):
        loss = train_step(pipeline, optimizer, x, y)
        losses.append(loss_from_last_stage(loss, device))
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump({**where_it_ran(device), "losses": losses}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
