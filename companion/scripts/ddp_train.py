"""Train a small classifier with DistributedDataParallel, on CPUs or GPUs.

Launch lines, from the repository's root folder:
    python companion/scripts/ddp_train.py                          # one process
    python companion/scripts/ddp_train.py --spawn 2                # 2 processes started by mp.spawn
    torchrun --standalone --nproc-per-node=2 companion/scripts/ddp_train.py
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=run1 companion/scripts/ddp_train.py              # on each of 2 nodes
    srun --nodes=2 --ntasks-per-node=4 --gpus-per-task=1 python companion/scripts/ddp_train.py
    sbatch companion/scripts/ddp_train.sbatch                      # SLURM batch job

Each process trains a replica of the same model on its own shard of every
global batch (``DistributedSampler``); DDP averages the gradients, so every
replica takes the same step. All processes make one decision together: nccl
with one GPU each when every process has a GPU of its own, else gloo on the
CPUs of all of them (``--backend nccl`` then stops with one sentence).

Writes: log lines on rank 0; a checkpoint every ``--checkpoint-every`` steps
in ``--checkpoint-dir`` (atomically, by rank 0; a run resumes from the newest
one); with ``--results FILE``, a JSON summary (losses, accuracies, timing,
parameter checksum, who ran where).

Exit codes: 0 done; 2 bad input or a setting the processes cannot run with,
said in one sentence on stderr by rank 0 (or, when the processes cannot meet,
by the first process of each node); 1 anything unexpected (a traceback).
The file imports only torch and the standard library: copy it anywhere.
"""

import argparse
import collections
import datetime
import hashlib
import itertools
import json
import math
import os
import pickle
import re
import signal
import socket
import sys
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).name
MIN_TORCH = (
    2,
    4,
)  # init_process_group(device_id=...), torch.load(weights_only=True) of plain tensors


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
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

CHECKPOINT_NAME = re.compile(r"step-(\d+)\.pt")
FEATURES, CLASSES, HIDDEN = 8, 4, 32  # toy problem: 8-D points from 4 Gaussian blobs


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """Print one line, not the usage block (``--help`` shows that), and exit with code 2."""
        fail(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog=SCRIPT,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--steps", type=int, default=200, help="optimizer steps in all (default: 200)"
    )
    parser.add_argument(
        "--epochs",
        type=float,
        default=None,
        help="train for this many passes over the data instead of --steps (default: unset)",
    )
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per step over all processes, a multiple of the world size "
        "(default: 64 rounded up to a multiple of the world size)",
    )
    parser.add_argument(
        "--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the data, the model and the shuffling (default: 0)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=2048,
        help="training samples, rounded up to a multiple of the global batch (default: 2048)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="parameter and data type (default: float32)",
    )
    parser.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="collective backend; auto = nccl if every process has a GPU of its own, "
        "else gloo on the CPUs (default: auto)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default="",
        help="folder for checkpoints, on a file system every node sees; a run resumes from the "
        "newest one there (default: none)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="steps between checkpoints (default: 50)",
    )
    parser.add_argument(
        "--keep-checkpoints",
        type=int,
        default=2,
        help="newest checkpoints to keep (default: 2)",
    )
    parser.add_argument(
        "--log-every",
        type=int,
        default=50,
        help="steps between log lines on rank 0; the losses are gathered then (default: 50)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the processes wait for each other to meet and in each collective "
        "(default: 600, PyTorch's own)",
    )
    parser.add_argument(
        "--spawn",
        type=int,
        default=0,
        help="start this many local processes with mp.spawn, without a launcher (default: 0 = no)",
    )
    parser.add_argument(
        "--results",
        default="",
        help="JSON file that rank 0 writes at the end (default: none)",
    )
    # Testing only: the last rank kills itself once at this step (a marker file
    # in the checkpoint folder keeps the restarted run from doing it again).
    parser.add_argument("--fail-at-step", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in (
        "steps",
        "samples",
        "checkpoint_every",
        "keep_checkpoints",
        "log_every",
    ):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, not "
                f"{getattr(args, name)}."
            )
    if args.epochs is not None and args.epochs <= 0:
        parser.error(f"--epochs must be positive, not {args.epochs}.")
    if args.spawn < 0:
        parser.error(f"--spawn must be 0 or more, not {args.spawn}.")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, not {args.timeout}.")
    if args.fail_at_step and not args.checkpoint_dir:
        parser.error("--fail-at-step needs --checkpoint-dir for its marker file.")
    return args


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

    From torchrun's (or mp.spawn's) RANK/LOCAL_RANK/WORLD_SIZE, else SLURM's
    SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS, else one process. Under srun,
    rank 0 runs on the first node of the step's node list, which hosts the
    rendezvous; the port comes from the job id, so two jobs on a node differ.
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
                    "MASTER_ADDR "
                    "(ddp_train.sbatch shows how)."
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
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(free_port())
    return 0, 0, 1


