"""Data parallel three ways, checked against DDP: DTensor replication, replicate(), fully_shard.

Launch lines:
    torchrun --standalone --nproc-per-node=2 spmd_data_parallel.py
    torchrun --standalone --nproc-per-node=4 spmd_data_parallel.py --steps 3
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=spmd spmd_data_parallel.py                     # on each of 2 nodes
    srun --ntasks=4 --gpus-per-task=1 python spmd_data_parallel.py   # under SLURM

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
parameter with DDP's and reports the largest absolute difference. All
processes decide together: nccl with one GPU each when every process has a
GPU of its own, gloo on the CPUs otherwise.

Writes: one line per run on rank 0; with ``--results FILE``, a JSON list of
every (model, optimiser, method) run and its difference from DDP.

Exit codes: 0 every method within ``--tolerance`` of DDP and every no-sync
control beyond it; 3 a method missed its tolerance or a control came too
close (the check is blind), said in one sentence by rank 0; 2 bad input
(e.g. a batch that does not split evenly), said in one sentence by rank 0;
1 anything unexpected (a traceback). Needs PyTorch 2.6 or newer.
"""

import argparse
import collections
import datetime
import json
import os
import re
import socket
import sys
import time
from copy import deepcopy
from pathlib import Path

import torch

SCRIPT = Path(__file__).name
MIN_TORCH = (2, 6)  # fully_shard in torch.distributed.fsdp


class UsageError(Exception):
    """Bad input: the message is one sentence saying what is wrong and what to do."""


class RendezvousError(UsageError):
    """The processes could not meet: only the process that saw it can say so."""


def env_rank(local: bool = False) -> int:
    """This process's (local) rank as its launcher set it; 0 without a launcher."""
    names = ("LOCAL_RANK", "SLURM_LOCALID") if local else ("RANK", "SLURM_PROCID")
    return int(os.environ.get(names[0], os.environ.get(names[1], "0")))


def fail(message: str, code: int = 2, printer: bool | None = None) -> None:
    """Print ``SCRIPT: error: message`` (on rank 0 unless told otherwise) and exit with ``code``."""
    if env_rank() == 0 if printer is None else printer:
        print(f"{SCRIPT}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


if tuple(int(n) for n in re.findall(r"\d+", torch.__version__)[:2]) < MIN_TORCH:
    fail(
        f"this script needs PyTorch {'.'.join(map(str, MIN_TORCH))} or newer, not "
        f"{torch.__version__}; "
        "upgrade it with pip install --upgrade torch."
    )

import torch.distributed as dist  # noqa: E402 (after the version check, which names what is missing)
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

try:
    from torch.distributed._composable import (
        replicate,
    )  # private API (leading underscore)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        init_device_mesh,
    )
except ImportError as err:  # a newer torch may drop the private replicate()
    fail(
        "this script needs torch.distributed.fsdp.fully_shard, "
        "torch.distributed.tensor and the private "
        "torch.distributed._composable.replicate, which this PyTorch "
        f"{torch.__version__} lacks ({err}); "
        "use PyTorch 2.6 to 2.14."
    )


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """Print one line on rank 0, not the usage block (``--help`` shows that), and exit with code 2."""
        fail(message)


