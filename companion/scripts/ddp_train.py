"""Train a small classifier with DistributedDataParallel, and resume it (chapter 09).

    python ddp_train.py                          # one process
    python ddp_train.py --spawn 2                # two, started by mp.spawn
    torchrun --standalone --nproc-per-node=2 ddp_train.py
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=run1 --max-restarts=3 ddp_train.py
    srun --ntasks-per-node=4 --gpus-per-task=1 python ddp_train.py
    sbatch ddp_train.sbatch                      # SLURM: one torchrun per node

Each process trains a replica of the model on its own shard of every global
batch (``DistributedSampler``); DDP averages the gradients, so every replica
takes the same step. Rank 0 logs, and writes a checkpoint every
``--checkpoint-every`` steps into ``--checkpoint-dir``, atomically; a run
resumes from the newest checkpoint there (torchrun's restarts rely on it), which
every rank must see alike (a file system every node sees).
With ``--results FILE`` rank 0 writes a JSON summary: losses, accuracies,
timing, and who ran where.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import gc
import itertools
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from distributed_setup import fail, launched, setup_distributed, where_it_ran

FEATURES, CLASSES, HIDDEN = 8, 4, 32  # a toy problem: 8-D points around 4 centres


def plan_data(samples: int, global_batch: int | None, world_size: int) -> tuple:
    """Return ``train_samples, test_samples, global_batch`` for ``world_size``.

    The global batch is a multiple of the world size and the training set a
    multiple of the global batch, so every rank gets an equal, non-empty shard
    and the sampler pads nothing: each step sees the same samples whatever the
    world size.
    """
    global_batch = global_batch or math.ceil(64 / world_size) * world_size
    if global_batch % world_size:
        fail(
            f"the global batch ({global_batch}) does not split evenly over "
            f"{world_size} processes; use a multiple of {world_size}"
        )
    train_samples = math.ceil(samples / global_batch) * global_batch
    return train_samples, max(train_samples // 4, world_size), global_batch


def make_data(train_samples: int, test_samples: int, seed: int, dtype: torch.dtype):
    """Training and test sets: noisy points around 4 centres, labelled by centre."""
    gen = torch.Generator().manual_seed(seed)
    centres = 1.5 * torch.randn(CLASSES, FEATURES, generator=gen, dtype=dtype)
    labels = torch.randint(0, CLASSES, (train_samples + test_samples,), generator=gen)
    points = centres[labels] + torch.randn(
        len(labels), FEATURES, generator=gen, dtype=dtype
    )
    split = train_samples
    return (
        TensorDataset(points[:split], labels[:split]),
        TensorDataset(points[split:], labels[split:]),
    )


def build_model(seed: int, dtype: torch.dtype) -> nn.Module:
    """Return the classifier, initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )
    return model.to(dtype)


def checkpoints(folder: Path) -> list[Path]:
    """The checkpoints in ``folder``, oldest first: by step, not by name."""
    return sorted(
        folder.glob("step-*.pt"), key=lambda p: int(p.stem.removeprefix("step-"))
    )


def save_checkpoint(folder: Path, state: dict, keep: int) -> Path:
    """Write ``state`` atomically (a temporary file, then a rename); keep ``keep``."""
    path = folder / f"step-{state['step']:06d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # readers see the old file or the whole new one
    for stale in checkpoints(folder)[:-keep]:
        stale.unlink(missing_ok=True)
    return path