def node_rank() -> int:
    """Return the number of this process's node: torchrun's GROUP_RANK, SLURM's SLURM_NODEID, else 0."""
    return int(os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", 0)))


def describe_process(local_rank: int) -> dict:
    """Return this process's host and the GPU it would use: ``cuda:(local_rank % GPUs it sees)``.

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


def pick_device(
    backend: str,
    local_rank: int,
    local_world_size: int,
    everyone: list[dict] | None = None,
) -> tuple[str, torch.device]:
    """Return the backend and this process's device, decided alike on every process.

    nccl and a GPU of its own for each process when every process has one,
    else gloo on the CPU for all; ``backend="nccl"`` then raises one sentence.
    ``everyone`` holds what each process reported (``describe_process``);
    without it, ``local_world_size`` processes on this node that see what
    this one sees.
    """
    if everyone is None:
        everyone = [describe_process(r) for r in range(local_world_size)]
    problem = ""
    without = [i for i, p in enumerate(everyone) if p["gpu"] is None]
    shared = collections.Counter(
        (p["host"], p["gpu"]["uuid"]) for p in everyone if p["gpu"]
    )
    if len(without) == len(everyone) and len({p["host"] for p in everyone}) == 1:
        problem = "this node has no GPU"
    elif without:
        problem = (
            f"{len(without)} of the {len(everyone)} processes see no GPU "
            f"(rank {without[0]} on {everyone[without[0]]['host']})"
        )
    elif max(shared.values()) > 1:
        host = next(h for (h, _), n in shared.items() if n > 1)
        gpus = sum(1 for h, _ in shared if h == host)
        users = sum(n for (h, _), n in shared.items() if h == host)
        problem = (
            f"{host} has {gpus} GPU(s) for {users} processes; start at most {gpus} per "
            "node, "
            "or give each its own with srun --gpus-per-task=1"
        )
    elif not dist.is_nccl_available():
        problem = "this PyTorch was built without nccl"
    if backend == "nccl" and problem:
        raise UsageError(
            f"the nccl backend needs one GPU per process, but {problem}; use --backend "
            "gloo."
        )
    if backend == "gloo" or problem:
        return "gloo", torch.device("cpu")
    device = torch.device(
        "cuda", local_rank % torch.cuda.device_count()
    )  # the GPU describe_process named
    torch.cuda.set_device(device)
    return "nccl", device


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
    key = f"ddp_train/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
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


def setup_distributed(args: argparse.Namespace) -> tuple[int, int, int, torch.device]:
    """Join the process group and return ``rank, local_rank, world_size, device``."""
    rank, local_rank, world_size = read_topology()
    store, everyone = meet(rank, world_size, args.timeout)
    backend, device = pick_device(args.backend, local_rank, 0, everyone)
    if args.backend == "auto" and backend == "gloo" and any(p["gpu"] for p in everyone):
        print0(
            rank,
            "note: not every process has a GPU of its own, so all of them train on the "
            "CPU with gloo",
        )
    local_world_size = sum(p["host"] == everyone[rank]["host"] for p in everyone)
    if device.type == "cpu" and local_world_size > 1:
        # The processes share the cores: more threads than their share (one each
        # on a small machine) would oversubscribe them. torchrun sets 1 already.
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
        torch.set_num_threads(
            min(torch.get_num_threads(), max(1, cores // local_world_size))
        )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=args.timeout),
        device_id=device if device.type == "cuda" else None,
    )
    return rank, local_rank, world_size, device


def print0(rank: int, *parts: object) -> None:
    """Print one line tagged with the rank, on rank 0 only."""
    if rank == 0:
        print(f"[rank {rank}]", *parts, flush=True)


# ---------------------------------------------------------------- data and model


def plan_data(
    samples: int, global_batch_size: int | None, world_size: int
) -> tuple[int, int, int]:
    """Return ``train_samples, test_samples, global_batch_size`` for ``world_size`` processes.

    The global batch is a multiple of the world size and the training set a
    multiple of the global batch, so every rank gets the same, non-empty shard
    and the sampler pads nothing: each step sees the same samples whatever
    the world size. The test set has at least one sample per rank.
    """
    if global_batch_size is None:
        global_batch_size = math.ceil(64 / world_size) * world_size
    if global_batch_size < world_size:
        raise UsageError(
            f"the global batch ({global_batch_size}) is smaller than the number of "
            "processes "
            f"({world_size}); give each process at least one sample with "
            "--global-batch-size."
        )
    if global_batch_size % world_size:
        raise UsageError(
            f"the global batch ({global_batch_size}) does not split evenly over "
            f"{world_size} "
            f"processes; use a multiple of {world_size}."
        )
    train_samples = math.ceil(samples / global_batch_size) * global_batch_size
    return train_samples, max(train_samples // 4, world_size), global_batch_size


def make_data(
    train_samples: int, test_samples: int, seed: int, dtype: torch.dtype
) -> tuple[TensorDataset, TensorDataset]:
    """Return training and test sets: noisy points around one of 4 random centres, labelled by centre."""
    gen = torch.Generator().manual_seed(seed)
    centres = 1.5 * torch.randn(CLASSES, FEATURES, generator=gen, dtype=dtype)
    n = train_samples + test_samples
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    points = centres[labels] + torch.randn(n, FEATURES, generator=gen, dtype=dtype)
    return (
        TensorDataset(points[:train_samples], labels[:train_samples]),
        TensorDataset(points[train_samples:], labels[train_samples:]),
    )


def build_model(seed: int, dtype: torch.dtype) -> nn.Module:
    """Return the classifier, initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    ).to(dtype)


