"""A small data-parallel training run that goes wrong on purpose, one way at a time.

    python failures.py                                     # one process, no bug
    torchrun --standalone --nproc-per-node=2 failures.py --fail stuck --stall-dump 30
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node=2 \\
        failures.py --fail shape --shard
    srun --ntasks=2 python failures.py --fail nan --watch

``--fail`` picks the bug (chapter 15): ``shape``, ``order``, ``rank0-only`` (collectives
that differ between ranks); ``uneven`` (one rank has fewer batches; ``--fix sampler``,
``steps`` or ``join-state`` cures it; ``join`` alone ends the epoch but leaves the
optimizer's state apart); ``crash``, ``kill``, ``stuck``, ``oom`` (the last rank fails
at ``--fail-step``); ``unseen-param``, ``sampler-seed``, ``no-set-epoch`` (silent bugs),
which ``--check-every`` catches; ``nan`` and ``slow`` (the last rank), which ``--watch``
catches. The tools: ``--timeout`` bounds every collective, ``--barrier-timeout`` names
the ranks that miss an epoch's end, ``--stall-dump`` prints every rank's stack when a
step stalls (``kill -USR1 PID``: one rank's), ``--debug-socket DIR`` answers for stacks
and Flight Recorder entries on a socket per rank, and ``--flight-recorder DIR`` dumps
each rank's last collectives on an error (``TORCH_FR_BUFFER_SIZE`` entries, 2,000 by
default since torch 2.11; under 2.10, which records none by default, the script sets it
for these two tools). ``--checkpoint-dir`` keeps DCP checkpoints; a run resumes from the
newest on any number of processes, with the same global batches.

Exit codes: 0 done; 1 crashed (where each bug ends, when it does not hang);
2 a bad launch or input, said in one sentence.
"""

import argparse
import datetime
import faulthandler
import gc
import json
import math
import os
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from distributed_setup import fail, setup_distributed, where_it_ran

FAILURES = ("shape", "order", "rank0-only", "uneven", "crash", "kill", "stuck", "oom")
FAILURES += ("unseen-param", "sampler-seed", "no-set-epoch", "nan", "slow")
FIXES = ("sampler", "join", "join-state", "steps")  # join-state: join() + optimizer
VALIDATION = 101  # samples; each rank scores its own slice (50 and 51 on 2 ranks)
SPIKE = 10  # --watch stops at a loss above 10 x the median of the recent steps
START = time.monotonic()


def make_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points from 4 Gaussian blobs in 8 dimensions (float64), and their labels."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(samples) % 4
    centres = 2 * torch.randn(4, 8, generator=gen, dtype=torch.float64)
    noise = torch.randn(samples, 8, generator=gen, dtype=torch.float64)
    return centres[labels] + noise, labels


def epoch_order(samples: int, epoch: int, args: argparse.Namespace) -> list[int]:
    """This rank's shard of one epoch: its sample indices, in order."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.fail == "uneven" and args.fix != "sampler":
        # BUG: a split by hand; 255 samples give rank 0 127 and rank 1 128.
        shuffled = torch.Generator().manual_seed(args.seed + epoch)
        order = torch.randperm(samples, generator=shuffled).tolist()
        return order[rank * samples // world_size : (rank + 1) * samples // world_size]
    seed = args.seed + (rank if args.fail == "sampler-seed" else 0)  # BUG: + rank
    sampler = DistributedSampler(range(samples), world_size, rank, seed=seed)
    if args.fail != "no-set-epoch":  # BUG: forgotten, every epoch is epoch 0
        sampler.set_epoch(epoch)
    return list(sampler)  # padded: every rank gets as many samples


def batches_of(order: list[int], micro: int) -> list[list[int]]:
    """A shard's full micro-batches (a short last one is left out)."""
    return [order[i : i + micro] for i in range(0, len(order) - micro + 1, micro)]


