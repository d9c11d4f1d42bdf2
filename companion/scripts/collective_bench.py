"""Time the collectives of this machine's processes, as nccl-tests does (chapter 16).

    python collective_bench.py                          # one process: nothing to time
    torchrun --standalone --nproc-per-node=4 collective_bench.py
    torchrun --standalone --nproc-per-node=8 collective_bench.py --max-bytes 1e9
    srun --ntasks=16 --gpus-per-task=1 python collective_bench.py --groups 2 16

For every collective (all-reduce, all-gather, reduce-scatter, all-to-all, and
a send and receive between two ranks), every group size n (the first n ranks)
and every message size, the ranks time blocks of calls between barriers;
each rank keeps the median over the blocks and the slowest rank's median is
the result, since a collective ends for everyone only when it ends for the
last. Sizes are counted as nccl-tests counts them: the whole buffer of an
all-reduce, the gathered output of an all-gather, the input of a
reduce-scatter, one rank's send buffer of an all-to-all, the message of a
send. Rank 0 prints, per collective and group, the time, the algorithm
bandwidth (size / time) and the bus bandwidth: the algorithm bandwidth times
2 (n - 1) / n for an all-reduce and (n - 1) / n for the others, what each
rank's link carries in a ring, so that one number describes the link
whatever the collective. A send and receive is an exchange: each of the two
ranks sends its message and receives the other's at once. Every tensor
lives on the process's device: nccl on GPUs, gloo on CPUs. With ``--results
FILE`` rank 0 writes every measurement as JSON.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from distributed_setup import fail, setup_distributed, where_it_ran

# torch 2.14 renamed the tensor forms of these two (the old names warn there).
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth for ``kind`` on n ranks."""
    if kind == "send_recv":
        return 1.0
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work (a CPU's collectives return when done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_call(kind, nbytes, group, n, device, dtype=torch.float32):
    """Buffers for one collective of ``nbytes`` (rounded down to whole chunks) and a
    function that runs it once; returns ``(call, bytes actually counted)``."""
    item = torch.tensor([], dtype=dtype).element_size()
    chunk = max(1, nbytes // (item * (1 if kind == "send_recv" else n)))
    whole = torch.zeros(chunk * n, device=device, dtype=dtype)
    part = torch.zeros(chunk, device=device, dtype=dtype)
    peer = dist.get_global_rank(group, 1 - dist.get_rank(group) % 2)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(whole, group=group)), whole.nbytes
    if kind == "all_gather":
        return (lambda: ALL_GATHER(whole, part, group=group)), whole.nbytes
    if kind == "reduce_scatter":
        return (lambda: REDUCE_SCATTER(part, whole, group=group)), whole.nbytes
    if kind == "all_to_all":
        out = torch.zeros_like(whole)
        return (lambda: dist.all_to_all_single(out, whole, group=group)), whole.nbytes

    received = torch.zeros_like(part)

    def exchange() -> None:  # both directions at once, as nccl-tests' sendrecv
        # One batch: nccl runs a send and a receive in one group (issued one
        # after the other, both ranks' sends would wait for receives queued
        # behind them on the same stream).
        ops = [
            dist.P2POp(dist.isend, part, peer, group),
            dist.P2POp(dist.irecv, received, peer, group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return exchange, part.nbytes


def calls_per_block(calls, group, device, block_s: float) -> list[int]:
    """How many of each of ``calls`` fill ``block_s`` seconds (at least one), the
    same count on every rank; each call runs twice, the first to warm up."""
    numbers = []
    for call in calls:
        call()  # warm-up: connections, buffers
        sync(device)
        start = time.perf_counter()
        call()
        sync(device)
        once = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(once, op=dist.ReduceOp.MAX, group=group)  # same count on all
        numbers.append(max(1, int(block_s / max(once.item(), 1e-7))))
    return numbers


def time_calls(calls, group, device, block_s: float, blocks: int) -> list[float]:
    """The slowest rank's median seconds per call of each of ``calls``.

    The calls take turns, block by block (block r of every call before block
    r + 1 of any), so a machine that slows down for a while slows all of them
    alike and a fit across sizes stays fair.
    """
    numbers = calls_per_block(calls, group, device, block_s)
    per_call: list[list[float]] = [[] for _ in calls]
    for _ in range(blocks):
        for call, number, times in zip(calls, numbers, per_call):
            dist.barrier(group=group)  # start together: no rank times another's delay
            sync(device)
            start = time.perf_counter()
            for _ in range(number):
                call()
            sync(device)
            times.append((time.perf_counter() - start) / number)
    slowest = torch.tensor([statistics.median(t) for t in per_call], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.tolist()


def sweep(args, rank: int, world_size: int, device: torch.device) -> list[dict]:
    """Every collective, group size and message size of the arguments, timed.

    Within a group every (collective, size) takes its turn in each block, so
    that the collectives are compared under the same load as the sizes.
    """
    rows = []
    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(int(size))
        size *= args.step
    for n in args.groups:
        ranks = list(range(n))
        group = dist.group.WORLD if n == world_size else dist.new_group(ranks)
        # a send has one partner: it is measured in the group of 2 only
        cells = [
            (k, s)
            for k in args.collectives
            if k != "send_recv" or n == 2
            for s in sizes
        ]
        if rank in ranks:
            calls, counted = zip(*(make_call(k, s, group, n, device) for k, s in cells))
            seconds = time_calls(calls, group, device, args.block_time, args.blocks)
            for (kind, _), nbytes, t in zip(cells, counted, seconds):
                rows.append(
                    {
                        "kind": kind,
                        "processes": n,
                        "bytes": nbytes,
                        "seconds": t,
                        "algbw": nbytes / t,
                        "busbw": nbytes / t * bus_factor(kind, n),
                    }
                )
        dist.barrier()  # the ranks outside the group wait here
    return rows


def report(rows: list[dict]) -> None:
    """Print the measurements as nccl-tests does: one table per collective and group."""
    tables: dict = {}
    for row in rows:
        tables.setdefault((row["kind"], row["processes"]), []).append(row)
    for (kind, n), table in tables.items():
        print(f"{kind}, {n} processes")
        print(
            f"{'bytes':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"
        )
        for row in table:
            print(
                f"{row['bytes']:>12} {row['seconds'] * 1e6:>12.1f} "
                f"{row['algbw'] / 1e9:>13.3f} {row['busbw'] / 1e9:>13.3f}"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--collectives", nargs="+", choices=KINDS, default=list(KINDS))
    add("--groups", type=int, nargs="+", help="group sizes n (default: 2 and all)")
    add("--min-bytes", type=float, default=64, help="smallest message (default: 64)")
    add("--max-bytes", type=float, default=2**24, help="largest (default: 16 MiB)")
    add("--step", type=float, default=8, help="factor between sizes (default: 8)")
    add("--block-time", type=float, default=0.005, help="seconds per block (0.005)")
    add("--blocks", type=int, default=5, help="timed blocks per size (default: 5)")
    add("--quiet", action="store_true", help="no table: only --results")
    add("--timeout", type=float, default=600, help="seconds to wait (default: 600)")
    add("--results", default="", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes or args.step <= 1:
        parser.error("sizes need 1 <= --min-bytes <= --max-bytes and --step above 1")
    if args.blocks < 1 or args.block_time <= 0:
        parser.error("--blocks must be at least 1 and --block-time positive")
    return args


@record
def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_distributed(args.timeout)
    args.groups = sorted(set(args.groups or [2, world_size]))
    if world_size == 1:
        print("one process: no collective to time; launch 2 or more with torchrun")
        args.groups = []
    elif min(args.groups) < 2 or max(args.groups) > world_size:
        fail(f"group sizes must lie between 2 and the {world_size} processes")
    rows = sweep(args, rank, world_size, device)
    if rank == 0:
        if not args.quiet:
            report(rows)
        if args.results:
            with open(args.results, "w") as f:
                json.dump({**where_it_ran(device), "measurements": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