def param_checksum(model: nn.Module) -> tuple[str, float]:
    """Return a SHA-256 prefix of the parameters' bytes, and their sum."""
    sha = hashlib.sha256()
    total = 0.0
    for tensor in model.state_dict().values():
        flat = tensor.detach().cpu().contiguous()
        sha.update(flat.numpy().tobytes())
        total += flat.double().sum().item()
    return sha.hexdigest()[:16], total


# ---------------------------------------------------------------- checkpoints

CHECKPOINT_KEYS = {"model", "optimizer", "step", "losses", "config"}
# The settings a checkpoint must share with the run that resumes from it.
RESUME_KEYS = ("global_batch_size", "lr", "seed", "samples", "dtype")


def newest_checkpoint(folder: Path) -> Path | None:
    """Return the checkpoint with the highest step in ``folder``, if any."""
    found = [
        (int(m.group(1)), p)
        for p in folder.glob("step-*.pt")
        if (m := CHECKPOINT_NAME.fullmatch(p.name))
    ]
    return max(found)[1] if found else None


def save_checkpoint(folder: Path, state: dict, keep: int) -> Path:
    """Write ``state`` atomically (to a temporary file, then rename).

    Then drop all but the newest ``keep`` checkpoints.
    """
    path = folder / f"step-{state['step']:06d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(
        tmp, path
    )  # readers see the old file or the whole new one, never half of one
    steps = sorted(
        (int(m.group(1)), p)
        for p in folder.glob("step-*.pt")
        if (m := CHECKPOINT_NAME.fullmatch(p.name))
    )
    for _, stale in steps[
        :-keep
    ]:  # by step number: step-1000000.pt is newer than step-999999.pt
        stale.unlink(missing_ok=True)
    return path


def read_checkpoint(path: Path, device: torch.device) -> object:
    """``torch.load`` with ``weights_only=True``; each way it can fail gets its own sentence.

    Only a file that is truly damaged is worth deleting: a file missing on
    this node, one refused for holding code, or a read that ran out of memory
    says nothing against the checkpoint itself.
    """
    host = socket.gethostname()
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise UsageError(
            f"checkpoint {path}, which rank 0 chose, is missing on {host}; put "
            "--checkpoint-dir "
            "on a file system that every node sees."
        ) from None
    except pickle.UnpicklingError as err:
        if "weights only" in str(err).lower():
            raise UsageError(
                f"checkpoint {path} holds Python objects that loading would have to "
                "run as code, "
                "so it was refused; it is not one of this script's: move it out of "
                "--checkpoint-dir."
            ) from None
    except (MemoryError, OSError, RuntimeError) as err:
        if (
            isinstance(err, (MemoryError, OSError)) or "memory" in str(err).lower()
        ):  # not the file's fault
            detail = str(err).splitlines()[0] if str(err) else "no detail"
            raise UsageError(
                f"cannot read checkpoint {path} on {host} ({type(err).__name__}: "
                f"{detail}); the "
                "file itself may be fine, so keep it and fix the cause."
            ) from None
    except Exception:  # noqa: S110 - a damaged file raises one of several types, depending on where it breaks
        pass
    raise UsageError(
        f"checkpoint {path} is truncated or corrupt; delete it to resume from an older "
        "one."
    )


