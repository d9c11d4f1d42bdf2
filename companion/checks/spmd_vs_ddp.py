"""Check spmd_data_parallel.py: every method ends where DDP ends; a control does not.

    torchrun --standalone --nproc-per-node=4 companion/checks/spmd_vs_ddp.py

For each model (the batch in dim 0, or in dim 1) and each of the script's
optimisers, every rank builds the script's MLP and batches and trains a copy
of the same start with each method, using the script's own ``parallelize``
and ``train``: DDP first, as the reference, then DTensor replication,
``replicate()`` and ``fully_shard``, and a control that trains each rank
alone on its slice, with no gradient communication (it must end far from
DDP, or the comparison could not fail). All in float64: the claim is that
the methods compute the same thing, and float64 shows that apart from the
order of the sums, where float32's rounding after a few Adam steps depends on
the device (a GPU's kernels and nccl's summation order differ from a CPU's).
Rank 0 writes, per run, the largest difference of any parameter from DDP's,
and how far DDP moved the parameters, as JSON (``--results``). Used in
chapter 11.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from companion.scripts import spmd_data_parallel as sp

METHODS = {  # the script's --method: the name in the chapter's table
    "dtensor": "DTensor replicate",
    "replicate": "replicate (private)",
    "fully_shard": "fully_shard",
}
CONTROL = "no sync (control)"
OPTIMIZERS = {  # the script's --optimizer: the name in the chapter's table
    "sgd": "SGD lr=0.1",
    "momentum": "SGD momentum=0.9",
    "momentum-foreach": "SGD momentum=0.9 foreach",
    "adam": "Adam lr=0.1 fused",
}
TOLERANCE = 1e-10  # float64 after 3 to 5 steps; measured up to about 1e-15


def trained(method: str, start, args: argparse.Namespace, batches, mesh) -> list:
    """A copy of ``start`` trained with ``method``, as the script trains it."""
    model = copy.deepcopy(start)
    if method != "control":  # the control: each rank alone, no communication
        model = sp.parallelize(method, model, mesh)
    optimizer = sp.build_optimizer(args.optimizer, model.parameters())
    dtensor_mesh = mesh if method == "dtensor" else None
    sp.train(model, optimizer, batches, args.batch_dim, dtensor_mesh)
    return sp.full_parameters(model)


def largest_difference(params: list, reference: list) -> float:
    return max((p - q).abs().max().item() for p, q in zip(params, reference))


def compare(args: argparse.Namespace, device: torch.device, mesh) -> list[dict]:
    """Every method and the control against DDP, for one model and optimiser."""
    start = sp.build_model(args.batch_dim, args.dtype, device)
    batches = sp.global_batches(args, device)
    ddp = trained("ddp", start, args, batches, mesh)
    model, optimizer = f"batch dim {args.batch_dim}", OPTIMIZERS[args.optimizer]
    moved = largest_difference(sp.full_parameters(start), ddp)
    say = print if dist.get_rank() == 0 else lambda *_: None
    say(f"{model:12s} {optimizer:24s} DDP moved the parameters by up to {moved:.1e}")
    rows = []
    for method, name in [*METHODS.items(), ("control", CONTROL)]:
        diff = largest_difference(trained(method, start, args, batches, mesh), ddp)
        say(f"{model:12s} {optimizer:24s} {name:19s} max diff vs DDP = {diff:.1e}")
        rows.append(
            {
                "model": model,
                "optimizer": optimizer,
                "method": name,
                "max_abs_diff": diff,
                "ddp_moved": moved,
            }
        )
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--steps", type=int, default=3, help="training steps per run")
    add("--batch-size", type=int, default=128, help="global batch")
    add("--timeout", type=float, default=300, help="seconds to wait for other ranks")
    add("--results", help="a JSON file for rank 0's results")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    rank, world_size, device = sp.setup_distributed(args.timeout)
    mesh = sp.init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    rows = []
    for batch_dim in (0, 1):
        for optimizer in OPTIMIZERS:
            run = sp.parse_args(
                [
                    "--optimizer",
                    optimizer,
                    "--batch-dim",
                    str(batch_dim),
                    "--dtype",
                    "float64",
                    "--steps",
                    str(args.steps),
                    "--batch-size",
                    str(args.batch_size),
                ]
            )
            rows += compare(run, device, mesh)
    spmd = [r["max_abs_diff"] for r in rows if r["method"] != CONTROL]
    control = [r["max_abs_diff"] for r in rows if r["method"] == CONTROL]
    if rank == 0:
        print(
            f"Largest difference from DDP over {len(spmd)} SPMD runs: {max(spmd):.1e}; "
            f"smallest of the {len(control)} no-sync controls: {min(control):.1e}"
        )
        if args.results:
            with open(args.results, "w") as f:
                json.dump(
                    {
                        **sp.where_it_ran(device),
                        "world_size": world_size,
                        "steps": args.steps,
                        "batch_size": args.batch_size,
                        "dtype": "float64",
                        "tolerance": TOLERANCE,
                        "rows": rows,
                    },
                    f,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
