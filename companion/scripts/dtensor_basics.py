"""DTensor basics: placements, redistribution, and what each rank holds.

Launch lines:
    torchrun --standalone --nproc-per-node=2 dtensor_basics.py
    torchrun --standalone --nproc-per-node=4 dtensor_basics.py --rows 4 --cols 8
    srun --ntasks=4 python dtensor_basics.py                    # under SLURM

Builds a one-axis device mesh over all processes, places one small matrix on
it as ``Shard(0)``, ``Shard(1)`` and ``Replicate()``, makes a ``Partial()``
tensor the way it arises in practice (a matrix product whose contracted dim is
sharded), then redistributes between placements and counts the collectives
each change costs (with ``CommDebugMode``). Every rank's local piece is
gathered to rank 0, printed, and written to ``--results FILE`` as JSON.
"""

import argparse
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode


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


def placement_name(dtensor: DTensor) -> str:
    """``Shard(dim=0)`` -> ``Shard(0)``; one placement per mesh axis."""
    names = []
    for p in dtensor.placements:
        if isinstance(p, Shard):
            names.append(f"Shard({p.dim})")
        elif isinstance(p, Partial):
            names.append("Partial()")  # the reduction is a sum unless told otherwise
        else:
            names.append("Replicate()")
    return ", ".join(names)


def gather_locals(dtensor: DTensor) -> list[list[list[float]]]:
    """Every rank's local piece of ``dtensor``, as nested lists, on every rank."""
    local = dtensor.to_local().detach().cpu().tolist()
    pieces: list = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, local)
    return pieces


def describe(label: str, dtensor: DTensor) -> dict:
    """Record (and print on rank 0) what each rank holds of ``dtensor``."""
    pieces = gather_locals(dtensor)
    print0(f"{label}: placement {placement_name(dtensor)}, global shape {tuple(dtensor.shape)}")
    for rank, piece in enumerate(pieces):
        rows, cols = len(piece), len(piece[0]) if piece else 0
        values = " | ".join(" ".join(f"{v:g}" for v in row) for row in piece)
        print0(f"  rank {rank} holds {rows}x{cols}: {values}")
    return {
        "label": label,
        "placement": placement_name(dtensor),
        "global_shape": list(dtensor.shape),
        "locals": pieces,
    }


def redistribute(label: str, dtensor: DTensor, placements: list) -> tuple[DTensor, dict]:
    """Redistribute ``dtensor`` and record which collectives that took."""
    with CommDebugMode() as comm:
        out = dtensor.redistribute(dtensor.device_mesh, placements)
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    step = describe(label, out)
    step["from"] = placement_name(dtensor)
    step["collectives"] = counts
    print0(f"  collectives: {counts or 'none (each rank keeps its own chunk)'}")
    return out, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="rows of the example matrix (default: 4)")
    parser.add_argument("--cols", type=int, default=8, help="columns of the example matrix (default: 8)")
    parser.add_argument("--results", default="", help="JSON file rank 0 writes (default: none)")
    args = parser.parse_args()
    if args.rows < 1 or args.cols < 1:
        print("--rows and --cols must be positive.", file=sys.stderr)
        sys.exit(2)

    rank, _, world_size, device = setup_distributed()
    # On a CPU, DTensor logs (with a timestamp) that gloo has no all-to-all and
    # it falls back to all-gather + chunk; we say so once, below, instead.
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    # One mesh axis over every process; "axis" names a mesh dimension, "dim" a tensor's.
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("ranks",))
    print0(f"Mesh: {mesh}")

    # Every rank builds the same full matrix; distribute_tensor keeps only this rank's part.
    full = torch.arange(args.rows * args.cols, dtype=torch.float32, device=device).reshape(args.rows, args.cols)
    layouts = [describe(p, distribute_tensor(full, mesh, [pl]))
               for p, pl in (("Shard(0)", Shard(0)), ("Shard(1)", Shard(1)), ("Replicate()", Replicate()))]  # fmt: skip

    # Partial arises from a product whose contracted dim is sharded: each rank
    # multiplies its columns of A by its rows of B and holds one term of the sum.
    a = distribute_tensor(full, mesh, [Shard(1)])
    b = distribute_tensor(torch.ones(args.cols, args.rows, device=device), mesh, [Shard(0)])
    product = a @ b
    layouts.append(describe("Partial(): A @ B", product))

    steps = []
    row_sharded = distribute_tensor(full, mesh, [Shard(0)])
    steps.append(redistribute("Shard(0) -> Replicate()", row_sharded, [Replicate()])[1])
    steps.append(redistribute("Shard(0) -> Shard(1)", row_sharded, [Shard(1)])[1])
    if device.type == "cpu":
        print0("  (gloo has no all-to-all, so on a CPU DTensor all-gathers and keeps its chunk)")
    replicated = distribute_tensor(full, mesh, [Replicate()])
    steps.append(redistribute("Replicate() -> Shard(0)", replicated, [Shard(0)])[1])
    steps.append(redistribute("Partial() -> Replicate()", product, [Replicate()])[1])
    steps.append(redistribute("Partial() -> Shard(0)", product, [Shard(0)])[1])

    # The check every chapter relies on: the distributed value equals the full one.
    assert torch.equal(product.full_tensor(), full @ torch.ones(args.cols, args.rows, device=device))
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump({"world_size": world_size, "full": full.tolist(), "layouts": layouts, "steps": steps}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
