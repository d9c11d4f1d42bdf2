"""Chapter 08's scaling measurement: ``ddp_resnet.py``'s training, then its step timed in parts.

Launched like the script, with the same arguments and ``--timing-rounds N``
(``launch("checks/ddp_scaling.py", args, nproc=2)``). It trains with the
script's own functions, then times, in turn for ``N + 1`` rounds (the first
warms up): a forward and backward pass with DDP's all-reduce switched off
(computation), an all-reduce of a buffer as large as the gradients
(communication), and a full DDP step. Each round times one of each, so a
machine that slows down slows all three alike; each round's time is the
slowest rank's, since a step waits for every rank. With
``--also-global-batch-size M`` it times the same parts a second time at a
global batch of ``M`` images, in the same run (no second launch). Writes the
script's results with ``timing`` (and ``also_timing``) and ``ddp_buckets``
(DDP's gradient buckets after its first steps) added. Used in chapter 08.
"""

from __future__ import annotations

import argparse
import gc
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
    ddp_model: DDP,
    train_set: TensorDataset,
    micro_batch: int,
    rounds: int,
    device: torch.device,
) -> dict:
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
    # Each round's time is the slowest rank's; the warm-up round is dropped.
    slowest = torch.tensor(list(times.values()), dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    samples = {name: row[1:] for name, row in zip(times, slowest.tolist())}
    compute, allreduce, step = (statistics.median(v) for v in samples.values())
    return {
        "rounds": rounds,
        "global_batch_size": micro_batch * dist.get_world_size(),
        "gradient_floats": floats,
        "compute_time": compute,  # forward + backward of one micro-batch, no sync
        "compute_time_per_image": compute / micro_batch,
        "allreduce_time": allreduce,  # an all-reduce of gradient_floats float32 values
        "step_time": step,  # forward, backward with the all-reduce, update
        "samples": samples,  # seconds per round, for noise bands
    }


def describe_buckets(ddp_model: DDP) -> dict:
    """DDP's gradient buckets after its first steps, from its (private) logging data."""
    data = ddp_model._get_ddp_logging_data()
    sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
    return {
        "bucket_bytes": [int(b) for b in sizes.replace(",", " ").split()],
        "gradient_bytes": sum(
            p.numel() * p.element_size() for p in ddp_model.parameters()
        ),
        "first_bucket_cap_bytes": dist._DEFAULT_FIRST_BUCKET_BYTES,  # 1 MiB
    }


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--timing-rounds", type=int, default=9)
    extra.add_argument(
        "--also-global-batch-size", type=int, default=0
    )  # images; 0: time the training's global batch only
    ours, rest = extra.parse_known_args()
    args = ddp_resnet.parse_args(rest)
    rank, world_size, device = ddp_resnet.setup_distributed(args.timeout)
    if ours.also_global_batch_size % world_size:
        raise SystemExit(
            f"--also-global-batch-size {ours.also_global_batch_size} is not "
            f"divisible by the {world_size} processes."
        )
    train_set, test_set, name = ddp_resnet.load_data(args.data, args.seed)
    ddp_model, results = ddp_resnet.train(args, train_set, test_set, device)
    micro_batch = results["micro_batch_size"]
    timing = time_parts(ddp_model, train_set, micro_batch, ours.timing_rounds, device)
    extra_timing = {}
    if ours.also_global_batch_size:
        also_micro = ours.also_global_batch_size // world_size
        also = time_parts(ddp_model, train_set, also_micro, ours.timing_rounds, device)
        extra_timing = {"also_timing": also}
    if rank == 0 and args.results:
        buckets = describe_buckets(ddp_model)
        results = {**results, "data": name, "timing": timing, **extra_timing}
        results["ddp_buckets"] = buckets
        Path(args.results).write_text(json.dumps(results, indent=1))
    del ddp_model
    gc.collect()  # no DDP reducer may outlive the group: it can hang destroying it
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
