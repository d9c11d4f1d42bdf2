"""Train a small classifier with DistributedDataParallel, on CPUs or GPUs.

Launch lines, from the repository's root folder:
    python companion/scripts/ddp_train.py                          # one process
    python companion/scripts/ddp_train.py --spawn 2                # 2 processes started by mp.spawn
    torchrun --standalone --nproc-per-node=2 companion/scripts/ddp_train.py
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=run1 companion/scripts/ddp_train.py              # on each of 2 nodes
    srun --nodes=2 --ntasks-per-node=4 python companion/scripts/ddp_train.py   # under SLURM
    sbatch companion/scripts/ddp_train.sbatch                      # SLURM batch job

Each process trains a replica of the same model on its own shard of every
global batch (``DistributedSampler``); DDP averages the gradients, so every
replica takes the same step. The backend is nccl when every process has a GPU,
gloo otherwise. Rank 0 logs, writes checkpoints (atomically) and, with
``--results FILE``, a JSON summary. A run resumes from the newest checkpoint in
``--checkpoint-dir``. Bad input ends with one sentence on stderr and exit code 2.
The file imports only torch and the standard library: copy it anywhere.
"""

import argparse
import datetime
import hashlib
import itertools
import json
import math
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

SCRIPT = Path(__file__).name
CHECKPOINT_NAME = re.compile(r"step-(\d+)\.pt")
FEATURES, CLASSES, HIDDEN = 8, 4, 32  # toy problem: 8-D points from 4 Gaussian blobs


class UsageError(Exception):
    """Bad input: the message is one sentence saying what is wrong and what to do."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """Print one line, not the usage block (``--help`` shows that), and exit with code 2."""
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog=SCRIPT, description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all (default: 200)")
    parser.add_argument("--epochs", type=float, default=None,
                        help="train for this many passes over the data instead of --steps (default: unset)")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="samples per step over all processes, a multiple of the world size "
                             "(default: 64 rounded up to a multiple of the world size)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the shuffling (default: 0)")
    parser.add_argument("--samples", type=int, default=2048,
                        help="training samples, rounded up to a multiple of the global batch (default: 2048)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="parameter and data type (default: float32)")
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                        help="collective backend; auto = nccl if every process has a GPU, else gloo (default: auto)")
    parser.add_argument("--checkpoint-dir", default="",
                        help="folder for checkpoints; a run resumes from the newest one there (default: none)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default: 50)")
    parser.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints to keep (default: 2)")
    parser.add_argument("--log-every", type=int, default=50, help="steps between log lines on rank 0 (default: 50)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective may wait for the other processes (default: 120)")
    parser.add_argument("--spawn", type=int, default=0,
                        help="start this many local processes with mp.spawn, without a launcher (default: 0 = no)")
    parser.add_argument("--results", default="", help="JSON file that rank 0 writes at the end (default: none)")
    # Testing only: the last rank kills itself once at this step (a marker file
    # in the checkpoint folder keeps the restarted run from doing it again).
    parser.add_argument("--fail-at-step", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("steps", "samples", "checkpoint_every", "keep_checkpoints", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}.")
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


def read_topology() -> tuple[int, int, int, int]:
    """Return ``rank, local_rank, world_size, local_world_size``.

    From torchrun's (or mp.spawn's) RANK/LOCAL_RANK/WORLD_SIZE, else SLURM's
    SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS, else one process.
    """
    env = os.environ
    if "RANK" in env:
        world_size = int(env["WORLD_SIZE"])
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        return int(env["RANK"]), int(env["LOCAL_RANK"]), world_size, local_world_size
    if "SLURM_PROCID" in env:
        world_size, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", 1))
        if nodes > 1 and "MASTER_ADDR" not in env:
            raise UsageError("under SLURM with several nodes, set MASTER_ADDR to the first node's host name "
                             "(ddp_train.sbatch shows how).")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
        local_world_size = int(env.get("SLURM_NTASKS_PER_NODE", world_size // nodes))
        return int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"]), world_size, local_world_size
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(free_port())
    return 0, 0, 1, 1


def node_rank() -> int:
    """Return the number of this process's node: torchrun's GROUP_RANK, SLURM's SLURM_NODEID, else 0."""
    return int(os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", 0)))


def pick_device(backend: str, local_rank: int, local_world_size: int) -> tuple[str, torch.device]:
    """Return the backend and this process's device: a GPU of its own with nccl, the CPU with gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "gloo" or (backend == "auto" and gpus == 0):
        return "gloo", torch.device("cpu")
    if gpus == 0:
        raise UsageError("the nccl backend needs one GPU per process, but this node has no GPU; "
                         "use --backend gloo.")
    if gpus < local_world_size:
        raise UsageError(f"the nccl backend needs one GPU per process, but this node has {gpus} GPU(s) for "
                         f"{local_world_size} processes; start at most {gpus} per node, or use --backend gloo.")
    if not dist.is_nccl_available():
        raise UsageError("this PyTorch was built without nccl; use --backend gloo.")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return "nccl", device


def setup_distributed(args: argparse.Namespace) -> tuple[int, int, int, torch.device]:
    """Join the process group and return ``rank, local_rank, world_size, device``."""
    rank, local_rank, world_size, local_world_size = read_topology()
    backend, device = pick_device(args.backend, local_rank, local_world_size)
    if device.type == "cpu" and local_world_size > 1:
        # The processes share the cores: more threads than their share (one each
        # on a small machine) would oversubscribe them. torchrun sets 1 already.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(min(torch.get_num_threads(), max(1, cores // local_world_size)))
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=args.timeout))  # fmt: skip
    except dist.DistNetworkError as err:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        if "EADDRINUSE" in str(err) or "already in use" in str(err):
            raise UsageError(f"port {where} is already in use; set MASTER_PORT to a free port.") from None
        raise UsageError(f"cannot reach the rendezvous at {where}; check MASTER_ADDR and MASTER_PORT.") from None
    return rank, local_rank, world_size, device


def print0(rank: int, *parts: object) -> None:
    """Print one line tagged with the rank, on rank 0 only."""
    if rank == 0:
        print(f"[rank {rank}]", *parts, flush=True)


# ---------------------------------------------------------------- data and model


def plan_data(samples: int, global_batch_size: int | None, world_size: int) -> tuple[int, int, int]:
    """Return ``train_samples, test_samples, global_batch_size`` for ``world_size`` processes.

    The global batch is a multiple of the world size and the training set a
    multiple of the global batch, so every rank gets the same, non-empty shard
    and the sampler pads nothing: each step sees the same samples whatever
    the world size. The test set has at least one sample per rank.
    """
    if global_batch_size is None:
        global_batch_size = math.ceil(64 / world_size) * world_size
    if global_batch_size < world_size:
        raise UsageError(f"the global batch ({global_batch_size}) is smaller than the number of processes "
                         f"({world_size}); give each process at least one sample with --global-batch-size.")
    if global_batch_size % world_size:
        raise UsageError(f"the global batch ({global_batch_size}) does not split evenly over {world_size} "
                         f"processes; use a multiple of {world_size}.")
    train_samples = math.ceil(samples / global_batch_size) * global_batch_size
    return train_samples, max(train_samples // 4, world_size), global_batch_size


def make_data(train_samples: int, test_samples: int, seed: int, dtype: torch.dtype) -> tuple[TensorDataset, TensorDataset]:
    """Return training and test sets: noisy points around one of 4 random centres, labelled by centre."""
    gen = torch.Generator().manual_seed(seed)
    centres = 1.5 * torch.randn(CLASSES, FEATURES, generator=gen, dtype=dtype)
    n = train_samples + test_samples
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    points = centres[labels] + torch.randn(n, FEATURES, generator=gen, dtype=dtype)
    return (TensorDataset(points[:train_samples], labels[:train_samples]),
            TensorDataset(points[train_samples:], labels[train_samples:]))  # fmt: skip


def build_model(seed: int, dtype: torch.dtype) -> nn.Module:
    """Return the classifier, initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)).to(dtype)


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
    found = [(int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := CHECKPOINT_NAME.fullmatch(p.name))]
    return max(found)[1] if found else None


