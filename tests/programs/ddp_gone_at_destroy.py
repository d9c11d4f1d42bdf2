"""Run a script, and fail it if a DDP model is still alive when it destroys its group.

    torchrun --nproc-per-node=2 tests/programs/ddp_gone_at_destroy.py SCRIPT [ARGS ...]

DDP's reducer holds the process group. When the reducer is the group's last
holder, the group is destroyed with it, in C++, with the GIL held; a gloo
group's destructor then joins its worker thread, which may be freeing the last
collective's tensors and waits for the GIL: the process hangs (torch 2.10: 3
of 12 two-process runs of ddp_train.py through fast_start, before the scripts
dropped the model first). Destroyed from Python, the group releases the GIL.
So every script drops every reference to its DDP model (and collects, for one
left in a reference cycle) before ``dist.destroy_process_group()``: this
wrapper checks that on every call, and exits with 3 and one line if not.
"""

import gc
import os
import runpy
import sys

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

destroy = dist.destroy_process_group


def checked_destroy(*args, **kwargs):
    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    if alive:
        print(
            f"ddp_gone_at_destroy: {alive} DDP model(s) alive at "
            "destroy_process_group()",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)
    return destroy(*args, **kwargs)


if __name__ == "__main__":
    dist.destroy_process_group = checked_destroy
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