def load_checkpoint(path: Path, device: torch.device, config: dict) -> dict:
    """Load a checkpoint that rank 0 chose; every rank reads it to its own device."""
    state = read_checkpoint(path, device)
    if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
        raise UsageError(
            f"checkpoint {path} is not one of this script's (it lacks "
            f"{', '.join(sorted(CHECKPOINT_KEYS - set(state) if isinstance(state, dict) else CHECKPOINT_KEYS))}); "
            "move it out of --checkpoint-dir."
        )
    for key in RESUME_KEYS:
        if state["config"].get(key) != config[key]:
            raise UsageError(
                f"checkpoint {path} was written with {key}={state['config'].get(key)}, "
                "not "
                f"{config[key]}; use the same settings or another --checkpoint-dir."
            )
    return state


def agree_on_checkpoint(
    rank: int, folder: Path | None, device: torch.device, config: dict
) -> dict | None:
    """Rank 0 picks the newest checkpoint; every rank loads it, and all fail together if one cannot."""
    choice = [str(newest_checkpoint(folder) or "") if rank == 0 and folder else ""]
    dist.broadcast_object_list(choice, src=0)
    state, error = None, ""
    if choice[0]:
        try:
            state = load_checkpoint(Path(choice[0]), device, config)
        except UsageError as err:
            error = str(err)
    errors = [""] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise UsageError(
            failed[0][1]
            if failed[0][0] == 0
            else f"on rank {failed[0][0]}: {failed[0][1]}"
        )
    return state


# ---------------------------------------------------------------- training


@torch.no_grad()
def shard_accuracy(
    model: nn.Module,
    data: TensorDataset,
    rank: int,
    world_size: int,
    device: torch.device,
) -> float:
    """Return the accuracy over all of ``data``: each rank counts its shard, then the counts are summed."""
    points, labels = (t[rank::world_size].to(device) for t in data.tensors)
    counts = torch.tensor(
        [(model(points).argmax(1) == labels).sum().item(), len(labels)], device=device
    )
    dist.all_reduce(counts)
    return counts[0].item() / counts[1].item()


