"""The smallest useful distributed program: every rank adds rank + 1 into a sum.

    python hello_distributed.py                                    # one process
    torchrun --standalone --nproc-per-node=2 hello_distributed.py  # two, here
    srun --ntasks=4 python hello_distributed.py  # SLURM, with MASTER_ADDR/PORT set

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from distributed_setup import fail, setup_distributed, where_it_ran


@record
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait")
    parser.add_argument("--results", help="a JSON file for rank 0's results")
    args = parser.parse_args()
    rank, world_size, device = setup_distributed(args.timeout)
    value = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(value)  # the sum over ranks: 1 + 2 + ... + world_size
    if rank == 0:
        print(f"{world_size} process(es) on {device.type}: sum = {value.item():g}")
        if args.results:
            with open(args.results, "w") as f:
                json.dump({**where_it_ran(device), "sum": value.item()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
