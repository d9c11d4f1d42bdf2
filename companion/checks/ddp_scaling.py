"""Chapter 08's scaling measurement: ``ddp_resnet.py``'s training, then its step timed in parts.

Launched like the script, with the same arguments and ``--timing-rounds N``
(``launch("checks/ddp_scaling.py", args, nproc=2)``). It trains with the
script's own functions, then times, in turn for ``N + 1`` rounds (the first
warms up): a forward and backward pass with DDP's all-reduce switched off
(computation), an all-reduce of a buffer as large as the gradients
(communication), and a full DDP step. Each round times one of each, so a
machine that slows down slows all three alike; the medians are the slowest
rank's, since a step waits for every rank. Writes the script's results with a
``timing`` entry added. Used in chapter 08.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from companion.scripts import ddp_resnet


def time_parts(
    ddp_model: DDP, train_set: TensorDataset, micro_batch: int, rounds: int,
    device: torch.device,
) -> dict:  # fmt: skip
    """Median seconds of computation, communication and a full step (see the module)."""
    loader = DataLoader(train_set, micro_batch, sampler=DistributedSampler(train_set))
    batches = []
    while len(batches) < rounds + 1:  # cycle through a small loader
        batches += [(X.to(device), y.to(device)) for X, y in loader]
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.0)  # steps change nothing
    floats = sum(p.numel() for p in ddp_model.parameters())
    buffer = torch.zeros(floats, device=device)
    times: dict[str, list[float]] = {"compute": [], "allreduce": [], "step": []}

    def timed(name: str, fn: Callable[..., object], *args: object) -> None:
        dist.barrier()  # start together: no rank's time includes waiting for another
        if device.type == "cuda":
            torch.cuda.synchronize(
                device
            )  # GPU work is queued: wait before reading a clock
        start = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[name].append(time.perf_counter() - start)

    def compute_only(X: torch.Tensor, y: torch.Tensor) -> None:
        with ddp_model.no_sync():  # backward without DDP's all-reduce
            F.cross_entropy(ddp_model(X), y).backward()

    def full_step(X: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ddp_model(X), y).backward()
        optimizer.step()

    for X, y in batches[: rounds + 1]:
        optimizer.zero_grad(set_to_none=True)
        timed("compute", compute_only, X, y)
        timed("allreduce", dist.all_reduce, buffer)
        timed("step", full_step, X, y)
    medians = [statistics.median(v[1:]) for v in times.values()]
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    compute, allreduce, step = slowest.tolist()
    return {
        "rounds": rounds,
        "gradient_floats": floats,
        "compute_time": compute,  # forward + backward of one micro-batch, no sync
        "compute_time_per_image": compute / micro_batch,
        "allreduce_time": allreduce,  # an all-reduce of gradient_floats float32 values
        "step_time": step,  # forward, backward with the all-reduce, update
    }


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--timing-rounds", type=int, default=9)
    ours, rest = extra.parse_known_args()
    args = ddp_resnet.parse_args(rest)
    rank, _, _, device = ddp_resnet.setup_distributed(args.timeout)
    train_set, test_set, name = ddp_resnet.load_data(args.data, args.seed)
    ddp_model, results = ddp_resnet.train(args, train_set, test_set, device)
    micro_batch = results["micro_batch_size"]
    timing = time_parts(ddp_model, train_set, micro_batch, ours.timing_rounds, device)
    if rank == 0 and args.results:
        results = {**results, "data": name, "timing": timing}
        Path(args.results).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
