"""Smallest useful distributed program: every rank adds its number into a sum.

Launch lines:
    python hello_distributed.py                                  # one process
    torchrun --standalone --nproc-per-node=2 hello_distributed.py
    srun --ntasks=4 python hello_distributed.py                  # under SLURM

Picks nccl when each process has a GPU, gloo otherwise. Rank 0 prints the
result and, with ``--results FILE``, writes it as JSON.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="", help="JSON file rank 0 writes (default: none)")
    args = parser.parse_args()

    rank, _, world_size, device = setup_distributed()
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)  # sum over ranks: 1 + 2 + ... + world_size
    if rank == 0:
        print(f"[rank 0] {world_size} process(es), backend {dist.get_backend()}: sum = {value.item():g}")
        if args.results:
            with open(args.results, "w") as f:
                json.dump({"world_size": world_size, "backend": dist.get_backend(), "sum": value.item()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
