"""DTensor basics: placements, redistribution, and what each rank holds.

Launch lines:
    torchrun --standalone --nproc-per-node=2 dtensor_basics.py
    torchrun --standalone --nproc-per-node=4 dtensor_basics.py --rows 4 --cols 8
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=basics dtensor_basics.py                      # on each of 2 nodes
    srun --ntasks=4 python dtensor_basics.py                    # under SLURM

Builds a one-axis device mesh over all processes, places one small matrix on
it as ``Shard(0)``, ``Shard(1)`` and ``Replicate()``, makes a ``Partial()``
tensor the way it arises in practice (a matrix product whose contracted dim is
sharded), then redistributes between placements and counts the collectives
each change costs (with ``CommDebugMode``). Every rank's local piece is
gathered to rank 0, printed, and written to ``--results FILE`` as JSON
(the full matrix, every layout's local pieces, every redistribution's
collectives). All processes decide together: nccl with one GPU each when
every process has a GPU of its own, gloo on the CPUs otherwise.

Exit codes: 0 done; 3 a distributed result differs from the full one; 2 bad
input, said in one sentence by rank 0; 1 anything unexpected. Needs PyTorch 2.5
or newer.
"""

import argparse
import collections
import datetime
import json
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).name
MIN_TORCH = (2, 5)  # the public torch.distributed.tensor


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
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)  # noqa: E402
from torch.distributed.tensor import init_device_mesh  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402


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
    print0(
        f"{label}: placement {placement_name(dtensor)}, global shape "
        f"{tuple(dtensor.shape)}"
    )
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


def redistribute(
    label: str, dtensor: DTensor, placements: list
) -> tuple[DTensor, dict]:
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
    parser = ArgumentParser(
        prog=SCRIPT,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rows", type=int, default=4, help="rows of the example matrix (default: 4)"
    )
    parser.add_argument(
        "--cols", type=int, default=8, help="columns of the example matrix (default: 8)"
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
    if args.rows < 1 or args.cols < 1 or args.timeout <= 0:
        parser.error("--rows, --cols and --timeout must be positive.")

    rank, _, world_size, device = setup_distributed(args.timeout)
    # On a CPU, DTensor logs (with a timestamp) that gloo has no all-to-all and
    # it falls back to all-gather + chunk; we say so once, below, instead.
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(
        logging.ERROR
    )
    # One mesh axis over every process; "axis" names a mesh dimension, "dim" a tensor's.
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("ranks",))
    print0(f"Mesh: {mesh}")

    # Every rank builds the same full matrix; distribute_tensor keeps only this
    # rank's part.
    full = torch.arange(
        args.rows * args.cols, dtype=torch.float32, device=device
    ).reshape(args.rows, args.cols)
    layouts = [
        describe(p, distribute_tensor(full, mesh, [pl]))
        for p, pl in (
            ("Shard(0)", Shard(0)),
            ("Shard(1)", Shard(1)),
            ("Replicate()", Replicate()),
        )
    ]

    # Partial arises from a product whose contracted dim is sharded: each rank
    # multiplies its columns of A by its rows of B and holds one term of the sum.
    a = distribute_tensor(full, mesh, [Shard(1)])
    b = distribute_tensor(
        torch.ones(args.cols, args.rows, device=device), mesh, [Shard(0)]
    )
    product = a @ b
    layouts.append(describe("Partial(): A @ B", product))

    steps = []
    row_sharded = distribute_tensor(full, mesh, [Shard(0)])
    steps.append(redistribute("Shard(0) -> Replicate()", row_sharded, [Replicate()])[1])
    steps.append(redistribute("Shard(0) -> Shard(1)", row_sharded, [Shard(1)])[1])
    if device.type == "cpu":
        print0(
            "  (gloo has no all-to-all, so on a CPU DTensor all-gathers and keeps its "
            "chunk)"
        )
    replicated = distribute_tensor(full, mesh, [Replicate()])
    steps.append(redistribute("Replicate() -> Shard(0)", replicated, [Shard(0)])[1])
    steps.append(redistribute("Partial() -> Replicate()", product, [Replicate()])[1])
    steps.append(redistribute("Partial() -> Shard(0)", product, [Shard(0)])[1])

    # The check every chapter relies on: the distributed value equals the full one.
    expected = full @ torch.ones(args.cols, args.rows, device=device)
    same = torch.equal(product.full_tensor(), expected)
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump(
                {
                    "world_size": world_size,
                    "full": full.tolist(),
                    "layouts": layouts,
                    "steps": steps,
                },
                f,
            )
    dist.destroy_process_group()
    if not same:
        fail(
            "the product of the sharded matrices differs from the product of the full "
            "ones.",
            code=3,
        )


if __name__ == "__main__":
    run_main(main)