def build_model(seed: int, device: torch.device) -> nn.Sequential:
    """The same small MLP on every rank, in float64 so that runs compare tightly."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    return model.double().to(device)


def parallelize(model: nn.Sequential, args: argparse.Namespace) -> nn.Module:
    """Wrap ``model`` in DDP, or shard it with FSDP2 (``--shard``)."""
    if args.shard:
        from torch.distributed.fsdp import fully_shard  # here: a second to import

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    device = next(model.parameters()).device
    if device.type == "cpu" and dist.get_debug_level() == dist.DebugLevel.DETAIL:
        fail("DDP crashes on gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL; add --shard")
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    if args.fail == "unseen-param":  # BUG: a layer added after DDP wrapped the model
        model.add_module("head", nn.Linear(4, 4).double().to(device))
    return ddp


@torch.no_grad()
def check_replicas(model: nn.Module, step: int) -> None:
    """Raise on every rank if the ranks' parameters differ: a cheap checksum.

    A float64 norm and sum per parameter tensor, gathered from every rank;
    replicas that took the same steps are equal bit for bit. The error shows
    both: drift whose entries add up to zero, as a softmax's gradients do,
    leaves the sums equal.
    """
    names, params = zip(*model.named_parameters())
    stats = [torch.stack([p.double().norm(), p.double().sum()]) for p in params]
    mine = torch.stack(stats)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    gathered = torch.stack(every).cpu()  # one copy to the host: [rank, param, 2]
    for i, name in enumerate(names):
        norms, sums = gathered[:, i, 0].tolist(), gathered[:, i, 1].tolist()
        if max(norms) != min(norms) or max(sums) != min(sums):
            raise RuntimeError(
                f"the replicas differ after step {step}: {name} has norm "
                + ", ".join(f"{v:.6f} on rank {r}" for r, v in enumerate(norms))
                + f" (apart by {max(norms) - min(norms):.1e}; its sums by "
                + f"{max(sums) - min(sums):.1e})"
            )


def check_data(order: list[int], previous: list | None, samples: int, device) -> None:
    """Raise on every rank if the epoch's shards leave samples out, or if a
    rank's shard repeats its previous epoch's order (for a shuffled sampler).
    Call it on every rank, with its shard (the samples a short last
    micro-batch leaves out are not a bug)."""
    mine = torch.tensor(order, dtype=torch.long)
    repeats = torch.tensor([int(order == previous)])  # 1 if this rank repeats
    seen = torch.cat([torch.bincount(mine, minlength=samples), repeats]).to(device)
    dist.all_reduce(seen)  # how often each sample occurs; how many ranks repeat
    seen, repeated = seen[:-1], int(seen[-1])
    never, twice = int((seen == 0).sum()), int((seen > 1).sum())
    if never:  # padding repeats a few samples, but none may be left out
        raise RuntimeError(
            f"the ranks' shards overlap: {twice} samples twice, {never} never; "
            "do all ranks' samplers use the same seed?"
        )
    if repeated:  # on every rank, though only some may repeat
        raise RuntimeError("this epoch repeats the last one's order: set_epoch?")


def load_batch(x, y, indices: list[int], step: int, args, device) -> tuple:
    """The batch on ``device``; where the last rank's ``--fail`` strikes."""
    xb = x[indices]
    if dist.get_rank() == dist.get_world_size() - 1:
        if args.fail == "slow":  # at every step: a slow disk, a throttled device
            time.sleep(0.05)
        if step == args.fail_step and args.fail == "crash":  # restarts do not help
            raise ValueError(f"sample {indices[0]} is corrupt")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step == args.fail_step and args.fail == "kill" and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)  # the node is gone
        if step == args.fail_step and args.fail == "nan":  # a corrupt sample
            xb = xb.clone()
            xb[0] = float("nan")
        if step == args.fail_step and args.fail == "oom":  # the allocator refuses:
            torch.empty(2**60, dtype=torch.uint8, device=device)  # far too much
        while step == args.fail_step and args.fail == "stuck":  # a file never comes
            time.sleep(0.1)
    return xb.to(device), y[indices].to(device)


