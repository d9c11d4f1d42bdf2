"""Pipeline parallelism on a small GPT: each process holds a few consecutive blocks.

    python pipeline_gpt.py                                            # one stage
    torchrun --standalone --nproc-per-node=2 pipeline_gpt.py --schedule gpipe
    torchrun --standalone --nproc-per-node=4 pipeline_gpt.py --microbatches 8
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=pipe pipeline_gpt.py  # on each node
    srun --ntasks=4 --gpus-per-task=1 python pipeline_gpt.py --microbatches 8

Every process builds the same GPT (the course's model, from the sibling
gpt_model.py) from the same seed and keeps one contiguous part of it, a
stage: with p processes the first holds the embeddings and the first n_layer/p
blocks, the last the last blocks, the final LayerNorm and the head.
torch.distributed.pipelining cuts each global batch of the Zen of Python (read
as characters) into ``--microbatches`` m, sends activations forward and their
gradients backward between neighbouring stages, and computes each
micro-batch's loss on the last stage, in the order of ``--schedule``: gpipe
(all forward passes, then all backward passes), 1f1b (once the pipeline is
full, one forward and one backward pass in turn, so that stage s holds at most
p - s micro-batches), interleaved (1F1B with two stages per process: process
r holds stages r and r + p), or the zero-bubble schedules, whose backward
passes send the input's gradient on at once and compute the weights' later,
in what would be idle time: zb1p (interleaved's stages; torch 2.10 and 2.14),
zbv and dualpipev (a V: process r holds stages r and 2p - 1 - r; torch 2.13
and 2.14: 2.10 fails in their first step, 2.11 and 2.12 were not tried, and
the script refuses them below 2.13).
companion/checks/pipeline.py times the passes and counts the activations each
stage holds.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import json
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from distributed_setup import fail, launched, setup_distributed, where_it_ran
from gpt_model import (
    DTYPES,
    GPT,
    CharText,
    GPTConfig,
    build_model,
    global_batches,
    lm_loss,
)

# ---- settings and data

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb1p": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
STAGES_PER_PROCESS = {name: 2 for name in SCHEDULES} | {"gpipe": 1, "1f1b": 1}
V_SHAPED = {"zbv", "dualpipev"}  # process r holds stages r and 2p - 1 - r
ZERO_BUBBLE = {"zb1p", *V_SHAPED}  # backward passes split into input and weights
LOOPED = {"interleaved", "zb1p"}  # process r holds stages r and r + p


def stage_ids(schedule: str, rank: int, p: int) -> list[int]:
    """The stages process ``rank`` of ``p`` holds: r (and r + p when looped,
    2p - 1 - r when V-shaped, so that the first and last stages share a process)."""
    if schedule in V_SHAPED:
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(STAGES_PER_PROCESS[schedule])]


def torch_version() -> tuple[int, int]:
    """The installed torch's major and minor version."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The model's sizes: the flags', and the text's vocabulary."""
    n = len(CharText().chars)
    return GPTConfig(n, args.seq_len, args.n_layer, args.n_head, args.n_embd)


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
    """This process's stages of ``model`` (``stage_ids``), and the schedule that
    runs them with ``microbatches``."""
    rank, p = dist.get_rank(), dist.get_world_size()
    v = STAGES_PER_PROCESS[schedule]
    per_stage = len(model.blocks) // (p * v)
    ids = stage_ids(schedule, rank, p)
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
    """The loss of the process that holds the last stage (the last process, or
    the first when V-shaped), sent to every rank: a sum with zeros, exact."""
    none = torch.zeros((), dtype=torch.float64, device=device)
    value = none if loss is None else loss.double()
    dist.all_reduce(value)
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
    add("--dtype", choices=DTYPES, default="float32", help="(default: float32)")
    add("--n-layer", type=int, default=4, help="transformer blocks (default: 4)")
    add("--n-head", type=int, default=4, help="attention heads (default: 4)")
    add("--n-embd", type=int, default=64, help="width, in features (default: 64)")
    add("--timeout", type=float, default=600, help="seconds to wait for the others")
    add("--results", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    p = launched().world_size
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
    if args.schedule in V_SHAPED and m < 2 * p:
        fail(
            f"the {args.schedule} schedule needs at least {2 * p} micro-batches "
            f"(one per stage), not {m}."
        )
    if args.schedule in V_SHAPED and torch_version() < (2, 13):
        fail(
            f"the {args.schedule} schedule runs here on torch 2.13 or newer, not "
            f"{torch.__version__}: torch 2.10 fails in its first step, where a process "
            "sends to itself between the V's two stages (2.13 and 2.14 ran it; 2.11 "
            "and 2.12 were not tried)."
        )
    if args.schedule != "gpipe" and (m < p or args.schedule in LOOPED and m % p):
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
    rank, _, device = setup_distributed(args.timeout)
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
