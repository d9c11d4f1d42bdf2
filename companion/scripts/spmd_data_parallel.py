"""Data parallel four ways: DDP, DTensor replication, replicate() and fully_shard.

    python spmd_data_parallel.py                                       # one process
    torchrun --standalone --nproc-per-node=4 spmd_data_parallel.py --method fully_shard
    torchrun --standalone --nproc-per-node=2 spmd_data_parallel.py --method dtensor \\
        --batch-dim 1 --optimizer adam
    srun --ntasks=4 --gpus-per-task=1 python spmd_data_parallel.py --method replicate

Every rank builds the same small MLP (50-32-8, sigmoid output) from the same
seed and trains it on its slice of the same global batches, data parallel in
one of four ways (``--method``):

- ``ddp``: ``DistributedDataParallel``;
- ``dtensor``: the parameters as ``Replicate()`` DTensors
  (``distribute_module``) and the batch as a ``Shard`` DTensor. A weight's
  gradient then comes out ``Partial()`` (each rank holds its slice's term of
  the sum), and a hook all-reduces it to ``Replicate()``;
- ``replicate``: ``torch.distributed._composable.replicate``, DDP on the
  composable API; the leading underscore marks it private;
- ``fully_shard``: FSDP2; each rank stores one shard of every parameter and
  of the optimiser's state.

``--batch-dim 1`` wraps the MLP so that its input and output carry the batch
in dim 1. companion/checks/spmd_vs_ddp.py trains every method with every
optimiser from the same start and compares their parameters with DDP's.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import gc
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import replicate  # private: may change
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    init_device_mesh,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed_setup import fail, launched, setup_distributed, where_it_ran

# ---- the model and the data


class MLP(nn.Module):
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
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # contiguous() also makes the output a new tensor rather than a view,
        # which fully_shard asks for (its backward hook sits on the output).
        return self.mlp(x.t().contiguous()).t().contiguous()


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build_model(batch_dim: int, dtype: str, device: torch.device) -> nn.Module:
    """The same MLP on every rank: initialised from seed 0, then cast."""
    torch.manual_seed(0)
    model = BatchDim1MLP() if batch_dim else MLP()
    return model.to(device=device, dtype=DTYPES[dtype])


def global_batches(args: argparse.Namespace, device: torch.device) -> list:
    """``args.steps`` global (input, target) batches, the same on every rank."""
    g, batches = torch.Generator().manual_seed(1), []
    for _ in range(args.steps):
        x = torch.randn(args.batch_size, 50, generator=g, dtype=DTYPES[args.dtype])
        y = torch.rand(args.batch_size, 8, generator=g, dtype=DTYPES[args.dtype])
        if args.batch_dim == 1:
            x, y = x.t().contiguous(), y.t().contiguous()
        batches.append((x.to(device), y.to(device)))
    return batches


def local_slice(t: torch.Tensor, batch_dim: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch along ``batch_dim``."""
    parts = t.tensor_split(dist.get_world_size(), dim=batch_dim)
    return parts[dist.get_rank()].contiguous()


OPTIMIZERS = {  # name: (class, keyword arguments)
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "momentum-foreach": (
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "foreach": True},
    ),
    "adam": (torch.optim.Adam, {"lr": 0.1, "fused": True}),  # fused: CPU or CUDA
}


def build_optimizer(name: str, params) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[name]
    return cls(params, **kwargs)


# ---- parallelise: four ways to the same data parallelism


def parallelize(method: str, model: nn.Module, mesh) -> nn.Module:
    """Make ``model`` data parallel over ``mesh``; these APIs work in place."""
    if method == "ddp":
        return DDP(model)
    if method == "replicate":
        return replicate(model)
    if method == "fully_shard":
        # One FSDP unit per layer, then the root for what is left: each layer's
        # parameters are all-gathered just before it runs and freed after.
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    # DTensor replication: without a partition_fn, every parameter is replicated.
    model = distribute_module(model, mesh)
    for p in model.parameters():
        # The weight gradient of a batch-sharded product is Partial (each rank
        # holds its batch slice's term of the sum); all-reduce it to Replicate.
        p.register_hook(lambda grad: grad.redistribute(placements=[Replicate()]))
    return model


# ---- train


def global_loss(loss: torch.Tensor) -> float:
    """The loss of the whole global batch, on every rank."""
    if isinstance(loss, DTensor):  # already the global mean: gather its value
        return loss.full_tensor().item()
    loss = loss.detach().clone()  # a local mean; the slices are equal in size
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()  # .item(): waits for the device


def train(model: nn.Module, optimizer, batches: list, batch_dim: int, mesh=None):
    """Train on this rank's slice of each global batch; return the global losses.

    With ``mesh`` (DTensor replication) the slices form one batch-sharded
    DTensor: one program with a global view of the batch.
    """
    losses = []
    for x, y in batches:
        x, y = local_slice(x, batch_dim), local_slice(y, batch_dim)
        if mesh is not None:
            x = DTensor.from_local(x, mesh, [Shard(batch_dim)])
            y = DTensor.from_local(y, mesh, [Shard(batch_dim)])
        # A mean over the batch: DDP averages the ranks' gradients, which is the
        # gradient of the global batch's loss only when that loss is a mean.
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(global_loss(loss))
    return losses


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter of ``model`` as a plain, whole tensor (shards gathered)."""
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for p in model.parameters()
    ]


# ---- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    methods = ("ddp", "dtensor", "replicate", "fully_shard")
    add("--method", choices=methods, default="ddp", help="(default: ddp)")
    add("--optimizer", choices=OPTIMIZERS, default="sgd", help="(default: sgd)")
    add("--batch-dim", type=int, choices=(0, 1), default=0, help="(default: 0)")
    add("--steps", type=int, default=5, help="training steps (default: 5)")
    add("--batch-size", type=int, default=128, help="global batch (default: 128)")
    add("--dtype", choices=DTYPES, default="float32", help="(default: float32)")
    add("--timeout", type=float, default=600, help="seconds to wait for the others")
    add("--results", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    world_size = launched().world_size
    if args.steps < 1:
        fail(f"--steps must be at least 1, not {args.steps}.")
    if args.batch_size < 1 or args.batch_size % world_size:
        # Unequal slices: the mean of the ranks' means is not the global mean.
        fail(
            f"--batch-size {args.batch_size} does not split evenly over {world_size} "
            f"processes; use a multiple of {world_size}."
        )
    return args


@record
def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_distributed(args.timeout)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    model = parallelize(
        args.method, build_model(args.batch_dim, args.dtype, device), mesh
    )
    optimizer = build_optimizer(args.optimizer, model.parameters())
    batches = global_batches(args, device)
    losses = train(
        model,
        optimizer,
        batches,
        args.batch_dim,
        mesh if args.method == "dtensor" else None,
    )
    if rank == 0:
        for step, loss in enumerate(losses):
            print(f"step {step}  loss {loss:.6f}", flush=True)
        if args.results:
            with open(args.results, "w") as f:
                json.dump({**where_it_ran(device), "losses": losses}, f)
    del model, optimizer
    gc.collect()  # no DDP reducer may outlive the group: it can hang destroying it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
