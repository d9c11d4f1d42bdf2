"""Chapter 16's DDP measurements: what a step's all-reduces cost, and how much hides.

    launch("checks/ddp_overlap.py", ["--caps", "0.05", "1", "4", "100"], nproc=2)

On the course GPT (``companion.gpt``), each process with its own batch, it
measures in one run, so that the model and what it predicts meet the same
load:

1. all-reduces of 4 KiB to 16 MiB, timed as ``collective_bench.py`` times
   them (for the alpha-beta fit the prediction uses);
2. the plain model's forward and backward passes, with the moment each
   parameter's gradient is ready (a hook on each; CUDA events on a GPU);
3. a step (forward and backward) of DDP for every ``--caps`` bucket size
   and for DDP's default, and of the default under ``no_sync()`` (no
   communication), the variants taking turns round after round; the buckets
   DDP built after its first step; the slowest rank's medians;
4. one profiled step of the default DDP: the intervals of computation and
   of the backend's all-reduces, and the communication left exposed;
5. with ``--compile``: the same steps under ``torch.compile`` (graphs split
   at the buckets by DDP's optimizer) and under compiled autograd (the
   all-reduces traced into the backward graph), their graphs counted,
   their losses beside eager DDP's, and a profiled step of each.

Rank 0 writes everything to ``--results``. Used in chapter 16.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from companion.comm_costs import exposed_communication
from companion.gpt import GPT, GPTConfig, lm_loss
from companion.scripts.collective_bench import (
    make_call,
    setup_distributed,
    sync,
    time_calls,
    where_it_ran,
)

# torch 2.14 renamed DDP's broadcast_buffers (the old name warns there).
NO_BUFFER_SYNC = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DDP).parameters
    else "broadcast_buffers"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--n-layer", type=int, default=4)  # transformer blocks
    add("--n-embd", type=int, default=256)  # width d
    add("--batch-size", type=int, default=2)  # sequences per process
    add("--seq-len", type=int, default=64)  # tokens per sequence
    add("--caps", type=float, nargs="+", default=[0.05, 1.0, 4.0, 100.0])  # MiB
    add("--rounds", type=int, default=5)  # timed rounds (after one warm-up)
    add("--compile", action="store_true")  # also time torch.compile variants
    add("--compile-steps", type=int, default=3)  # steps compared with eager
    add("--compile-layers", type=int, default=1)  # blocks of the compiled model
    add("--compile-cap", type=float, default=1.0)  # MiB; DDP's optimizer needs >= 1
    add("--backend", default="aot_eager")  # torch.compile's backend
    add("--timeout", type=float, default=600)  # seconds
    add("--results", default="")  # a JSON file for rank 0's results
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace, device: torch.device) -> GPT:
    torch.manual_seed(0)  # the same initial model on every rank
    config = GPTConfig(
        vocab_size=64, block_size=args.seq_len, n_layer=args.n_layer,
        n_head=4, n_embd=args.n_embd,
    )  # fmt: skip
    return GPT(config).to(device)


def batch(args: argparse.Namespace, rank: int, device: torch.device, step: int = 0):
    gen = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own data
    x = torch.randint(0, 64, (args.batch_size, args.seq_len + 1), generator=gen)
    return x[:, :-1].to(device), x[:, 1:].to(device)


class Clock:
    """Seconds since ``start()``, on the GPU's own clock when there is one."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1e3  # after a synchronize
        return end - start