def watch(loss: torch.Tensor, start: float, step: int, history: list, model) -> list:
    """Before backward: every rank's loss and seconds since its step began,
    gathered; raise on every rank if a loss is not finite or above SPIKE times
    the median of the recent steps' losses, before the gradients' all-reduce
    spreads it. Returns each rank's seconds (a straggler takes the most)."""
    value = loss.item()  # a device sync: the clock below sees the work done
    seconds = time.perf_counter() - start
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    finite = torch.stack([torch.isfinite(p).all() for p in local]).all()  # no sync
    stats = torch.tensor([value, seconds], dtype=torch.float64, device=loss.device)
    mine = torch.cat([stats, finite.double().reshape(1)])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    gathered = torch.stack(every).cpu()  # one copy to the host: [rank, 3]
    losses = gathered[:, 0].tolist()
    recent = sorted(history[-8:])
    typical = recent[len(recent) // 2] if recent else math.inf
    bad = [
        r for r, v in enumerate(losses) if not math.isfinite(v) or v > SPIKE * typical
    ]
    if bad:
        weights = "finite" if bool(gathered[:, 2].all()) else "not all finite"
        raise RuntimeError(
            f"step {step}: the loss is "
            + ", ".join(f"{losses[r]:.4g} on rank {r}" for r in bad)
            + f", against a recent median of {typical:.4g}; stopped before the "
            + f"gradients' all-reduce, every rank's weights still {weights}"
        )
    history.append(sum(losses) / len(losses))
    return gathered[:, 1].tolist()


def sync_optimizer_state(optimizer, steps: int, device: torch.device) -> None:
    """After ``join()``: copy the optimizer's state to every rank from the rank
    whose parameters ``join()`` copied (the most steps; the largest rank among
    ties), which it leaves out. Call it on every rank with its epoch's steps;
    every rank must hold the same state keys (true after one common step)."""
    world_size = dist.get_world_size()
    key = torch.tensor([steps * world_size + dist.get_rank()], device=device)
    dist.all_reduce(key, dist.ReduceOp.MAX)  # the last rank to leave join()
    src = int(key.item()) % world_size
    for group in optimizer.param_groups:  # the same order on every rank
        for param in group["params"]:
            for _, value in sorted(optimizer.state[param].items()):
                if torch.is_tensor(value):  # momentum; Adam's moments and step
                    moved = value.to(device)  # Adam keeps its step on the CPU
                    dist.broadcast(moved, src)
                    value.copy_(moved)


def validate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, args) -> float:
    """Accuracy on the validation set; each rank scores its own slice."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * len(y) // world_size, (rank + 1) * len(y) // world_size
    device = next(model.parameters()).device
    with torch.no_grad():
        right = (model(x[lo:hi].to(device)).argmax(1) == y[lo:hi].to(device)).double()
    if args.fail == "shape":  # BUG: all_gather needs equal shapes; 50 and 51 here
        parts = [torch.empty_like(right) for _ in range(world_size)]
        dist.all_gather(parts, right)
        return torch.cat(parts).mean().item()
    counts = torch.stack([right.sum(), torch.full_like(right.sum(), hi - lo)])
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def end_epoch(model, val: tuple, loss_sum: float, steps: int, args, group) -> tuple:
    """Mean loss and validation accuracy over all ranks; rank 0's decision to stop."""
    rank, device = dist.get_rank(), next(model.parameters()).device
    if args.barrier_timeout:  # debugging: name the ranks that did not get here
        timeout = datetime.timedelta(seconds=args.barrier_timeout)
        dist.monitored_barrier(group, timeout=timeout)
    late = time.monotonic() - START > args.time_limit > 0  # rank 0's clock decides
    stop = torch.tensor([float(late)], device=device)
    if args.fail == "order" and rank == 0:  # BUG: rank 0 broadcasts first, others last
        dist.broadcast(stop, 0)
    totals = torch.tensor([loss_sum, steps], dtype=torch.float64, device=device)
    if args.fail != "rank0-only" or rank == 0:  # BUG: only rank 0, which prints
        dist.all_reduce(totals)
    accuracy = validate(model, *val, args)
    if args.fail != "order" or rank != 0:
        dist.broadcast(stop, 0)
    return (totals[0] / totals[1]).item(), accuracy, bool(stop.item())


def save_checkpoint(folder: str, step: int, model, optimizer, losses: list) -> None:
    """A DCP checkpoint: every rank writes its part, into a folder renamed when
    complete; any number of processes can load it."""
    import torch.distributed.checkpoint as dcp  # here, as it takes a second to import
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    curve = torch.tensor(losses, dtype=torch.float64)
    state = {"model": model_state, "optim": optim_state, "losses": curve}
    path, tmp = Path(folder, f"step-{step:06d}"), Path(folder, f".step-{step:06d}")
    dcp.save(state, checkpoint_id=tmp)  # returns on every rank when all have written
    if dist.get_rank() == 0:
        tmp.rename(path)


def load_checkpoint(folder: str, model, optimizer) -> tuple[int, list[float]]:
    """Load the newest checkpoint in ``folder``: return its step and losses."""
    found = sorted(Path(folder).glob("step-*")) if folder else []
    if not found:
        return 0, []
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    step = int(found[-1].name.split("-")[1])
    model_state, optim_state = get_state_dict(model, optimizer)
    curve = torch.zeros(step, dtype=torch.float64)
    state = {"model": model_state, "optim": optim_state, "losses": curve}
    dcp.load(state, checkpoint_id=found[-1])  # reshards to this run's world size
    model_state, optim_state = state["model"], state["optim"]
    set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state
    )
    return step, state["losses"].tolist()