def save_checkpoint(folder: Path, state: dict, keep: int) -> Path:
    """Write ``state`` atomically (temporary file, then rename) and drop all but the newest ``keep``."""
    path = folder / f"step-{state['step']:06d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # readers see the old file or the whole new one, never half of one
    old = sorted(p for p in folder.glob("step-*.pt") if CHECKPOINT_NAME.fullmatch(p.name))[:-keep]
    for stale in old:
        stale.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path, device: torch.device, config: dict) -> dict:
    """Load a checkpoint that rank 0 chose; every rank reads it to its own device."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception:  # a truncated file raises one of several types, depending on where it breaks
        state = None
    if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
        raise UsageError(f"checkpoint {path} cannot be read (it is corrupt or not one of this script's); "
                         "delete it to resume from an older one.")
    for key in RESUME_KEYS:
        if state["config"].get(key) != config[key]:
            raise UsageError(f"checkpoint {path} was written with {key}={state['config'].get(key)}, not "
                             f"{config[key]}; use the same settings or another --checkpoint-dir.")
    return state


def agree_on_checkpoint(rank: int, folder: Path | None, device: torch.device, config: dict) -> dict | None:
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
        raise UsageError(failed[0][1] if failed[0][0] == 0 else f"on rank {failed[0][0]}: {failed[0][1]}")
    return state


# ---------------------------------------------------------------- training


@torch.no_grad()
def shard_accuracy(model: nn.Module, data: TensorDataset, rank: int, world_size: int, device: torch.device) -> float:
    """Return the accuracy over all of ``data``: each rank counts its shard, then the counts are summed."""
    points, labels = (t[rank::world_size].to(device) for t in data.tensors)
    counts = torch.tensor([(model(points).argmax(1) == labels).sum().item(), len(labels)], device=device)
    dist.all_reduce(counts)
    return counts[0].item() / counts[1].item()


def train(args: argparse.Namespace) -> None:
    rank, local_rank, world_size, device = setup_distributed(args)
    dtype = getattr(torch, args.dtype)
    train_samples, test_samples, global_batch = plan_data(args.samples, args.global_batch_size, world_size)
    micro_batch = global_batch // world_size
    steps_per_epoch = train_samples // global_batch
    total_steps = round(args.epochs * steps_per_epoch) if args.epochs else args.steps
    config = {"global_batch_size": global_batch, "lr": args.lr, "seed": args.seed, "samples": args.samples,
              "dtype": args.dtype, "steps": total_steps}  # fmt: skip

    # Who is where: every rank reports, rank 0 prints (lines tagged with rank 0 only).
    me = {"rank": rank, "local_rank": local_rank, "node_rank": node_rank(), "host": socket.gethostname(),
          "device": str(device), "threads": torch.get_num_threads(),
          "train_shard": train_samples // world_size, "test_shard": len(range(rank, test_samples, world_size))}
    ranks: list[dict] = [{}] * world_size
    dist.all_gather_object(ranks, me)
    hosts = len({r["host"] for r in ranks})
    print0(rank, f"{world_size} process(es) on {hosts} host(s), backend {dist.get_backend()}, "
                 f"device {device.type}, {me['threads']} thread(s) per process")
    print0(rank, f"{train_samples} training samples ({me['train_shard']} per rank), {test_samples} test samples; "
                 f"global batch {global_batch} = {world_size} x {micro_batch}; {args.dtype}")

    train_set, test_set = make_data(train_samples, test_samples, args.seed, dtype)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=micro_batch, sampler=sampler, pin_memory=device.type == "cuda")
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
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)  # broadcasts rank 0's weights

    def checkpoint() -> None:
        if rank == 0 and folder:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                     "losses": losses, "config": config}  # the unwrapped model: loadable without DDP
            print0(rank, f"saved checkpoint {save_checkpoint(folder, state, args.keep_checkpoints).name}")

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    while step < total_steps:
        epoch, skip = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for points, labels in itertools.islice(loader, skip, None):  # skip what a resumed run has done
            points, labels = points.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(ddp(points), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over all ranks here
            optimizer.step()
            step += 1
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # the loss of the whole global batch, for the log
            losses.append(mean_loss.item() / world_size)  # .item() waits for the device
            if step % args.log_every == 0 or step == total_steps:
                print0(rank, f"step {step:5d}/{total_steps}  epoch {epoch}  loss {losses[-1]:.4f}")
            if step % args.checkpoint_every == 0:
                checkpoint()
            if step == args.fail_at_step and rank == world_size - 1:
                marker = folder / f"failed-at-step-{step}"  # type: ignore[operator]
                if not marker.exists():
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean-up, no goodbye
            if step == total_steps:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if step % args.checkpoint_every:
        checkpoint()

    train_acc = shard_accuracy(model, train_set, rank, world_size, device)
    test_acc = shard_accuracy(model, test_set, rank, world_size, device)
    checksum, param_sum = param_checksum(model)
    done = step - start_step
    rate = done * global_batch / seconds if done else 0.0
    print0(rank, f"done: train accuracy {train_acc:.3f}, test accuracy {test_acc:.3f}; "
                 f"{done} steps in {seconds:.3g} s ({rate:,.0f} samples/s)")
    if rank == 0 and args.results:
        results = {**config, "world_size": world_size, "backend": dist.get_backend(), "device": device.type,
                   "hosts": hosts, "ranks": ranks, "micro_batch_size": micro_batch, "train_samples": train_samples,
                   "test_samples": test_samples, "start_step": start_step, "epochs": step / steps_per_epoch,
                   "losses": losses, "train_accuracy": train_acc, "test_accuracy": test_acc,
                   "train_seconds": seconds, "samples_per_second": rate, "param_checksum": checksum,
                   "param_sum": param_sum, "checkpoint": str(newest_checkpoint(folder)) if folder else None}
        tmp = Path(args.results + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, args.results)
    dist.destroy_process_group()


# ---------------------------------------------------------------- entry points


def run(args: argparse.Namespace) -> None:
    """Train; on bad input, print one sentence (rank 0) and exit with code 2."""
    try:
        train(args)
    except UsageError as err:
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            print(f"{SCRIPT}: error: {err}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


def spawned_worker(local_rank: int, args: argparse.Namespace, nprocs: int) -> None:
    """Entry point of a process started by ``mp.spawn``: it plays torchrun's part for the environment."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs))  # fmt: skip
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