def train(args: argparse.Namespace) -> None:
    rank, local_rank, world_size, device = setup_distributed(args)
    dtype = getattr(torch, args.dtype)
    train_samples, test_samples, global_batch = plan_data(
        args.samples, args.global_batch_size, world_size
    )
    micro_batch = global_batch // world_size
    steps_per_epoch = train_samples // global_batch
    total_steps = round(args.epochs * steps_per_epoch) if args.epochs else args.steps
    config = {
        "global_batch_size": global_batch,
        "lr": args.lr,
        "seed": args.seed,
        "samples": args.samples,
        "dtype": args.dtype,
        "steps": total_steps,
    }

    # Who is where: every rank reports, rank 0 prints (lines tagged with rank 0 only).
    me = {
        "rank": rank,
        "local_rank": local_rank,
        "node_rank": node_rank(),
        "host": socket.gethostname(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "train_shard": train_samples // world_size,
        "test_shard": len(range(rank, test_samples, world_size)),
    }
    ranks: list[dict] = [{}] * world_size
    dist.all_gather_object(ranks, me)
    hosts = len({r["host"] for r in ranks})
    print0(
        rank,
        f"{world_size} process(es) on {hosts} host(s), backend {dist.get_backend()}, "
        f"device {device.type}, {me['threads']} thread(s) per process",
    )
    print0(
        rank,
        f"{train_samples} training samples ({me['train_shard']} per rank), "
        f"{test_samples} test samples; "
        f"global batch {global_batch} = {world_size} x {micro_batch}; {args.dtype}",
    )

    train_set, test_set = make_data(train_samples, test_samples, args.seed, dtype)
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(
        train_set,
        batch_size=micro_batch,
        sampler=sampler,
        pin_memory=device.type == "cuda",
    )
    model = build_model(args.seed, dtype).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    folder = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if folder and rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    state = agree_on_checkpoint(rank, folder, device, config)
    step, losses = 0, []
    if state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, losses = state["step"], state["losses"]
        print0(rank, f"resuming from checkpoint step-{step:06d}.pt (step {step})")
    start_step = step
    ddp = DDP(
        model, device_ids=[local_rank] if device.type == "cuda" else None
    )  # broadcasts rank 0's weights

    pending: list[
        torch.Tensor
    ] = []  # this rank's losses since the last gathering, still on the device

    def gather_losses() -> None:
        """Turn the pending local losses into global-batch means: one all-reduce for many steps."""
        if pending:
            summed = torch.stack(pending)
            dist.all_reduce(summed)
            losses.extend(
                x / world_size for x in summed.tolist()
            )  # .tolist() waits for the device
            pending.clear()

    def checkpoint() -> None:
        gather_losses()  # on every rank: it is a collective
        if rank == 0 and folder:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "losses": losses,
                "config": config,
            }  # the unwrapped model: loadable without DDP
            print0(
                rank,
                "saved checkpoint "
                f"{save_checkpoint(folder, state, args.keep_checkpoints).name}",
            )

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    while step < total_steps:
        epoch, skip = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for points, labels in itertools.islice(
            loader, skip, None
        ):  # skip what a resumed run has done
            points, labels = (
                points.to(device, non_blocking=True),
                labels.to(device, non_blocking=True),
            )
            loss = F.cross_entropy(ddp(points), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over all ranks here
            optimizer.step()
            step += 1
            pending.append(
                loss.detach()
            )  # no sync and no collective here: the log gathers them
            if step % args.log_every == 0 or step == total_steps:
                gather_losses()
                print0(
                    rank,
                    f"step {step:5d}/{total_steps}  epoch {epoch + 1}  loss "
                    f"{losses[-1]:.4f}",
                )
            if step % args.checkpoint_every == 0:
                checkpoint()
            if step == args.fail_at_step and rank == world_size - 1:
                marker = folder / f"failed-at-step-{step}"  # type: ignore[operator]
                if not marker.exists():
                    marker.touch()
                    os.kill(
                        os.getpid(), signal.SIGKILL
                    )  # a crash: no clean-up, no goodbye
            if step == total_steps:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    gather_losses()
    if step % args.checkpoint_every:
        checkpoint()

    train_acc = shard_accuracy(model, train_set, rank, world_size, device)
    test_acc = shard_accuracy(model, test_set, rank, world_size, device)
    checksum, param_sum = param_checksum(model)
    done = step - start_step
    rate = done * global_batch / seconds if done else 0.0
    print0(
        rank,
        f"done: train accuracy {train_acc:.3f}, test accuracy {test_acc:.3f}; "
        f"{done} steps in {seconds:.3g} s ({rate:,.0f} samples/s)",
    )
    if rank == 0 and args.results:
        results = {
            **config,
            "world_size": world_size,
            "backend": dist.get_backend(),
            "device": device.type,
            "hosts": hosts,
            "ranks": ranks,
            "micro_batch_size": micro_batch,
            "train_samples": train_samples,
            "test_samples": test_samples,
            "start_step": start_step,
            "epochs": step / steps_per_epoch,
            "losses": losses,
            "train_accuracy": train_acc,
            "test_accuracy": test_acc,
            "train_seconds": seconds,
            "samples_per_second": rate,
            "param_checksum": checksum,
            "param_sum": param_sum,
            "checkpoint": str(newest_checkpoint(folder)) if folder else None,
        }
        tmp = Path(args.results + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, args.results)
    dist.destroy_process_group()


# ---------------------------------------------------------------- entry points


def run(args: argparse.Namespace) -> None:
    """Train; on bad input, print one sentence and exit with code 2 (every rank)."""
    try:
        train(args)
    except UsageError as err:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Errors the processes agree on are said by rank 0; one that stopped them
        # from meeting, by the first process of each node that saw it.
        fail(str(err), printer=env_rank(local=isinstance(err, RendezvousError)) == 0)


def spawned_worker(local_rank: int, args: argparse.Namespace, nprocs: int) -> None:
    """Entry point of a process started by ``mp.spawn``: it plays torchrun's part for the environment."""
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
    )
    run(args)


def main() -> None:
    args = parse_args()
    if args.spawn and "RANK" not in os.environ:
        # mp.spawn pickles spawned_worker by name; the new processes find it by
        # importing this file, which is why mp.spawn needs a script, not a notebook.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        try:
            mp.spawn(spawned_worker, args=(args, args.spawn), nprocs=args.spawn)
        except mp.ProcessExitedException as err:  # the worker has already said why
            sys.exit(err.exit_code if err.exit_code and err.exit_code > 0 else 1)
    else:
        run(args)


if __name__ == "__main__":
    main()
