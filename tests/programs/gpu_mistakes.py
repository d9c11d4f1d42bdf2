"""Mistakes that only a GPU shows, each made once, for tests/test_simulated_gpu.py.

Run under ``simulated_gpu.py`` as one process that sees two GPUs: each case
runs in turn, and the error it raised (or "ok") goes into the JSON file given
as the only argument. Two of the cases are the crashes of the first real GPU
run (an H100, torch 2.11): ``ddp_resnet.py`` all-reduced its timings from a
CPU tensor, and chapter 07 subtracted CPU clones from GPU parameters; one is
``ddp_train.py``'s under ``srun --gpus-per-task=1``: DDP told ``cuda:LOCAL_RANK``
on a task that sees one GPU.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from companion.multidevice import get_params, init_lenet_params, train_batch
from companion.scripts.hello_distributed import setup_distributed

_, _, device = setup_distributed(30)


def model_and_batch(move_model: bool = True, move_batch: bool = True):
    model = nn.Linear(8, 2)
    x = torch.randn(4, 8)
    return model.to(device) if move_model else model, x.to(device) if move_batch else x


def right() -> None:
    model, x = model_and_batch()
    DDP(model, device_ids=[device])(x).sum().backward()
    total = torch.zeros(1, device=device)
    dist.all_reduce(total)
    other = torch.device("cuda", 1)  # the second GPU, used on its own, is fine too
    nn.Linear(8, 2).to(other)(x.to(other)).sum().backward()


def model_left_on_the_cpu() -> None:
    model, x = model_and_batch(move_model=False)
    model(x)


def batch_left_on_the_cpu() -> None:
    model, x = model_and_batch(move_batch=False)
    model(x)


def timings_all_reduced_from_the_cpu() -> None:
    """ddp_resnet.py's time_parts before the fix: seconds in a CPU tensor."""
    start = time.perf_counter()
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds)


def cpu_clones_minus_gpu_parameters() -> None:
    """Chapter 07's exercise before the fix: clones of the CPU start."""
    start = init_lenet_params(generator=torch.Generator().manual_seed(2))
    before = [p.clone() for p in start]
    replicas = [get_params(start, d) for d in (device, device)]
    X, y = torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))
    train_batch(X, y, replicas, [device, device], lr=0.1)
    [p - p0 for p, p0 in zip(replicas[0], before)]


def a_gpu_it_does_not_see() -> None:
    torch.zeros(2, device="cuda:2")


def two_gpus_in_one_sum() -> None:
    model, x = model_and_batch()
    model(x) + torch.ones(2, device="cuda:1")


def ddp_told_a_gpu_it_does_not_see() -> None:
    """ddp_train.py before the fix: device_ids=[local_rank], local rank 2."""
    model, _ = model_and_batch()
    DDP(model, device_ids=[2])


def ddp_told_another_gpu() -> None:
    model, _ = model_and_batch()
    DDP(model, device_ids=[1])


def load_without_map_location() -> None:
    torch.save({"w": torch.ones(2)}, "/dev/shm/gpu_mistakes.pt")
    torch.load("/dev/shm/gpu_mistakes.pt", weights_only=True)


outcomes = {}
for case in (
    right,
    model_left_on_the_cpu,
    batch_left_on_the_cpu,
    timings_all_reduced_from_the_cpu,
    cpu_clones_minus_gpu_parameters,
    a_gpu_it_does_not_see,
    two_gpus_in_one_sum,
    ddp_told_a_gpu_it_does_not_see,
    ddp_told_another_gpu,
    load_without_map_location,
):
    try:
        case()
        outcomes[case.__name__] = "ok"
    except Exception as err:  # noqa: BLE001 - the error is the result
        outcomes[case.__name__] = f"{type(err).__name__}: {err}"
outcomes["backend"] = dist.get_backend()
with open(sys.argv[1], "w") as f:
    json.dump(outcomes, f)
dist.destroy_process_group()