def dump_flight_recorder(folder: str, device: torch.device) -> None:
    """Write this rank's Flight Recorder buffer: its last collectives, in order."""
    c10d = torch._C._distributed_c10d  # a private API, the same in 2.10 to 2.14
    dump = c10d._dump_nccl_trace if device.type == "cuda" else c10d._dump_fr_trace
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, f"rank_{dist.get_rank()}").write_bytes(dump())


def start_worker_server(folder: str):
    """Answer requests for this rank's stacks (``dump_traceback``) and Flight
    Recorder (``fr_trace_json``) on the Unix socket ``folder/rank<r>.sock``:
    torch's worker server, on which ``torch.distributed.debug`` builds (private;
    None in a torch without it)."""
    c10d = torch._C._distributed_c10d
    if not hasattr(c10d, "_WorkerServer"):
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return c10d._WorkerServer(str(Path(folder, f"rank{dist.get_rank()}.sock")))


def global_losses(local: torch.Tensor, history: list, start: int, step: int) -> list:
    """Every step's loss of the global batch so far: earlier runs', then this run's."""
    total = local.clone()
    dist.all_reduce(total)
    return history + (total / dist.get_world_size())[start:step].tolist()


def global_batches(seen: torch.Tensor, start: int, step: int) -> list[list[int]]:
    """The samples of each step's global batch in this run, every rank's together."""
    every = [torch.empty_like(seen) for _ in range(dist.get_world_size())]
    dist.all_gather(every, seen)
    rows = torch.cat(every, dim=1)[start:step].tolist()
    return [sorted(i for i in row if i >= 0) for row in rows]