def backward_profile(model: GPT, x, y, rounds: int, device) -> dict:
    """Forward and backward times, and when each gradient is ready (median of rounds)."""
    clock = Clock(device)
    params = list(model.parameters())
    stamps: dict[int, object] = {}
    order: list[int] = []

    def ready(i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            stamps[i] = clock.stamp()
            order.append(i)

        return hook

    hooks = [
        p.register_post_accumulate_grad_hook(ready(i)) for i, p in enumerate(params)
    ]
    forward, backward, ready_times = [], [], []
    for _ in range(rounds + 1):
        model.zero_grad(set_to_none=True)
        stamps.clear()
        order.clear()
        sync(device)
        t0 = clock.stamp()
        loss = lm_loss(model(x), y)
        t1 = clock.stamp()
        loss.backward()
        t2 = clock.stamp()
        sync(device)
        forward.append(clock.seconds(t0, t1))
        backward.append(clock.seconds(t1, t2))
        ready_times.append([clock.seconds(t1, stamps[i]) for i in range(len(params))])
    for hook in hooks:
        hook.remove()
    ready_median = [
        statistics.median(r[i] for r in ready_times[1:]) for i in range(len(params))
    ]
    return {
        "forward": statistics.median(forward[1:]),
        "backward": statistics.median(backward[1:]),
        "ready": ready_median,
        "ready_order": list(order),
        "bytes": [p.numel() * p.element_size() for p in params],
        "names": [n for n, _ in model.named_parameters()],
    }


def make_ddp(model: GPT, cap: float | None) -> DDP:
    """DDP over a copy of ``model``; ``cap=None`` leaves bucket_cap_mb at its default."""
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    # The causal mask, a buffer, never changes: no broadcast before each forward.
    kwargs[NO_BUFFER_SYNC] = False
    return DDP(copy.deepcopy(model), **kwargs)


def ddp_buckets(ddp: DDP) -> list[list[int]]:
    """The buckets DDP rebuilt after its first step: parameter indices, in launch order."""
    data = ddp._get_ddp_logging_data()
    text = data.get("rebuilt_per_bucket_param_indices", "")
    return [[int(i) for i in part.split()] for part in text.split(",") if part.strip()]


def step(model, x, y) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss


def slowest(times: dict[str, list[float]], device) -> dict[str, dict[str, float]]:
    """Each variant's median and interquartile range on this rank; the largest of
    each over the ranks (a step ends for everyone when it ends for the last)."""
    names = list(times)
    stats = []
    for name in names:
        q1, _, q3 = statistics.quantiles(times[name], n=4)
        stats += [statistics.median(times[name]), q3 - q1]
    local = torch.tensor(stats, device=device, dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    values = local.tolist()
    return {
        name: {"median": values[2 * k], "iqr": values[2 * k + 1]}
        for k, name in enumerate(names)
    }


def time_variants(
    variants: dict[str, Callable[[], object]], rounds: int, device
) -> dict:
    """Each variant once per round, in turn, after a barrier; the slowest rank's
    median and spread."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            dist.barrier()
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return slowest(times, device)


def profiled_step(run: Callable[[], object], device) -> dict:
    """One step under the profiler: its computation and communication intervals."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's status lines
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    try:
        config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
        prof = profile(activities=activities, experimental_config=config)
    except TypeError:  # older torch: the backend's threads are recorded anyway
        prof = profile(activities=activities)
    dist.barrier()
    with prof:
        run()
        sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    mine = exposed_communication(events, gpu=device.type == "cuda")
    # A rank that finished its backward pass first also waits for the others:
    # the last one to finish sees the communication alone.
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    least = min(range(len(every)), key=lambda r: every[r]["exposed"])
    return {
        **every[least],
        "rank": least,
        "exposed_per_rank": [e["exposed"] for e in every],
    }


def compiled_variants(args, device, rank) -> dict:
    """torch.compile with DDP's optimizer, and compiled autograd, against eager DDP,
    on a GPT of ``--compile-layers`` blocks (compiling takes seconds per block)."""
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    graphs: list[dict] = []
    backend = torch._dynamo.lookup_backend(args.backend)

    def counting_backend(gm: torch.fx.GraphModule, example_inputs):
        targets = [str(node.target) for node in gm.graph.nodes]
        graphs.append({
            "nodes": len(targets),
            "all_reduces": sum("all_reduce" in t for t in targets),
        })  # fmt: skip
        return backend(gm, example_inputs)

    batches = [batch(args, rank, device, s) for s in range(args.compile_steps)]
    cap = args.compile_cap
    small = argparse.Namespace(**{**vars(args), "n_layer": args.compile_layers})
    model = build_model(small, device)

    def train(run: Callable, steps) -> list[float]:
        return [run(x, y).item() for x, y in steps]

    eager = make_ddp(model, cap)
    results: dict = {
        "cap": cap,
        "n_layer": args.compile_layers,
        "parameters": [name for name, _ in model.named_parameters()],
        "bytes": [p.numel() * p.element_size() for p in model.parameters()],
        "eager_losses": train(lambda x, y: step(eager, x, y), batches),
    }

    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    split = make_ddp(model, cap)
    compiled_split = torch.compile(split, backend=counting_backend)
    start = time.perf_counter()
    results["ddp_optimizer_losses"] = train(
        lambda x, y: step(compiled_split, x, y), batches
    )
    results["ddp_optimizer_compile_s"] = time.perf_counter() - start
    results["ddp_optimizer_graphs"] = list(graphs)
    results["ddp_optimizer_buckets"] = ddp_buckets(split)

    graphs.clear()
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch._dynamo.config.compiled_autograd = True
    try:
        traced = make_ddp(model, cap)  # the Python reducer is chosen when DDP is built

        @torch.compile(backend=counting_backend)
        def traced_step(x, y):
            loss = lm_loss(traced(x), y)
            loss.backward()
            return loss

        def run_traced(x, y):
            traced.zero_grad(set_to_none=True)
            return traced_step(x, y)

        start = time.perf_counter()
        results["compiled_autograd_losses"] = train(run_traced, batches)
        results["compiled_autograd_compile_s"] = time.perf_counter() - start
        results["compiled_autograd_graphs"] = list(graphs)
        x, y = batches[0]
        variants = {
            "eager": lambda: step(eager, x, y),
            "ddp_optimizer": lambda: step(compiled_split, x, y),
            "compiled_autograd": lambda: run_traced(x, y),
        }
        results["step"] = time_variants(variants, args.rounds, device)
        results["exposed"] = {
            name: profiled_step(run, device) for name, run in variants.items()
        }
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    return results


def main() -> None:
    args = parse_args()
    rank, _, world_size, device = setup_distributed(args.timeout)
    if world_size < 2:
        print("ddp_overlap.py: launch it with 2 processes or more", file=sys.stderr)
        sys.exit(2)
    model = build_model(args, device)
    x, y = batch(args, rank, device)

    # 1. all-reduces of the sizes a bucket can have
    sizes = [4096 * 4**k for k in range(7)]  # 4 KiB to 16 MiB
    calls, counted = zip(
        *(
            make_call("all_reduce", s, dist.group.WORLD, world_size, device)
            for s in sizes
        )
    )
    seconds = time_calls(calls, dist.group.WORLD, device, 0.005, args.rounds)
    all_reduce = [{"kind": "all_reduce", "processes": world_size, "bytes": b, "seconds": t}
                  for b, t in zip(counted, seconds)]  # fmt: skip

    # 2. the backward pass alone
    plain = backward_profile(model, x, y, args.rounds, device)
    slowest = torch.tensor([plain["forward"], plain["backward"]], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    plain["forward"], plain["backward"] = slowest.tolist()

    # 3. DDP for every cap, and without communication
    caps = {f"{c:g} MiB": c for c in args.caps} | {"default": None}
    ddps = {name: make_ddp(model, cap) for name, cap in caps.items()}
    for ddp in ddps.values():
        for _ in range(2):  # the first step builds the buckets it will keep
            step(ddp, x, y)

    def no_comm() -> None:
        with ddps["default"].no_sync():
            step(ddps["default"], x, y)

    # How much a hidden all-reduce slows the backward pass: one of all the
    # gradients' bytes, started as the backward pass starts.
    gradients = torch.zeros(sum(plain["bytes"]) // 4, device=device)

    def beside() -> None:
        ddp = ddps["default"]
        with ddp.no_sync():
            ddp.zero_grad(set_to_none=True)
            loss = lm_loss(ddp(x), y)
            work = dist.all_reduce(gradients, async_op=True)
            loss.backward()
            work.wait()

    variants = {
        "no communication": no_comm,
        "backward beside an all-reduce": beside,
        "all-reduce alone": lambda: dist.all_reduce(gradients),
    }
    variants |= {name: (lambda d=d: step(d, x, y)) for name, d in ddps.items()}
    measured = time_variants(variants, args.rounds, device)
    buckets = {name: ddp_buckets(d) for name, d in ddps.items()}

    # 4. a profiled step of DDP's default
    trace = profiled_step(lambda: step(ddps["default"], x, y), device)

    results = {
        **where_it_ran(device),
        "config": {
            k: getattr(args, k) for k in ("n_layer", "n_embd", "batch_size", "seq_len")
        },
        "caps": caps,
        "all_reduce": all_reduce,
        "plain": plain,
        "step": measured,
        "buckets": buckets,
        "trace": trace,
    }
    if args.compile:
        results["compiled"] = compiled_variants(args, device, rank)
    if rank == 0 and args.results:
        Path(args.results).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
