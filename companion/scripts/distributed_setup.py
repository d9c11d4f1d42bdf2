"""Join the process group, or stop in one sentence: the scripts' shared set-up.

Each script imports it as a sibling (``from distributed_setup import ...``),
as nanoGPT's ``train.py`` imports ``model.py``: copy the folder, or a script
with this file (and, for the GPT scripts, ``gpt_model.py``) beside it. It
needs only torch and the standard library.
"""

import atexit
import datetime
import json
import os
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist


class Launch(NamedTuple):
    """This process's place, as torchrun or srun set it (plain python: one)."""

    rank: int  # among all processes, 0 ... world_size - 1
    local_rank: int  # on this node: it picks the GPU
    world_size: int  # processes in the job
    per_node: int  # processes on this node


def _read(torchrun: str, slurm: str, alone: int) -> int:
    return int(os.environ.get(torchrun, os.environ.get(slurm, alone)))


def launched() -> Launch:
    """Read the launcher's variables: torchrun's, else SLURM's, else one process."""
    return Launch(
        rank=_read("RANK", "SLURM_PROCID", 0),
        local_rank=_read("LOCAL_RANK", "SLURM_LOCALID", 0),
        world_size=_read("WORLD_SIZE", "SLURM_NTASKS", 1),
        per_node=_read("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", 1),
    )


def fail(message: str) -> None:
    """Stop with one sentence on stderr and in torchrun's summary; exit code 2."""
    if _read("RANK", "SLURM_PROCID", 0):
        time.sleep(30)  # rank 0 says it, while torchrun or srun -K stops the others
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's summary
        said = {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}
        with open(error_file, "w") as f:  # as @record writes it, less the traceback
            json.dump({"message": said}, f)
    sys.exit(2)


def setup_distributed(timeout_s: float = 600) -> tuple[int, int, torch.device]:
    """Join the process group; return this process's ``rank, world_size, device``."""
    if torch.__version__ < (2, 10):
        fail(f"these scripts need PyTorch 2.10 or newer, not {torch.__version__}")
    me = launched()
    gpus = torch.cuda.device_count()  # a process takes GPU local_rank, except under
    own = gpus == 1 and "RANK" not in os.environ  # srun --gpus-per-task=1 (as 0)
    if not own and 0 < gpus < max(me.per_node, me.local_rank + 1):
        fail(f"this node has {gpus} GPU(s) for {me.per_node} processes")
    device = torch.device(f"cuda:{0 if own else me.local_rank}" if gpus else "cpu")
    if gpus:
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            dist.get_default_backend_for_device(device),
            store=dist.HashStore() if me.world_size == 1 else None,  # alone: no port
            rank=me.rank,
            world_size=me.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if gpus else None,
        )
    except (dist.DistError, ValueError) as err:  # a busy port, a missing rank
        fail(f"the processes did not meet: {str(err).strip().splitlines()[0]}")
    # A gloo group still alive when python exits can abort it (SIGABRT, pytorch#179291);
    # destroying an nccl group waits for every rank, so nccl's is left to the exit.
    if dist.get_backend() == "gloo":
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return me.rank, me.world_size, device


def where_it_ran(device: torch.device) -> dict:
    """The device, backend, processes and threads a result was measured with."""
    run = {"device": device.type, "world_size": dist.get_world_size()}
    return {**run, "backend": dist.get_backend(), "threads": torch.get_num_threads()}