def train(args: argparse.Namespace, device: torch.device) -> dict:
    """Train for ``--epochs``, from the newest checkpoint if any; rank 0's results."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.global_batch_size % world_size:
        fail(f"--global-batch-size must be a multiple of the {world_size} processes")
    micro = args.global_batch_size // world_size
    x, y = make_data(args.samples + VALIDATION, args.seed)
    val = (x[args.samples :], y[args.samples :])
    samples = args.samples - (args.fail == "uneven")  # one sample filtered out
    model = build_model(args.seed, device)
    wrapped = parallelize(model, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    start, history = load_checkpoint(args.checkpoint_dir, model, optimizer)
    mine = len(batches_of(epoch_order(samples, 0, args), micro))  # steps per epoch
    lengths = torch.tensor([mine, -mine], device=device)
    dist.all_reduce(lengths, dist.ReduceOp.MAX)  # the longest and the shortest
    if rank == 0:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # by torchrun
        note = f"; resumed at step {start}" if start else ""
        note += f" after restart {restart}" if restart != "0" else ""
        batch = f"{args.global_batch_size} = {world_size} x {micro}"
        print(
            f"{world_size} process(es) on {device.type}, batch {batch}{note}",
            flush=True,
        )
    gloo = device.type == "cuda" and args.barrier_timeout  # monitored_barrier: gloo
    group = dist.new_group(backend="gloo") if gloo else None
    steps = args.epochs * int(lengths[0])
    local = torch.zeros(steps, dtype=torch.float64, device=device)
    seen = torch.full((steps, micro), -1, device=device)  # each step's samples
    step, previous, skip = start, None, start % mine
    watched, busy = [], []  # --watch: recent global losses; seconds per step
    joined = args.fix in ("join", "join-state")
    for epoch in range(start // mine, args.epochs):
        order = epoch_order(samples, epoch, args)
        batches = batches_of(order, micro)
        if args.fix == "steps":  # every rank stops after the shortest shard's steps
            batches = batches[: -int(lengths[1])]
        if args.check_every:
            check_data(order, previous, samples, device)
            previous = order
        loss_sum, done = 0.0, 0
        with wrapped.join() if joined else nullcontext():
            for indices in batches[skip:]:
                began = time.perf_counter()
                if args.stall_dump:  # every thread's stack, if this step stalls
                    faulthandler.dump_traceback_later(args.stall_dump)
                xb, yb = load_batch(x, y, indices, step, args, device)
                loss = F.cross_entropy(wrapped(xb), yb)
                if args.watch:  # before the gradients' all-reduce (DDP's backward)
                    busy.append(watch(loss, began, step, watched, model))
                optimizer.zero_grad()
                loss.backward()  # DDP all-reduces the gradients here
                optimizer.step()
                local[step], seen[step] = loss.detach(), torch.tensor(indices)
                loss_sum, done, step = loss_sum + loss.item(), done + 1, step + 1
                # in join(), per-rank steps differ, and a rank that has left would
                # not come: check by the epoch's steps, before the shortest shard ends
                count = done if joined else step
                due = args.check_every and count % args.check_every == 0
                if due and not args.shard and (not joined or done < -int(lengths[1])):
                    check_replicas(model, step)
                if args.checkpoint_every and step % args.checkpoint_every == 0:
                    losses = global_losses(local, history, start, step)
                    save_checkpoint(args.checkpoint_dir, step, model, optimizer, losses)
        if args.fix == "join-state":  # join() broadcast the parameters only
            sync_optimizer_state(optimizer, len(batches) - skip, device)
        if joined and args.check_every:  # after join()'s broadcast: every rank here
            check_replicas(model, step)
        skip = 0
        if args.stall_dump:
            faulthandler.dump_traceback_later(args.stall_dump)
        mean_loss, accuracy, stop = end_epoch(model, val, loss_sum, done, args, group)
        if rank == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}: step {step}, loss {mean_loss:.4f}, "
                f"validation accuracy {accuracy:.3f}",
                flush=True,
            )
        if stop:
            break
    faulthandler.cancel_dump_traceback_later()
    by_rank = torch.zeros(world_size, device=device)
    by_rank[rank] = step - start
    dist.all_reduce(by_rank)
    seconds = [sum(s) / len(s) for s in zip(*busy)]  # per rank, mean of the steps
    if rank == 0 and busy:
        slowest = max(range(world_size), key=seconds.__getitem__)
        print(
            "time per step before the gradients' all-reduce, by rank: "
            + ", ".join(f"{1e3 * s:.1f} ms" for s in seconds)
            + f"; slowest: rank {slowest}",
            flush=True,
        )
    return {
        **where_it_ran(device),
        "start_step": start,
        "steps_by_rank": by_rank.int().tolist(),
        "validation_accuracy": accuracy,
        "losses": global_losses(local, history, start, step),
        "samples": global_batches(seen, start, step),
        "seconds_before_all_reduce": seconds,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--fail", choices=FAILURES, help="the bug to cause (default: none)")
    add("--fail-step", type=int, default=10, help="where a one-off failure strikes")
    add("--fix", choices=FIXES, help="the cure for uneven data")
    add("--epochs", type=int, default=3, help="passes over the data (default: 3)")
    add("--samples", type=int, default=256, help="training samples (default: 256)")
    add("--global-batch-size", "--batch-size", type=int, default=32, help="per step")
    add("--lr", type=float, default=0.1, help="SGD learning rate (default: 0.1)")
    add("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    add("--seed", type=int, default=0, help="seed of the data, model and sampler")
    add("--shard", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    add("--timeout", type=float, default=600, help="seconds a collective may wait")
    add("--barrier-timeout", type=float, default=0, help="seconds; 0: no barrier")
    add("--stall-dump", type=float, default=0, help="seconds a step may take; 0: off")
    add("--check-every", type=int, default=0, help="steps between checks; 0: none")
    add("--watch", action="store_true", help="compare losses and times every step")
    add("--time-limit", type=float, default=0, help="seconds; 0: none (rank 0 decides)")
    add("--checkpoint-dir", default="", help="a folder for DCP checkpoints")
    add("--checkpoint-every", type=int, default=0, help="steps; 0: never")
    add("--flight-recorder", default="", help="a folder for each rank's dump on error")
    add("--debug-socket", default="", help="a folder for each rank's worker socket")
    add("--results", default="", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    joined = args.fix in ("join", "join-state")
    if joined and (args.shard or args.checkpoint_every or args.watch):
        parser.error(
            "--fix join works with DDP and without --checkpoint-every or --watch (a "
            "rank that has left join() would never join the save or the gather)"
        )
    return args


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if hasattr(signal, "SIGUSR1"):  # kill -USR1 PID: print every thread's stack
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    sized = "TORCH_NCCL_TRACE_BUFFER_SIZE" in os.environ  # the older name, kept
    recorded = args.flight_recorder or args.debug_socket  # both read its entries
    if recorded and torch.__version__ < (2, 11) and not sized:
        # torch < 2.11 records nothing by default (2,000 since pytorch#172843)
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # before the group
    rank, _, device = setup_distributed(args.timeout)
    server = start_worker_server(args.debug_socket) if args.debug_socket else None
    try:
        results = train(args, device)
    except Exception:
        if args.flight_recorder:
            dump_flight_recorder(args.flight_recorder, device)
        raise
    finally:
        if server is not None:
            server.shutdown()
    if rank == 0 and args.results:
        Path(args.results).write_text(json.dumps(results, indent=1))
    gc.collect()  # no DDP reducer may outlive the group: it can hang destroying it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
