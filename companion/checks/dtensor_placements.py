"""Check dtensor_basics.py: what each rank holds, and what changing placement costs.

    torchrun --standalone --nproc-per-node=4 companion/checks/dtensor_placements.py

Runs the script's own steps (``place``, then each of its ``CHANGES`` with
``redistribute``) and counts the collectives of each change with
``companion.collectives.CollectiveCounter``: their kinds, calls and the bytes
a rank hands in and gets back. It also checks the value that every
placement must keep: the Partial() product, summed, is the product of the
full matrices. Rank 0 writes the results as JSON (``--results``); chapter 11
draws the pieces (``companion.dtensor_plots``) and tabulates the costs.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from companion.collectives import CollectiveCounter
from companion.scripts import dtensor_basics as db


def change(source: db.DTensor, placements: list) -> dict:
    """Redistribute ``source`` as the script does; what rank 0 holds, and the cost."""
    with CollectiveCounter() as counter:
        out = db.redistribute(source, placements)
    label = f"{db.placement_name(source)} -> {db.placement_name(out)}"
    step = {**db.report(label, out), "collectives": counter.total()}
    if dist.get_rank() == 0:
        costs = [f"{k} x{c['calls']}" for k, c in step["collectives"].items()]
        print(f"  collectives: {', '.join(costs) or 'none'}", flush=True)
    return step


@record
def main() -> None:
    args = db.parse_args()
    rank, world_size, device = db.setup_distributed(args.timeout)
    db.quiet_gloo_fallback()
    mesh = db.init_device_mesh(device.type, (world_size,), mesh_dim_names=("ranks",))
    full = db.example_matrix(args.rows, args.cols, device)
    tensors = db.place(full, mesh)
    layouts = [db.report(label, t) for label, t in tensors.items()]
    steps = [change(tensors[source], target) for source, target in db.CHANGES]
    product = tensors["Partial(): A @ B"].full_tensor()  # sums the ranks' terms
    expected = full @ torch.ones(args.cols, args.rows, device=device)
    results = {
        **db.where_it_ran(device),
        "world_size": world_size,
        "full": full.tolist(),
        "layouts": layouts,
        "steps": steps,
        "partial_sums_to_product": torch.equal(product, expected),
    }
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