# ---------------------------------------------------------------- processes


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_host(nodelist: str) -> str:
    """Return the first host of a SLURM node list: ``gpu[07-08,10],cpu1`` -> ``gpu07``; "" if there is none."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first)


def read_topology() -> tuple[int, int, int]:
    """Return ``rank, local_rank, world_size``; set MASTER_ADDR and MASTER_PORT if unset.

    From torchrun (RANK, LOCAL_RANK, WORLD_SIZE), else from srun (SLURM_PROCID,
    SLURM_LOCALID, SLURM_NTASKS; rank 0 runs on the first node of the step,
    which hosts the rendezvous, on a port derived from the job id), else one process.
    """
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env:
        if "MASTER_ADDR" not in env:
            nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
            host = (
                "127.0.0.1"
                if nodes == 1
                else first_host(
                    env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))
                )
            )
            if not host:
                raise UsageError(
                    "under SLURM on several nodes the processes meet on the first "
                    "node, but neither "
                    "MASTER_ADDR nor a node list (SLURM_JOB_NODELIST) names it; set "
                    "MASTER_ADDR."
                )
            env["MASTER_ADDR"] = host
        env.setdefault(
            "MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        )
        return (
            int(env["SLURM_PROCID"]),
            int(env["SLURM_LOCALID"]),
            int(env["SLURM_NTASKS"]),
        )
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))  # alone: any free port will do
    return 0, 0, 1


def describe_process(local_rank: int) -> dict:
    """This process's host and the GPU it would use: ``cuda:(local_rank % GPUs it sees)``.

    Under ``srun --gpus-per-task=1`` each process sees one GPU, its own, as
    ``cuda:0``; under torchrun every process of a node sees all of its GPUs.
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = None
    if count:
        index = local_rank % count
        gpu = {
            "index": index,
            "uuid": str(
                getattr(torch.cuda.get_device_properties(index), "uuid", index)
            ),
        }
    return {"host": socket.gethostname(), "gpu": gpu}


def gpu_problem(everyone: list[dict]) -> str:
    """Why the processes in ``everyone`` cannot each have a GPU of their own ("" if they can)."""
    without = [i for i, p in enumerate(everyone) if p["gpu"] is None]
    shared = collections.Counter(
        (p["host"], p["gpu"]["uuid"]) for p in everyone if p["gpu"]
    )
    if len(without) == len(everyone):
        return "no process sees a GPU"
    if without:
        return f"{len(without)} of the {len(everyone)} processes see no GPU (rank {without[0]})"
    if max(shared.values()) > 1:
        host = next(h for (h, _), n in shared.items() if n > 1)
        users = sum(n for (h, _), n in shared.items() if h == host)
        return f"{host} has {sum(h == host for h, _ in shared)} GPU(s) for {users} processes"
    return "" if dist.is_nccl_available() else "this PyTorch was built without nccl"


def meet(rank: int, world_size: int, timeout: float) -> tuple[dist.Store, list[dict]]:
    """Reach the rendezvous at MASTER_ADDR:MASTER_PORT; return its store and every process's report."""
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store, _, _ = next(
            dist.rendezvous(
                "env://",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        )
    except dist.DistError as err:
        if "EADDRINUSE" in str(err) or "already in use" in str(err):
            raise RendezvousError(
                f"port {where} is already in use; set MASTER_PORT to a free port."
            ) from None
        if "waiting for clients" in str(err):
            joined = re.search(r"(\d+)/(\d+) clients", str(err))
            count = (
                f"only {joined[1]} of {joined[2]} processes"
                if joined
                else "not every process"
            )
            raise RendezvousError(
                f"{count} reached the rendezvous at {where} within {timeout:g} s; "
                "start all "
                "of them, and check that every node can reach that address."
            ) from None
        raise RendezvousError(
            f"cannot reach the rendezvous at {where} within {timeout:g} s; check "
            "MASTER_ADDR "
            "and MASTER_PORT, and that rank 0 is running."
        ) from None
    # Every process reports its host and GPU; all read all reports, so all decide alike.
    key = f"{SCRIPT}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{key}{rank}", json.dumps(describe_process(env_rank(local=True))))
    everyone = [json.loads(store.get(f"{key}{r}")) for r in range(world_size)]
    store.add(f"{key}read", 1)
    deadline = time.monotonic() + timeout
    while (
        rank == 0
        and store.add(f"{key}read", 0) < world_size
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)  # rank 0 may host the store: it stays until everyone has read
    return store, everyone


