"""Every layout of the course GPT on N processes: predicted first, then measured.

    launch("checks/layouts.py", ["--layouts", "data 4; shard 4, k = 2"], nproc=4)
    torchrun --standalone --nproc-per-node=4 companion/checks/layouts.py

First it measures this machine's two numbers for the cost model of
``companion.parallel_costs``, with every process at work at once:

- the FLOP rate of one process, from the plain model's forward and backward
  pass on one data-parallel share of the batch (B / N sequences): the
  slowest process's;
- the link, from all-reduces of 64 KiB to 16 MiB over the N processes and
  over pairs of them (``companion.comm_costs.fit_alpha_beta``): a latency
  and a bandwidth per group size, which each degree of a layout uses by
  the size of its groups.

Then, for each layout of ``--layouts`` (``LAYOUTS``' names, as
``str(Layout)`` writes them), it predicts the step's seconds and each
process's bytes (``layout_costs``, ``layout_memory``), builds the layout with
the scripts' own functions (DDP; ``fsdp_gpt``'s FSDP2 and HSDP;
``tensor_parallel_gpt``'s tensor, sequence and 2-D parallelism;
``pipeline_gpt``'s 1F1B), trains a warm-up step and ``--steps`` timed steps
(each from a barrier to the last process's end; the median is reported),
and one step more under ``companion.memory.LiveTensors`` for each process's
peak of live tensor bytes. Every layout starts from the same model and
batches: its first loss equals the plain model's (float32, within 1e-4;
the forward pass), and so does its last, after ``--steps`` + 1 Adam steps
(the gradients, their reduction and the optimizer too).
Layouts that cannot split the sizes given are left out (named), or with
``--layouts`` naming them, refused in one sentence. DDP's gradient
accumulation (``no_sync`` until the last micro-batch) is written here; the
other layouts use the scripts' own steps.

Writes rank 0's results (``--results FILE``) for chapter 17; the predictions
are judged there. Exit codes: 0 done; 3 a first or last loss differs; 2 bad
input; 1 crashed.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from companion.checks._shared import clock, every_rank, finish, print0, tolerance
from companion.comm_costs import CollectiveFit, fit_alpha_beta
from companion.gpt import GPTConfig as PlainConfig
from companion.gpt import plain_losses
from companion.harness.notebook import CourseError
from companion.memory import Checkpointed, LiveTensors
from companion.parallel_costs import (
    DEGREES,
    DeviceAndLink,
    GPTWorkload,
    Layout,
    layout_costs,
    layout_memory,
)
from companion.scripts import (
    collective_bench,
    fsdp_gpt,
    pipeline_gpt,
    tensor_parallel_gpt,
)

# The scripts' siblings, as the scripts import them (one module each).
GPT, GPTConfig, build_model, lm_loss = (
    fsdp_gpt.GPT,
    fsdp_gpt.GPTConfig,
    fsdp_gpt.build_model,
    fsdp_gpt.lm_loss,
)
fail, setup_distributed, where_it_ran = (
    fsdp_gpt.fail,
    fsdp_gpt.setup_distributed,
    fsdp_gpt.where_it_ran,
)

SIZES = [2**16, 2**18, 2**20, 2**22, 2**24]  # bytes of the all-reduces fitted


def layouts_for(n: int, full: bool = False) -> dict[str, Layout]:
    """The layouts this check builds on ``n`` processes, by name: the chapter's
    twelve (on 4), or with ``full`` more micro-batch counts and recomputation
    (benchmarks/layouts.py). Recomputation wraps the blocks, which tensor
    parallelism's plans name by their paths, so it goes with the data-parallel
    layouts only."""
    half = n // 2
    found = [
        Layout(data=n),
        Layout(data=n, microbatches=2),
        Layout(data=n, recompute=True),
        Layout(shard=n),
        Layout(shard=n, microbatches=2),
        Layout(shard=n, recompute=True),
        Layout(tensor=n),
        Layout(tensor=n, sequence_parallel=True),
        Layout(pipeline=n, microbatches=n),
        Layout(pipeline=n, microbatches=2 * n),
    ]
    if n >= 4 and n % 2 == 0:
        found += [Layout(data=2, shard=half), Layout(shard=2, tensor=half)]
    if full:
        found += [
            Layout(data=n, microbatches=4),
            Layout(shard=n, microbatches=4),
            Layout(data=n, microbatches=2, recompute=True),
            Layout(pipeline=n, microbatches=4 * n),
        ]
        if n >= 4 and n % 2 == 0:
            found += [
                Layout(data=2, shard=half, recompute=True),
            ]
    return {str(layout): layout for layout in found}


def unbuildable(layout: Layout, args: argparse.Namespace) -> str:
    """Why ``layout`` cannot split the model and batch of ``args`` ("" if it can)."""
    parts = layout.batch_split * layout.microbatches
    if args.n_head % layout.tensor:
        return f"{layout.tensor} tensor-parallel ranks cannot split {args.n_head} heads"
    if args.n_layer % layout.pipeline:
        return f"{layout.pipeline} stages cannot split {args.n_layer} blocks"
    if args.batch_size % parts:
        return f"a batch of {args.batch_size} does not split into {parts} equal parts"
    return ""


# ---- this machine's numbers


def flop_rate(
    config: GPTConfig,
    workload: GPTWorkload,
    x: torch.Tensor,
    y: torch.Tensor,
    repeats: int = 5,
) -> float:
    """FLOP/s of one process on the plain model's forward and backward pass
    over ``x``, while every process runs the same: the slowest process's
    median of ``repeats`` (with more processes than cores, the first to get a
    core would time itself alone)."""
    model = GPT(config).to(x.device)
    lm_loss(model(x), y).backward()  # a first pass: allocations, lazy set-up
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = clock()
        lm_loss(model(x), y).backward()
        seconds.append(clock() - start)
    return workload.step_flops / max(every_rank(statistics.median(seconds)))


def all_reduce_seconds(group: Any, device: torch.device) -> list[float]:
    """Seconds per all-reduce of each of ``SIZES`` over ``group``: the slowest
    rank's median over blocks of calls that take turns
    (``collective_bench.time_calls``, whose blocks keep a GPU's launch and
    synchronisation out of each call's time)."""
    buffers = [torch.zeros(size // 4, device=device) for size in SIZES]
    calls = [lambda b=b: dist.all_reduce(b, group=group) for b in buffers]
    return collective_bench.time_calls(calls, group, device, block_s=0.02, blocks=5)


def fit_links(device: torch.device) -> dict[int, CollectiveFit]:
    """The all-reduce's fit over all N processes, and with an even N above 2
    over pairs of them (every pair at once; the slowest pair's times)."""
    n = dist.get_world_size()
    groups: dict[int, Any] = {n: None}  # None: the whole world
    if n > 2 and n % 2 == 0:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, n, 2)]
        groups[2] = pairs[dist.get_rank() // 2]
    fits = {}
    for size, group in groups.items():
        for attempt in range(3):  # a busy spell can hide the bandwidth: again
            seconds = all_reduce_seconds(group, device)
            slowest = max(every_rank(seconds), key=sum)  # the same on every rank
            try:
                alpha, beta = fit_alpha_beta(SIZES, slowest)
                break
            except CourseError:
                if attempt == 2:
                    raise
        fits[size] = CollectiveFit("all_reduce", size, alpha, 1 / beta)
    return fits


def degree_links(
    layout: Layout, fits: dict[int, CollectiveFit], flops: float
) -> dict[str, DeviceAndLink]:
    """Each degree's link: the fit of its groups' size (the largest fitted, for
    a size not fitted); a pipeline's, the pairs' fit, as each stage sends to
    one neighbour."""
    links = {}
    for degree in DEGREES:
        size = 2 if degree == "pipeline" else getattr(layout, degree)
        fit = fits.get(size, fits[max(fits)])
        links[degree] = fit.as_link(flops, f"all-reduce fit, {fit.processes}")
    return links


# ---- the layouts, built with the scripts' functions


def with_recomputation(model: GPT) -> GPT:
    """Every block under activation checkpointing."""
    model.blocks = nn.ModuleList(Checkpointed(block) for block in model.blocks)
    return model


def build(layout: Layout, model: GPT, device) -> tuple[Any, Callable]:
    """Split ``model`` as ``layout`` says; return what holds its parameters (for
    the optimizer and the memory count) and a step function ``step(opt, x, y)``
    that returns this process's loss of the global batch, or None."""
    n, k = dist.get_world_size(), layout.microbatches
    if layout not in layouts_for(n, full=True).values():
        raise CourseError(f"the check cannot build {layout} on {n} processes.")
    if layout.recompute:
        with_recomputation(model)
    if layout.data == n:  # DDP, with no_sync until the last micro-batch
        ddp = DDP(model)

        def data_step(optimizer, x, y):
            optimizer.zero_grad(set_to_none=True)
            parts = list(
                zip(*(fsdp_gpt.local_slice(t).tensor_split(k) for t in (x, y)))
            )
            losses = []
            for i, (xs, ys) in enumerate(parts):
                sync = ddp.no_sync() if i < k - 1 else nullcontext()
                with sync:
                    loss = lm_loss(ddp(xs), ys) / k
                    loss.backward()
                losses.append(loss.detach())
            optimizer.step()
            return torch.stack(losses).sum()

        return ddp, data_step
    if layout.tensor == 1 and layout.pipeline == 1:  # FSDP2, or HSDP
        mesh = fsdp_gpt.fsdp_mesh(device.type, n, layout.data)
        fsdp_gpt.shard_model(model, mesh)
        return model, lambda opt, x, y: fsdp_gpt.train_step(model, opt, x, y, k, "each")
    if layout.pipeline == n:
        pipe = pipeline_gpt.build_pipeline(model, "1f1b", k, device)
        return nn.ModuleList(pipe.modules), lambda opt, x, y: pipeline_gpt.train_step(
            pipe, opt, x, y
        )
    # Tensor parallelism over "tp", and with shard > 1 FSDP2 over "dp".
    shape = (layout.shard, layout.tensor)
    mesh = torch.distributed.device_mesh.init_device_mesh(
        device.type, shape, mesh_dim_names=("dp", "tp")
    )
    kind = "2d" if layout.shard > 1 else ("sp" if layout.sequence_parallel else "tp")
    tensor_parallel_gpt.parallelize(model, kind, mesh)

    def tensor_step(optimizer, x, y):
        xs, ys = (tensor_parallel_gpt.local_batch(t, mesh) for t in (x, y))
        return tensor_parallel_gpt.train_step(model, optimizer, xs, ys)

    return model, tensor_step


def make_optimizer(holder: nn.Module, lr: float) -> torch.optim.Adam:
    """Adam over the layout's parameters: its DTensors and plain tensors in two
    groups (``tensor_parallel_gpt.make_adam``), as every layout may hold both."""
    return tensor_parallel_gpt.make_adam(holder, lr)


def global_loss(loss: torch.Tensor | None, layout: Layout, device) -> float:
    """The global batch's loss on every process, from each process's share."""
    if layout.pipeline > 1:
        return pipeline_gpt.loss_from_last_stage(loss, device)
    total = loss.detach().double().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def measure(layout: Layout, args, config: GPTConfig, batches, device) -> dict:
    """Build ``layout``, train a warm-up step and the timed ones, then one under
    ``LiveTensors``: the first and last losses, the step's median seconds,
    each peak."""
    model = build_model(config, args.seed, "float32", device)
    holder, step = build(layout, model, device)
    optimizer = make_optimizer(holder, args.lr)
    x, y = batches[0]
    first = global_loss(step(optimizer, x, y), layout, device)  # also the warm-up
    seconds = []
    for x, y in batches[1:-1]:
        dist.barrier()
        start = clock()
        step(optimizer, x, y)
        seconds.append(max(every_rank(clock() - start)))
    held = [
        *holder.parameters(),
        *(v for s in optimizer.state.values() for v in s.values()),
    ]
    with LiveTensors(held) as tensors:
        last = step(optimizer, *batches[-1])
    return {
        "first_loss": first,
        "last_loss": global_loss(last, layout, device),
        "seconds": statistics.median(seconds),
        "all_seconds": seconds,
        "peak_bytes": every_rank(tensors.peak),
    }


# ---- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.error = fail
    add = parser.add_argument
    add(
        "--layouts",
        default="all",
        help="names, separated by ';'; all (the default) or full (more)",
    )
    add("--steps", type=int, default=5, help="timed steps per layout (default: 5)")
    add("--batch-size", type=int, default=16, help="global batch (default: 16)")
    add("--seq-len", type=int, default=64, help="(default: 64)")
    add("--n-layer", type=int, default=4, help="(default: 4)")
    add("--n-head", type=int, default=4, help="(default: 4)")
    add("--n-embd", type=int, default=128, help="(default: 128)")
    add("--lr", type=float, default=3e-3, help="(default: 3e-3)")
    add("--seed", type=int, default=0, help="(default: 0)")
    add("--timeout", type=float, default=600, help="seconds to wait for the others")
    add("--results", help="a JSON file for rank 0's results")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    rank, n, device = setup_distributed(args.timeout)
    if args.batch_size % n:
        fail(
            f"--batch-size {args.batch_size} does not split evenly over {n} "
            f"processes; use a multiple of {n}."
        )
    known = layouts_for(n, full=True)
    chosen = {"all": layouts_for(n), "full": known}
    given = [name.strip() for name in args.layouts.split(";")]
    names = list(chosen.get(args.layouts, given))
    unknown = [name for name in names if name not in known]
    if unknown:
        fail(
            f"no layout {unknown[0]!r} on {n} processes; choose from: "
            f"{'; '.join(known)}."
        )
    reasons = {name: unbuildable(known[name], args) for name in names}
    if args.layouts not in chosen and any(reasons.values()):
        name = next(name for name, reason in reasons.items() if reason)
        fail(f"{name} cannot run with these sizes: {reasons[name]}.")
    for name in [name for name, reason in reasons.items() if reason]:
        print0(f"left out: {name} ({reasons[name]})")
        names.remove(name)
    config = GPTConfig(
        vocab_size=len(fsdp_gpt.CharText().chars),
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    workload = GPTWorkload(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        n_head=args.n_head,
        fused_attention=False,
    )
    # The warm-up step, the timed ones and the step under LiveTensors.
    batches = fsdp_gpt.global_batches(args, device, count=args.steps + 2)
    share = fsdp_gpt.local_slice(batches[0][0]), fsdp_gpt.local_slice(batches[0][1])
    flops = flop_rate(
        config, replace(workload, batch_size=args.batch_size // n), *share
    )
    fits = fit_links(device)
    print0(
        f"{n} processes on {device.type}: {flops / 1e9:.2f} GFLOP/s each; all-reduce "
        + ", ".join(
            f"over {size}: {fit.latency * 1e6:.0f} us + bytes / {fit.bandwidth / 1e9:.2f} GB/s"
            for size, fit in sorted(fits.items())
        )
    )
    plain = plain_losses(
        PlainConfig(**asdict(config)),
        batches,
        lr=args.lr,
        seed=args.seed,
        dtype=torch.float32,
        device=device,
    )
    runs = {}
    for name in names:
        layout = known[name]
        hw = degree_links(layout, fits, flops)
        predicted = {
            "step": layout_costs(workload, hw["data"], layout, hw),
            "memory": layout_memory(workload, layout),
        }
        measured = measure(layout, args, config, batches, device)
        runs[name] = {"layout": asdict(layout), "predicted": predicted, **measured}
        peak = max(measured["peak_bytes"]) / 2**20
        print0(
            f"{name:20s} predicted {predicted['step']['total'] * 1e3:.1f} ms, "
            f"{predicted['memory']['total'] / 2**20:.2f} MiB; measured "
            f"{measured['seconds'] * 1e3:.1f} ms, ~{peak:.2f} MiB"
        )
    different = [  # the first loss: the forward pass; the last: the training too
        f"the {which} loss of {name} differs from the plain model's"
        for name, run in runs.items()
        for which, reference in (("first", plain[0]), ("last", plain[-1]))
        if abs(run[f"{which}_loss"] - reference) > tolerance("float32")
    ]
    results = None
    if rank == 0:
        results = {
            **where_it_ran(device),
            "check": "layouts.py",
            "torch": str(torch.__version__),
            "world_size": n,
            "workload": asdict(workload),
            "flops": flops,
            "links": {str(size): asdict(fit) for size, fit in fits.items()},
            "plain_first_loss": plain[0],
            "plain_last_loss": plain[-1],
            "runs": runs,
        }
    failure = different[0] if different else ""
    finish(results, failure, args.results)


if __name__ == "__main__":
    main()
