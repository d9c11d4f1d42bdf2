"""Data parallel three ways, checked against DDP: DTensor replication, replicate(), fully_shard.

Launch lines:
    torchrun --standalone --nproc-per-node=2 spmd_data_parallel.py
    torchrun --standalone --nproc-per-node=4 spmd_data_parallel.py --steps 3
    srun --ntasks=4 python spmd_data_parallel.py                 # under SLURM

Every rank builds the same small MLP (50-32-8, sigmoid output) from the same
seed and trains it for a few steps on its slice of the same global batches,
once per method:

- ``DDP``: ``torch.nn.parallel.DistributedDataParallel``, the reference;
- ``DTensor replicate``: parameters as ``Replicate()`` DTensors
  (``distribute_module``), the batch as a ``Shard`` DTensor; DTensor's
  propagation turns each weight gradient into a ``Partial()`` sum, which a
  hook all-reduces back to ``Replicate()`` (public API only);
- ``replicate (private)``: ``torch.distributed._composable.replicate``, DDP
  rebuilt on the composable API; the leading underscore marks it private;
- ``fully_shard``: FSDP2, ``torch.distributed.fsdp.fully_shard``: each rank
  stores one shard of every parameter and of its optimiser state;
- ``no sync (control)``: each rank trains alone on its slice, with no
  gradient communication; it must differ from DDP, or the check is blind.

It does so for each optimiser setting (SGD; SGD with momentum; the same with
``foreach``; Adam, fused where the device supports it) and for two models:
the MLP with the batch in dim 0, and the same MLP wrapped so that its input
and output carry the batch in dim 1. After training it compares every
parameter with DDP's and reports the largest absolute difference.
"""

import argparse
import json
import os
import sys
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import replicate  # private API (leading underscore)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

METHODS = ("DTensor replicate", "replicate (private)", "fully_shard", "no sync (control)")
OPTIMIZERS = {  # name: (class, keyword arguments); "fused" is added where supported
    "SGD lr=0.1": (torch.optim.SGD, {"lr": 0.1}),
    "SGD momentum=0.9": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "SGD momentum=0.9 foreach": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    "Adam lr=0.1 fused": (torch.optim.Adam, {"lr": 0.1, "fused": True}),
}