def load_checkpoint(folder: Path, device: torch.device, config: dict) -> dict | None:
    """Return the newest checkpoint in ``folder`` on ``device`` (None if none)."""
    if not checkpoints(folder):
        return None
    path = checkpoints(folder)[-1]
    try:  # weights_only: a checkpoint holds tensors and numbers, never code
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch's own words say what is wrong
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        fail(f"cannot load {path}: {why}")
    if not isinstance(state, dict) or "config" not in state:
        fail(f"{path} is not one of this script's checkpoints; move it away")
    changed = [
        k for k in config if k != "steps" and state["config"].get(k) != config[k]
    ]
    if changed:
        fail(f"{path} was written with other settings ({', '.join(changed)})")
    return state


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset, device: torch.device) -> float:
    """The accuracy over ``data``: each rank counts its share, an all-reduce adds."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    points, labels = (t[rank::world_size].to(device) for t in data.tensors)
    correct = (model(points).argmax(1) == labels).sum()
    counts = torch.stack([correct, labels.new_tensor(len(labels))])
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def train(args: argparse.Namespace) -> None:
    rank, world_size, device = setup_distributed(args.timeout)
    dtype = getattr(torch, args.dtype)
    train_samples, test_samples, global_batch = plan_data(
        args.samples, args.global_batch_size, world_size
    )
    steps_per_epoch = train_samples // global_batch
    total = round(args.epochs * steps_per_epoch) if args.epochs else args.steps
    config = {
        "global_batch_size": global_batch,
        "lr": args.lr,
        "seed": args.seed,
        "samples": args.samples,
        "dtype": args.dtype,
        "steps": total,
    }
    me = {
        "rank": rank,
        "local_rank": launched().local_rank,
        "host": socket.gethostname(),
        **where_it_ran(device),
        "train_shard": train_samples // world_size,
    }
    ranks = [{}] * world_size
    dist.all_gather_object(ranks, me)  # who ran where, for the results
    train_set, test_set = make_data(train_samples, test_samples, args.seed, dtype)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(
        train_set, batch_size=global_batch // world_size, sampler=sampler
    )
    model = build_model(args.seed, dtype).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    folder = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if folder:
        folder.mkdir(parents=True, exist_ok=True)
    state = load_checkpoint(folder, device, config) if folder else None
    step, losses = (state["step"], state["losses"]) if state else (0, [])
    found = [0] * world_size
    dist.all_gather_object(found, step)  # a folder each node sees alike, or stop
    if len(set(found)) > 1:
        fail(
            f"the ranks resume from different steps {found}: put --checkpoint-dir "
            "on a file system that every node sees"
        )
    if state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    start_step = step
    if rank == 0:
        print(
            f"{world_size} process(es) on {device.type}, {dist.get_backend()}; global "
            f"batch {global_batch}; "
            + (f"resuming at step {step}" if state else "new run")
        )
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    pending: list[torch.Tensor] = []  # this rank's losses, still on the device

    def gather_losses() -> None:
        """Turn the pending losses into global-batch means: one all-reduce for many."""
        if pending:
            summed = torch.stack(pending)
            dist.all_reduce(summed)
            losses.extend(
                (summed / world_size).tolist()
            )  # .tolist() waits for the device
            pending.clear()

    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a clock means something only after this
    start = time.perf_counter()
    while step < total:
        epoch, done = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for points, labels in itertools.islice(loader, done, None):  # skip what is done
            points, labels = points.to(device), labels.to(device)
            loss = F.cross_entropy(ddp(points), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over all ranks here
            optimizer.step()
            step += 1
            pending.append(loss.detach())  # no sync, no collective: the log gathers
            if step % args.log_every == 0 or step == total:
                gather_losses()
                if rank == 0:
                    print(f"step {step:5d}/{total}  loss {losses[-1]:.4f}", flush=True)
            if folder and (step % args.checkpoint_every == 0 or step == total):
                gather_losses()  # on every rank: it is a collective
                if rank == 0:  # the unwrapped model: loadable without DDP
                    state = {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "step": step,
                        "losses": losses,
                        "config": config,
                    }
                    print(
                        "saved",
                        save_checkpoint(folder, state, args.keep_checkpoints).name,
                    )
            if step == total:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    results = {
        **config,
        **where_it_ran(device),
        "ranks": ranks,
        "start_step": start_step,
        "losses": losses,
        "train_accuracy": accuracy(model, train_set, device),
        "test_accuracy": accuracy(model, test_set, device),
        "train_seconds": seconds,
        "checkpoint": str(checkpoints(folder)[-1]) if folder else None,
    }
    if rank == 0:
        print(
            f"done: test accuracy {results['test_accuracy']:.3f}; "
            f"{step - start_step} steps in {seconds:.3g} s"
        )
        if args.results:
            Path(args.results).write_text(json.dumps(results, indent=1))
    del ddp
    gc.collect()  # no DDP reducer may outlive the group: it can hang destroying it
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    add("--epochs", type=float, help="passes over the data, instead of --steps")
    add(
        "--global-batch-size",
        "--batch-size",
        type=int,
        help="samples per step (default: about 64)",
    )
    add("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    add("--seed", type=int, default=0, help="seed of data, model, shuffle (default: 0)")
    add("--samples", type=int, default=2048, help="training samples (default: 2048)")
    add("--dtype", choices=["float32", "float64"], default="float32")
    add("--checkpoint-dir", default="", help="resume from and save checkpoints here")
    add("--checkpoint-every", type=int, default=50, help="steps (default: 50)")
    add("--keep-checkpoints", type=int, default=2, help="newest to keep (default: 2)")
    add("--log-every", type=int, default=50, help="steps between logs (default: 50)")
    add("--spawn", type=int, default=0, help="start this many processes with mp.spawn")
    add("--timeout", type=float, default=600, help="seconds to wait (default: 600)")
    add("--results", default="", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    counts = (
        args.steps,
        args.samples,
        args.checkpoint_every,
        args.keep_checkpoints,
        args.log_every,
        args.spawn + 1,
    )
    if min(counts) < 1 or (args.epochs is not None and args.epochs <= 0):
        parser.error(
            "steps, epochs, samples and the checkpoint and log counts must be positive"
        )
    return args


def spawned(local_rank: int, args: argparse.Namespace) -> None:
    """A process started by mp.spawn: it sets what torchrun would set, then trains."""
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(args.spawn),
        LOCAL_WORLD_SIZE=str(args.spawn),
    )
    train(args)


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.spawn and "RANK" not in os.environ:
        # mp.spawn pickles `spawned` by name and the new processes import this
        # file to find it: that is why mp.spawn needs a script, not a notebook.
        with socket.socket() as s:  # a free port for the processes to meet on
            s.bind(("127.0.0.1", 0))
            os.environ.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1])
            )
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # mp.spawn leaves threads to you
        try:
            mp.spawn(spawned, args=(args,), nprocs=args.spawn)
        except mp.ProcessExitedException as err:
            if err.exit_code != 2:
                raise
            sys.exit(2)  # a process said why in one sentence: no traceback here
    else:
        train(args)


if __name__ == "__main__":
    main()
