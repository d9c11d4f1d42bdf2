"""DTensor basics: one matrix on a device mesh, in each placement and between them.

    python dtensor_basics.py                                           # one process
    torchrun --standalone --nproc-per-node=4 dtensor_basics.py         # four, here
    torchrun --standalone --nproc-per-node=2 dtensor_basics.py --rows 8 --cols 6
    srun --ntasks=4 python dtensor_basics.py  # SLURM, with MASTER_ADDR/PORT set

Builds a one-axis device mesh over all processes and places the matrix
0, 1, ..., rows x cols - 1 on it as Shard(0), Shard(1) and Replicate(). A
Partial() tensor arises as it does in practice: from a product A @ B whose
contracted dim is sharded (A by columns, B by rows), so that each rank holds
one term of the sum. Then it changes placements with ``redistribute``. Rank 0
prints what every rank holds after each step. Chapter 11's check,
companion/checks/dtensor_placements.py, counts what each change costs.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import json
import logging

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)

from distributed_setup import fail, setup_distributed, where_it_ran

# ---- the placements


def example_matrix(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """The rows x cols matrix 0, 1, 2, ...: the same on every rank."""
    return torch.arange(rows * cols, dtype=torch.float32, device=device).view(
        rows, cols
    )


def place(full: torch.Tensor, mesh) -> dict[str, DTensor]:
    """``full`` in each placement, and a Partial() product, by name."""
    a = distribute_tensor(full, mesh, [Shard(1)])  # A: split by columns
    ones = torch.ones(full.shape[1], full.shape[0], device=full.device)
    b = distribute_tensor(ones, mesh, [Shard(0)])  # B: split by rows
    return {
        "Shard(0)": distribute_tensor(full, mesh, [Shard(0)]),  # keeps its rows
        "Shard(1)": distribute_tensor(full, mesh, [Shard(1)]),
        "Replicate()": distribute_tensor(full, mesh, [Replicate()]),
        "Partial(): A @ B": a @ b,  # a rank's columns of A times its rows of B
    }


# Each change of placement: (the tensor from place(), the placements it gets).
CHANGES = [
    ("Shard(0)", [Replicate()]),
    ("Shard(0)", [Shard(1)]),
    ("Replicate()", [Shard(0)]),
    ("Partial(): A @ B", [Replicate()]),
    ("Partial(): A @ B", [Shard(0)]),
]


def redistribute(dtensor: DTensor, placements: list) -> DTensor:
    """The same global tensor in new placements: this is where ranks communicate."""
    return dtensor.redistribute(dtensor.device_mesh, placements)


# ---- what each rank holds


def placement_name(dtensor: DTensor) -> str:
    """``Shard(0)``, ``Replicate()`` or ``Partial()``, one per mesh axis."""
    names = []
    for p in dtensor.placements:
        if isinstance(p, Shard):
            names.append(f"Shard({p.dim})")
        else:  # a Partial's pending reduction is a sum unless told otherwise
            names.append("Partial()" if isinstance(p, Partial) else "Replicate()")
    return ", ".join(names)


def report(label: str, dtensor: DTensor) -> dict:
    """Every rank's local piece of ``dtensor``, gathered; rank 0 prints them."""
    pieces: list = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, dtensor.to_local().tolist())
    if dist.get_rank() == 0:
        print(
            f"{label}: {placement_name(dtensor)}, global shape {tuple(dtensor.shape)}"
        )
        for rank, piece in enumerate(pieces):
            values = " | ".join(" ".join(f"{v:g}" for v in row) for row in piece)
            size = f"{len(piece)}x{len(piece[0]) if piece else 0}"
            print(f"  rank {rank} holds {size}: {values}", flush=True)
    return {
        "label": label,
        "placement": placement_name(dtensor),
        "global_shape": list(dtensor.shape),
        "locals": pieces,
    }


# ---- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--rows", type=int, default=4, help="rows of the matrix (default: 4)")
    add("--cols", type=int, default=8, help="columns of the matrix (default: 8)")
    add("--timeout", type=float, default=600, help="seconds to wait for the others")
    add("--results", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.cols < 1:
        fail(f"--rows and --cols must be positive, not {args.rows} and {args.cols}.")
    return args


def quiet_gloo_fallback() -> None:
    """gloo has no all-to-all: DTensor logs, with a timestamp, that it gathers."""
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel("ERROR")


@record
def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_distributed(args.timeout)
    quiet_gloo_fallback()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("ranks",))
    full = example_matrix(args.rows, args.cols, device)
    tensors = place(full, mesh)
    layouts = [report(label, t) for label, t in tensors.items()]
    steps = []
    for source, placements in CHANGES:
        out = redistribute(tensors[source], placements)
        label = f"{placement_name(tensors[source])} -> {placement_name(out)}"
        steps.append(report(label, out))
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump(
                {
                    **where_it_ran(device),
                    "world_size": world_size,
                    "full": full.tolist(),
                    "layouts": layouts,
                    "steps": steps,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