def setup_distributed() -> tuple[int, int, int, torch.device]:
    """Return ``rank, local_rank, world_size, device`` from torchrun, SLURM or defaults."""
    env = os.environ
    if "RANK" in env:
        rank, local_rank, world_size = int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
    elif "SLURM_PROCID" in env:
        rank, local_rank, world_size = (int(env[k]) for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"))
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
    else:
        rank, local_rank, world_size = 0, 0, 1
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return rank, local_rank, world_size, device


def print0(*args: object) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(*args, flush=True)


class SimpleMLP(nn.Module):
    """50 -> 32 -> 8 with ReLU and a sigmoid output; the batch is dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(50, 32)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net2(self.relu(self.net1(x))))


class BatchDim1MLP(nn.Module):
    """The same MLP for inputs shaped (features, batch): the batch is dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = SimpleMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # contiguous() also makes the output a new tensor rather than a view,
        # which fully_shard asks for (its backward hook sits on the output).
        return self.mlp(x.t().contiguous()).t().contiguous()


def make_batches(steps: int, batch_size: int, batch_dim: int, device: torch.device) -> list:
    """The same ``steps`` global (inputs, targets) batches on every rank."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        x, y = torch.randn(batch_size, 50, generator=g), torch.rand(batch_size, 8, generator=g)
        if batch_dim == 1:
            x, y = x.t().contiguous(), y.t().contiguous()
        batches.append((x.to(device), y.to(device)))
    return batches


def local_slice(t: torch.Tensor, batch_dim: int) -> torch.Tensor:
    """This rank's contiguous slice of the global batch along ``batch_dim``."""
    return t.tensor_split(dist.get_world_size(), dim=batch_dim)[dist.get_rank()].contiguous()


def make_optimizer(name: str, params, device: torch.device) -> torch.optim.Optimizer:
    """Build optimiser ``name``; fused Adam only where the device supports it."""
    cls, kwargs = OPTIMIZERS[name]
    kwargs = dict(kwargs)
    if kwargs.get("fused") and device.type not in ("cpu", "cuda"):
        kwargs.pop("fused")
    return cls(params, **kwargs)


def wrap(method: str, model: nn.Module, mesh) -> nn.Module:
    """Apply ``method``'s parallelism to ``model``; every API here changes ``model`` in place."""
    if method == "DDP":
        return DDP(model)
    if method == "replicate (private)":
        return replicate(model)
    if method == "fully_shard":
        return fully_shard(model, mesh=mesh)
    if method == "no sync (control)":
        return model
    # DTensor replicate: with no partition_fn, distribute_module replicates every parameter.
    model = distribute_module(model, mesh)
    for p in model.parameters():
        # The weight gradient of a batch-sharded product is Partial (each rank
        # holds its batch slice's term of the sum); all-reduce it to Replicate.
        p.register_hook(lambda grad: grad.redistribute(placements=[Replicate()]))
    return model


def train(method: str, model: nn.Module, opt_name: str, batches: list, batch_dim: int, mesh) -> list[float]:
    """Train ``model`` with ``method`` on ``batches``; return the per-step global losses."""
    device = batches[0][0].device
    model = wrap(method, model, mesh)
    optimizer = make_optimizer(opt_name, model.parameters(), device)
    losses = []
    for x, y in batches:
        x, y = local_slice(x, batch_dim), local_slice(y, batch_dim)
        if method == "DTensor replicate":
            # One program, global view: the batch is a DTensor sharded on its batch dim.
            x = DTensor.from_local(x, mesh, [Shard(batch_dim)])
            y = DTensor.from_local(y, mesh, [Shard(batch_dim)])
        # A mean over the batch: DDP averages the ranks' gradients, which equals
        # the gradient of the global mean only when the loss is itself a mean.
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss.detach().clone()
        if method != "DTensor replicate":  # a local mean: average it over the ranks
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter of ``model`` as a plain, full tensor (shards gathered)."""
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]


def run_case(model_name: str, opt_name: str, args, mesh, device: torch.device) -> list[dict]:
    """Train DDP and every method from the same start; compare parameters with DDP's."""
    batch_dim = 1 if model_name == "batch dim 1" else 0
    torch.manual_seed(0)
    start = (BatchDim1MLP() if batch_dim else SimpleMLP()).to(device)
    batches = make_batches(args.steps, args.batch_size, batch_dim, device)
    reference = deepcopy(start)
    train("DDP", reference, opt_name, batches, batch_dim, mesh)
    ref_params = full_parameters(reference)
    moved = max((p - q).abs().max().item() for p, q in zip(full_parameters(start), ref_params))
    print0(f"{model_name:12s} {opt_name:26s} DDP moved the parameters by up to {moved:.1e}")
    rows = []
    for method in METHODS:
        model = deepcopy(start)
        train(method, model, opt_name, batches, batch_dim, mesh)
        diff = max((p - q).abs().max().item() for p, q in zip(full_parameters(model), ref_params))
        rows.append({"model": model_name, "optimizer": opt_name, "method": method,
                     "max_abs_diff": diff, "ddp_moved": moved})  # fmt: skip
        print0(f"{model_name:12s} {opt_name:26s} {method:20s} max |param - DDP param| = {diff:.1e}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps per run (default: 5)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size (default: 128)")
    parser.add_argument("--results", default="", help="JSON file rank 0 writes (default: none)")
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    if args.steps < 1 or args.batch_size < world_size:
        print(f"Use --steps >= 1 and --batch-size >= the {world_size} processes.", file=sys.stderr)
        sys.exit(2)

    rank, _, world_size, device = setup_distributed()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    print0(f"{world_size} processes on {device.type}, {args.steps} steps, global batch {args.batch_size}")
    rows = []
    for model_name in ("batch dim 0", "batch dim 1"):
        for opt_name in OPTIMIZERS:
            rows += run_case(model_name, opt_name, args, mesh, device)
    spmd = [r["max_abs_diff"] for r in rows if r["method"] != "no sync (control)"]
    control = [r["max_abs_diff"] for r in rows if r["method"] == "no sync (control)"]
    print0(f"Largest difference from DDP over {len(spmd)} SPMD runs: {max(spmd):.1e}; "
           f"smallest of the {len(control)} no-sync controls: {min(control):.1e}")  # fmt: skip
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump({"world_size": world_size, "steps": args.steps, "batch_size": args.batch_size,
                       "dtype": str(torch.get_default_dtype()), "rows": rows}, f)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