def setup_distributed(timeout: float = 600.0) -> tuple[int, int, int, torch.device]:
    """Join the process group and return ``rank, local_rank, world_size, device``.

    Every process reports its GPU at the rendezvous and all take the same
    decision: nccl and a GPU each when every process has a GPU of its own,
    else gloo on the CPU for all (a mix of the two would hang).
    """
    rank, local_rank, world_size = read_topology()
    store, everyone = meet(rank, world_size, timeout)
    problem = gpu_problem(everyone)
    if problem:
        device, backend = torch.device("cpu"), "gloo"
        if any(p["gpu"] for p in everyone) and rank == 0:
            print(
                f"{SCRIPT}: note: {problem}, so every process runs on the CPU with "
                "gloo.",
                flush=True,
            )
    else:
        device, backend = (
            torch.device("cuda", local_rank % torch.cuda.device_count()),
            "nccl",
        )
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
        device_id=device if device.type == "cuda" else None,
    )
    return rank, local_rank, world_size, device


def run_main(main) -> None:
    """Call ``main()``; a UsageError ends every process with exit code 2 and one sentence."""
    try:
        main()
    except UsageError as err:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Errors the processes agree on are said by rank 0; one that stopped them
        # from meeting, by the first process of each node that saw it.
        fail(str(err), printer=env_rank(local=isinstance(err, RendezvousError)) == 0)


METHODS = (
    "DTensor replicate",
    "replicate (private)",
    "fully_shard",
    "no sync (control)",
)
OPTIMIZERS = {  # name: (class, keyword arguments); "fused" is added where supported
    "SGD lr=0.1": (torch.optim.SGD, {"lr": 0.1}),
    "SGD momentum=0.9": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "SGD momentum=0.9 foreach": (
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "foreach": True},
    ),
    "Adam lr=0.1 fused": (torch.optim.Adam, {"lr": 0.1, "fused": True}),
}


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


def make_batches(
    steps: int, batch_size: int, batch_dim: int, device: torch.device
) -> list:
    """The same ``steps`` global (inputs, targets) batches on every rank."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        x, y = (
            torch.randn(batch_size, 50, generator=g),
            torch.rand(batch_size, 8, generator=g),
        )
        if batch_dim == 1:
            x, y = x.t().contiguous(), y.t().contiguous()
        batches.append((x.to(device), y.to(device)))
    return batches


def local_slice(t: torch.Tensor, batch_dim: int) -> torch.Tensor:
    """This rank's contiguous slice of the global batch along ``batch_dim``."""
    return t.tensor_split(dist.get_world_size(), dim=batch_dim)[
        dist.get_rank()
    ].contiguous()


def make_optimizer(name: str, params, device: torch.device) -> torch.optim.Optimizer:
    """Build optimiser ``name``; fused Adam only where the device supports it."""
    cls, kwargs = OPTIMIZERS[name]
    kwargs = dict(kwargs)
    if kwargs.get("fused") and device.type not in ("cpu", "cuda"):
        kwargs.pop("fused")
    return cls(params, **kwargs)


def wrap(method: str, model: nn.Module, mesh) -> nn.Module:
    """Apply ``method``'s parallelism to ``model``; all these APIs work in place."""
    if method == "DDP":
        return DDP(model)
    if method == "replicate (private)":
        return replicate(model)
    if method == "fully_shard":
        # One FSDP unit per layer, then the root for what is left: each layer's
        # parameters are all-gathered just before it runs and freed after.
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if method == "no sync (control)":
        return model
    # DTensor replicate: with no partition_fn, distribute_module replicates every
    # parameter.
    model = distribute_module(model, mesh)
    for p in model.parameters():
        # The weight gradient of a batch-sharded product is Partial (each rank
        # holds its batch slice's term of the sum); all-reduce it to Replicate.
        p.register_hook(lambda grad: grad.redistribute(placements=[Replicate()]))
    return model


