"""Chapter 16's measurements of communication: collectives, then DDP's buckets and overlap.

    launch("checks/cost_of_talking.py", ["--groups", "2", "4", "--compile"], nproc=4)

In one launch, so that every prediction and its measurement meet the same
load (and the processes start once):

1. every collective of ``collective_bench.py``, timed by that script's own
   ``sweep`` in groups of ``--groups`` processes (the first n ranks), over
   message sizes from ``--min-bytes`` to ``--max-bytes``, and what other
   programs took of the cores meanwhile (``companion.harness.timing.OtherLoad``, the
   ranks of the job counted as one program);

then, on the first two ranks (the others wait, and on a CPU the two take
their cores: ``cpu_count() // 2`` threads each), on the course GPT
(``companion.gpt``), each process with its own batch:

2. the plain model's forward and backward passes, with the moment each
   gradient is ready (a hook on each parameter; CUDA events on a GPU);
3. a step (forward and backward) of DDP for every ``--caps`` bucket size and
   DDP's default, of the default under ``no_sync()`` (no communication), of
   the default beside an all-reduce of all the gradients' bytes started as
   the backward pass starts, that all-reduce alone, and blocks of
   all-reduces of 4 KiB to 16 MiB for the fit the DDP model uses: the
   variants take turns round after round, in an order rotated each round;
   the buckets DDP built after its first step; each round's time of the
   slowest rank, with their median and IQR (for the all-reduces' blocks,
   the median per call only);
4. ``--traces`` profiled steps of the default DDP: the intervals of
   computation and of the backend's all-reduces, and the communication left
   exposed, from the rank that finished its backward pass last; every step's
   exposed and whole communication, and the intervals of the median step; and what other
   programs took of the cores over steps 2 to 4, as in 1;
5. with ``--compile``: a GPT of ``--compile-layers`` blocks under
   ``torch.compile`` (graphs split at the buckets by DDP's optimizer) and
   under compiled autograd (the all-reduces traced into the backward
   graph), their graphs counted, their losses beside eager DDP's, steps of
   each timed, and ``--traces`` steps of each profiled as in 4.

Rank 0 writes everything to ``--results``. Used in chapter 16.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from companion.checks._shared import DeviceClock
from companion.comm_costs import exposed_communication
from companion.gpt import GPT, GPTConfig, lm_loss
from companion.harness.devices import cpu_count
from companion.harness.timing import OtherLoad
from companion.scripts import collective_bench
from companion.scripts.collective_bench import (
    calls_per_block,
    fail,
    make_call,
    setup_distributed,
    sync,
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
    add("--groups", type=int, nargs="+", default=[2])  # collective group sizes
    add("--min-bytes", type=float, default=64)  # smallest message
    add("--max-bytes", type=float, default=2**24)  # largest message (16 MiB)
    add("--n-layer", type=int, default=4)  # transformer blocks
    add("--n-embd", type=int, default=256)  # width d
    add("--micro-batch-size", type=int, default=2)  # sequences per process
    add("--seq-len", type=int, default=64)  # tokens per sequence
    add("--caps", type=float, nargs="+", default=[0.05, 0.25, 1.0, 4.0, 8.0])  # MiB
    add("--rounds", type=int, default=11)  # timed rounds (after one warm-up)
    add("--traces", type=int, default=9)  # profiled steps of the default DDP
    add("--compile", action="store_true")  # also the torch.compile variants
    add("--compile-steps", type=int, default=3)  # steps compared with eager
    add("--compile-layers", type=int, default=1)  # blocks of the compiled model
    add("--compile-cap", type=float, default=1.0)  # MiB; DDP's optimizer needs >= 1
    add("--backend", default="aot_eager")  # torch.compile's backend
    add("--timeout", type=float, default=600)  # seconds
    add("--results", default="")  # a JSON file for rank 0's results
    args = parser.parse_args(argv)
    if args.rounds < 3 or args.traces < 3 or min(args.caps, default=1) <= 0:
        parser.error("--rounds and --traces must be at least 3, every cap positive")
    return args


def build_model(n_layer: int, args: argparse.Namespace, device: torch.device) -> GPT:
    torch.manual_seed(0)  # the same initial model on every rank
    config = GPTConfig(
        vocab_size=64,
        block_size=args.seq_len,
        n_layer=n_layer,
        n_head=4,
        n_embd=args.n_embd,
    )
    return GPT(config).to(device)


def batch(args: argparse.Namespace, rank: int, device: torch.device, step: int = 0):
    gen = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own data
    x = torch.randint(0, 64, (args.micro_batch_size, args.seq_len + 1), generator=gen)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def backward_profile(model: GPT, x, y, rounds: int, device) -> dict:
    """Forward and backward times, and when each gradient is ready (medians)."""
    clock = DeviceClock(device)
    params = list(model.parameters())
    stamps: dict[int, object] = {}
    order: list[int] = []

    def ready(i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            stamps[i] = clock.mark()
            order.append(i)

        return hook

    hooks = [
        p.register_post_accumulate_grad_hook(ready(i)) for i, p in enumerate(params)
    ]
    forward, backward, ready_times = [], [], []
    for _ in range(rounds + 1):  # the first round warms up
        model.zero_grad(set_to_none=True)
        stamps.clear()
        order.clear()
        sync(device)
        t0 = clock.mark()
        loss = lm_loss(model(x), y)
        t1 = clock.mark()
        loss.backward()
        t2 = clock.mark()
        sync(device)
        forward.append(clock.seconds(t0, t1))
        backward.append(clock.seconds(t1, t2))
        ready_times.append([clock.seconds(t1, stamps[i]) for i in range(len(params))])
    for hook in hooks:
        hook.remove()
    return {
        "forward": statistics.median(forward[1:]),
        "backward": statistics.median(backward[1:]),
        "ready": [
            statistics.median(r[i] for r in ready_times[1:]) for i in range(len(params))
        ],
        "ready_order": list(order),
        "bytes": [p.numel() * p.element_size() for p in params],
        "names": [n for n, _ in model.named_parameters()],
    }


def make_ddp(model: GPT, cap: float | None, group) -> DDP:
    """DDP over a copy of ``model``; ``cap=None`` leaves bucket_cap_mb at its default."""
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    # The causal mask, a buffer, never changes: no broadcast before each forward.
    kwargs[NO_BUFFER_SYNC] = False
    return DDP(copy.deepcopy(model), process_group=group, **kwargs)


def ddp_buckets(ddp: DDP) -> list[list[int]]:
    """The buckets DDP rebuilt after its first step: parameter indices, in launch order."""
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices", "")
    return [[int(i) for i in part.split()] for part in text.split(",") if part.strip()]


def step(model, x, y) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss


def time_variants(
    variants: dict[str, Callable[[], object]], rounds: int, group, device
) -> dict[str, dict]:
    """Each variant once per round, in turn, after a barrier, the order rotated by
    one each round (so that no variant always follows the same one). Per variant:
    the time of each round, the largest over the ranks (a step ends for every rank
    when it ends for the last), and their median and interquartile range. Variants
    timed in the same round met the same load: subtract them round by round
    (``companion.harness.timing.paired_difference``)."""
    runs = list(variants.values())
    times = torch.zeros(len(runs), rounds + 1, dtype=torch.float64)
    for r in range(rounds + 1):  # the first round warms up
        for k in [(r + i) % len(runs) for i in range(len(runs))]:
            run = runs[k]
            dist.barrier(group=group)
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            times[k, r] = time.perf_counter() - start
    slowest = times[:, 1:].contiguous().to(device)  # collectives want contiguous
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    result = {}
    for name, per_round in zip(variants, slowest.tolist()):
        q1, median, q3 = statistics.quantiles(per_round, n=4)
        result[name] = {"median": median, "iqr": q3 - q1, "rounds": per_round}
    return result


def profiled_step(run: Callable[[], object], group, device) -> dict:
    """One step under the profiler on every rank of ``group``: its computation and
    communication, from the rank with the least exposed communication."""
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
    dist.barrier(group=group)
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
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    least = min(range(len(every)), key=lambda r: every[r]["exposed"])
    return {
        **every[least],
        "rank": least,
        "exposed_per_rank": [e["exposed"] for e in every],
    }


def median_trace(traces: list[dict]) -> dict:
    """The profiled step with the median exposed communication, and every step's
    exposed and whole communication."""
    kept = sorted(traces, key=lambda t: t["exposed"])[len(traces) // 2]
    return {
        **kept,
        "exposed_steps": [t["exposed"] for t in traces],
        "communication_steps": [t["communication"] for t in traces],
    }


def ddp_part(args, rank: int, group, device) -> dict:
    """Steps 2 to 4 of the module's list, on the ranks of ``group``."""
    n = dist.get_world_size(group)
    model = build_model(args.n_layer, args, device)
    x, y = batch(args, rank, device)

    sizes = [4096 * 4**k for k in range(7)]  # 4 KiB to 16 MiB
    calls, counted = zip(*(make_call("all_reduce", s, group, n, device) for s in sizes))
    repeats = calls_per_block(calls, group, device, 0.005)

    # The slowest rank's backward pass, whole: the others wait for it.
    profiles: list = [None] * n
    dist.all_gather_object(
        profiles, backward_profile(model, x, y, args.rounds, device), group=group
    )
    slowest = max(range(n), key=lambda r: profiles[r]["backward"])
    plain = {**profiles[slowest], "rank": slowest}

    caps = {f"{c:g} MiB": c for c in args.caps} | {"default": None}
    ddps = {name: make_ddp(model, cap, group) for name, cap in caps.items()}
    for ddp in ddps.values():
        for _ in range(2):  # the first step builds the buckets it will keep
            step(ddp, x, y)
    default = ddps["default"]
    gradients = torch.zeros(sum(plain["bytes"]) // 4, device=device)

    def no_communication() -> None:
        with default.no_sync():
            step(default, x, y)

    def beside_an_all_reduce() -> None:  # how much a hidden all-reduce slows the pass
        with default.no_sync():
            default.zero_grad(set_to_none=True)
            loss = lm_loss(default(x), y)
            work = dist.all_reduce(gradients, group=group, async_op=True)
            loss.backward()
            work.wait()

    variants = {
        "no communication": no_communication,
        "backward beside an all-reduce": beside_an_all_reduce,
        "all-reduce alone": lambda: dist.all_reduce(gradients, group=group),
    }
    variants |= {name: (lambda d=d: step(d, x, y)) for name, d in ddps.items()}
    # The fit's all-reduces take turns with the steps, so both meet the same load.
    blocks = {
        f"all-reduce {b} B": (b, call, k) for b, call, k in zip(counted, calls, repeats)
    }
    variants |= {
        name: (lambda call=call, k=k: [call() for _ in range(k)])
        for name, (_, call, k) in blocks.items()
    }
    measured = time_variants(variants, args.rounds, group, device)
    all_reduce = [
        {
            "kind": "all_reduce",
            "processes": n,
            "bytes": b,
            "seconds": measured.pop(name)["median"] / k,
        }
        for name, (b, _, k) in blocks.items()
    ]
    return {
        "device": device.type,
        "backend": dist.get_backend(group),
        "threads": torch.get_num_threads(),
        "world_size": n,
        "config": {
            k: getattr(args, k)
            for k in ("n_layer", "n_embd", "micro_batch_size", "seq_len")
        },
        "caps": caps,
        "all_reduce": all_reduce,
        "plain": plain,
        "step": measured,
        "buckets": {name: ddp_buckets(d) for name, d in ddps.items()},
        "trace": median_trace(
            [
                profiled_step(lambda: step(default, x, y), group, device)
                for _ in range(args.traces)
            ]
        ),
    }


def compiled_part(args, rank: int, group, device) -> dict:
    """Step 5: torch.compile with DDP's optimizer, and compiled autograd, against
    eager DDP, on a GPT of ``--compile-layers`` blocks (compiling costs seconds)."""
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    graphs: list[dict] = []
    backend = torch._dynamo.lookup_backend(args.backend)

    def counting_backend(gm: torch.fx.GraphModule, example_inputs):
        targets = [str(node.target) for node in gm.graph.nodes]
        graphs.append(
            {
                "nodes": len(targets),
                "all_reduces": sum("all_reduce" in t for t in targets),
            }
        )
        return backend(gm, example_inputs)

    model = build_model(args.compile_layers, args, device)
    batches = [batch(args, rank, device, s) for s in range(args.compile_steps)]
    cap = args.compile_cap

    def train(run: Callable) -> list[float]:
        return [run(x, y).item() for x, y in batches]

    eager = make_ddp(model, cap, group)
    results: dict = {
        "cap": cap,
        "n_layer": args.compile_layers,
        "backend": args.backend,
        "parameters": [name for name, _ in model.named_parameters()],
        "bytes": [p.numel() * p.element_size() for p in model.parameters()],
        "eager_losses": train(lambda x, y: step(eager, x, y)),
    }

    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    split = torch.compile(make_ddp(model, cap, group), backend=counting_backend)
    results["ddp_optimizer_losses"] = train(lambda x, y: step(split, x, y))
    results["ddp_optimizer_graphs"] = list(graphs)

    graphs.clear()
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch._dynamo.config.compiled_autograd = True
    try:
        traced = make_ddp(model, cap, group)  # the reducer is chosen as DDP is built

        @torch.compile(backend=counting_backend)
        def traced_step(x, y):  # backward inside: compiled autograd traces it
            loss = lm_loss(traced(x), y)
            loss.backward()
            return loss

        def run_traced(x, y):
            traced.zero_grad(set_to_none=True)
            return traced_step(x, y)

        results["compiled_autograd_losses"] = train(run_traced)
        results["compiled_autograd_graphs"] = list(graphs)
        x, y = batches[0]
        variants = {
            "eager": lambda: step(eager, x, y),
            "ddp_optimizer": lambda: step(split, x, y),
            "compiled_autograd": lambda: run_traced(x, y),
        }
        results["step"] = time_variants(variants, args.rounds, group, device)
        results["exposed"] = {
            name: median_trace(
                [profiled_step(run, group, device) for _ in range(args.traces)]
            )
            for name, run in variants.items()
        }
    finally:
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    return results


def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_distributed(args.timeout)
    if world_size < 2 or max(args.groups) > world_size or min(args.groups) < 2:
        fail(f"launch at least 2 processes, and groups of 2 to {world_size} of them")
    bench = collective_bench.parse_args(
        [
            "--groups",
            *map(str, args.groups),
            "--min-bytes",
            str(args.min_bytes),
            "--max-bytes",
            str(args.max_bytes),
        ]
    )
    job = psutil.Process(os.getppid())  # the ranks' parent: torchrun's or fast_start
    with OtherLoad(tree=job) as others:  # what other programs took meanwhile
        measurements = collective_bench.sweep(bench, rank, world_size, device)
    results = {
        **where_it_ran(device),
        "measurements": measurements,
        "other_load": others.as_dict(),
    }
    pair = dist.group.WORLD if world_size == 2 else dist.new_group([0, 1])
    if rank < 2:
        if device.type == "cpu":  # the two fill the cores, as a DDP job would
            torch.set_num_threads(max(1, cpu_count() // 2))
        with OtherLoad(tree=job) as others:
            results["ddp"] = ddp_part(args, rank, pair, device)
        results["ddp"]["other_load"] = others.as_dict()
        if args.compile:
            results["ddp"]["compiled"] = compiled_part(args, rank, pair, device)
    dist.barrier()  # the other ranks wait here
    if rank == 0 and args.results:
        Path(args.results).write_text(json.dumps(results, indent=1))
    gc.collect()  # no DDP reducer may outlive the group: it can hang destroying it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
