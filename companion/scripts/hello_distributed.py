"""The smallest useful distributed program: every rank adds rank + 1 into a sum.

    python hello_distributed.py                                    # one process
    torchrun --standalone --nproc-per-node=2 hello_distributed.py  # two, here
    srun --ntasks=4 python hello_distributed.py  # SLURM, with MASTER_ADDR/PORT set

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import atexit
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

# ---- set-up: the same in every script of companion/scripts (a test checks it)


def fail(message: str) -> None:
    """Stop with one sentence on stderr and in torchrun's summary; exit code 2."""
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))):
        time.sleep(30)  # rank 0 says it, while torchrun or srun -K stops the others
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's summary
        said = {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}
        with open(error_file, "w") as f:  # as @record writes it, less the traceback
            json.dump({"message": said}, f)
    sys.exit(2)


def setup_distributed(timeout_s: float = 600) -> tuple[int, int, int, torch.device]:
    """Join the process group; return ``rank, local_rank, world_size, device``."""
    if torch.__version__ < (2, 10):
        fail(f"these scripts need PyTorch 2.10 or newer, not {torch.__version__}")
    env = os.environ  # set by torchrun or srun; plain python is one process
    rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
    world_size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    per_node = int(env.get("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", 1)))
    gpus = torch.cuda.device_count()  # a process takes GPU local_rank, except under
    own = gpus == 1 and "RANK" not in env  # srun --gpus-per-task=1 (its own, as 0)
    if not own and 0 < gpus < max(per_node, local_rank + 1):
        fail(f"this node has {gpus} GPU(s) for {per_node} processes")
    device = torch.device(f"cuda:{0 if own else local_rank}" if gpus else "cpu")
    if gpus:
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            dist.get_default_backend_for_device(device),
            store=dist.HashStore() if world_size == 1 else None,  # alone: no port
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if gpus else None,
        )
    except (dist.DistError, ValueError) as err:  # a busy port, a missing rank
        fail(f"the processes did not meet: {str(err).strip().splitlines()[0]}")
    # A gloo group still alive when python exits can abort it (SIGABRT, pytorch#179291);
    # destroying an nccl group waits for every rank, so nccl's is left to the exit.
    if dist.get_backend() == "gloo":
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return rank, local_rank, world_size, device


def where_it_ran(device: torch.device) -> dict:
    """The device, backend, processes and threads a result was measured with."""
    run = {"device": device.type, "world_size": dist.get_world_size()}
    return {**run, "backend": dist.get_backend(), "threads": torch.get_num_threads()}


# ---- end of set-up


@record
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait")
    parser.add_argument("--results", help="a JSON file for rank 0's results")
    args = parser.parse_args()
    rank, _, world_size, device = setup_distributed(args.timeout)
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