def train(
    method: str, model: nn.Module, opt_name: str, batches: list, batch_dim: int, mesh
) -> list[float]:
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
        loss = (
            loss.full_tensor() if isinstance(loss, DTensor) else loss.detach().clone()
        )
        if method != "DTensor replicate":  # a local mean: average it over the ranks
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter of ``model`` as a plain, full tensor (shards gathered)."""
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for p in model.parameters()
    ]


def run_case(
    model_name: str, opt_name: str, args, mesh, device: torch.device
) -> list[dict]:
    """Train DDP and every method from the same start; compare parameters with DDP's."""
    batch_dim = 1 if model_name == "batch dim 1" else 0
    torch.manual_seed(0)
    start = (BatchDim1MLP() if batch_dim else SimpleMLP()).to(device)
    batches = make_batches(args.steps, args.batch_size, batch_dim, device)
    reference = deepcopy(start)
    train("DDP", reference, opt_name, batches, batch_dim, mesh)
    ref_params = full_parameters(reference)
    moved = max(
        (p - q).abs().max().item() for p, q in zip(full_parameters(start), ref_params)
    )
    print0(
        f"{model_name:12s} {opt_name:26s} DDP moved the parameters by up to {moved:.1e}"
    )
    rows = []
    for method in METHODS:
        model = deepcopy(start)
        train(method, model, opt_name, batches, batch_dim, mesh)
        diff = max(
            (p - q).abs().max().item()
            for p, q in zip(full_parameters(model), ref_params)
        )
        rows.append(
            {
                "model": model_name,
                "optimizer": opt_name,
                "method": method,
                "max_abs_diff": diff,
                "ddp_moved": moved,
            }
        )
        print0(
            f"{model_name:12s} {opt_name:24s} {method:19s} max diff vs DDP = {diff:.1e}"
        )
    return rows


def main() -> None:
    parser = ArgumentParser(
        prog=SCRIPT,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="training steps per run (default: 5)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="global batch size, a multiple of the number of processes (default: 128)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="largest parameter difference from DDP that counts as equal (default: 1e-5, float32)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the processes wait for each other (default: 600, PyTorch's own)",
    )
    parser.add_argument(
        "--results", default="", help="JSON file rank 0 writes (default: none)"
    )
    args = parser.parse_args()
    world_size = read_topology()[2]
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, not {args.steps}.")
    if args.batch_size < 1 or args.batch_size % world_size:
        # An uneven split gives the ranks batches of different sizes: DDP's mean of
        # their means is then not the global mean, and no method could match it.
        parser.error(
            f"--batch-size {args.batch_size} does not split evenly over {world_size} "
            "processes; "
            f"use a multiple of {world_size}."
        )
    if args.tolerance <= 0 or args.timeout <= 0:
        parser.error("--tolerance and --timeout must be positive.")

    rank, _, world_size, device = setup_distributed(args.timeout)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    print0(
        f"{world_size} processes on {device.type}, {args.steps} steps, global batch "
        f"{args.batch_size}"
    )
    rows = []
    for model_name in ("batch dim 0", "batch dim 1"):
        for opt_name in OPTIMIZERS:
            rows += run_case(model_name, opt_name, args, mesh, device)
    spmd = [r["max_abs_diff"] for r in rows if r["method"] != "no sync (control)"]
    control = [r["max_abs_diff"] for r in rows if r["method"] == "no sync (control)"]
    print0(
        f"Largest difference from DDP over {len(spmd)} SPMD runs: {max(spmd):.1e}; "
        f"smallest of the {len(control)} no-sync controls: {min(control):.1e}"
    )
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump(
                {
                    "world_size": world_size,
                    "steps": args.steps,
                    "batch_size": args.batch_size,
                    "dtype": str(torch.get_default_dtype()),
                    "tolerance": args.tolerance,
                    "rows": rows,
                },
                f,
            )
    dist.destroy_process_group()
    if max(spmd) > args.tolerance or min(control) <= args.tolerance:
        worst = max(
            rows,
            key=lambda r: (
                r["max_abs_diff"] if r["method"] != "no sync (control)" else -1.0
            ),
        )
        fail(
            f"{worst['method']} ({worst['model']}, {worst['optimizer']}) ended "
            f"{worst['max_abs_diff']:.1e} from "
            f"DDP, beyond --tolerance {args.tolerance:g}"
            if max(spmd) > args.tolerance
            else f"a no-sync control ended only {min(control):.1e} from DDP, within --tolerance {args.tolerance:g}, "
            "so the comparison cannot tell synced from unsynced training; train longer "
            "(--steps)",
            code=3,
        )


if __name__ == "__main__":
    run_main(main)
