"""Train a small-input ResNet-18 with DistributedDataParallel, and time its parts.

Launch lines, from the repository's root folder (one process; two; two nodes of
four, run on each node; four SLURM tasks):
    python companion/scripts/ddp_resnet.py --data images.pt
    torchrun --standalone --nproc-per-node=2 companion/scripts/ddp_resnet.py \\
        --data images.pt
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=run1 \\
        companion/scripts/ddp_resnet.py --data images.pt
    srun --ntasks=4 --gpus-per-task=1 \\
        python companion/scripts/ddp_resnet.py --data images.pt

``--data`` names a file written with ``torch.save`` holding a dict of four
tensors, ``train_images`` and ``test_images`` (float, ``(N, C, H, W)``) and
``train_labels`` and ``test_labels`` (int64, ``(N,)``, classes 0 to K-1), and
optionally a ``name``; it is loaded with ``weights_only=True``, so it may hold
tensors, numbers and strings only. Without ``--data`` the script says so and
trains on synthetic images, which only shows that it runs.

Every process trains a replica of the model on its shard of each global batch
(``DistributedSampler``, incomplete last batches dropped); DDP averages the
gradients, so all replicas take the same step. After training, rank 0 reports
the test accuracy, and every process times three things in turn for
``--timing-steps`` rounds: a forward and backward pass with no gradient sync
(computation), an all-reduce of a buffer as large as the gradients
(communication), and a full DDP training step. All processes decide together:
nccl with one GPU each when every process has a GPU of its own, gloo on the
CPUs otherwise.

Writes: log lines on rank 0; with ``--results FILE``, a JSON summary (loss
curve, test accuracies, throughput, the timings) written by rank 0.

Exit codes: 0 done; 2 bad input (arguments, data file, batch sizes), said in
one sentence on stderr by rank 0; 1 anything unexpected (a traceback).
Only torch and the standard library are imported: copy the file anywhere.
"""

import argparse
import collections
import datetime
import json
import os
import pickle
import re
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).name
MIN_TORCH = (2, 4)  # init_process_group(device_id=...)


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
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

DATA_KEYS = ("train_images", "train_labels", "test_images", "test_labels")


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog=SCRIPT,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--data",
        default="",
        help="tensors saved with torch.save (default: synthetic images)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=10,
        help="passes over the training set (default: 10)",
    )
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=128,
        help="images per step over all processes, a multiple of the world size (default: 128)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=0.1,
        help="peak SGD learning rate, annealed to 0 (default: 0.1)",
    )
    parser.add_argument(
        "--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)"
    )
    parser.add_argument(
        "--width",
        type=int,
        default=64,
        help="channels of the first stage, doubled at each of the 3 others; "
        "64 is ResNet-18 (default: 64)",
    )
    parser.add_argument(
        "--max-train",
        type=int,
        default=0,
        help="use the first N training images (default: 0 = all)",
    )
    parser.add_argument(
        "--max-test",
        type=int,
        default=0,
        help="use the first N test images (default: 0 = all)",
    )
    parser.add_argument(
        "--timing-steps",
        type=int,
        default=10,
        help="rounds of the timing phase after training (default: 10; 0 skips it)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model and the shuffling (default: 0)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the processes wait for each other, in each collective too "
        "(default: 600, PyTorch's own)",
    )
    parser.add_argument(
        "--results",
        default="",
        help="JSON file that rank 0 writes at the end (default: none)",
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "global_batch_size", "width"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, not "
                f"{getattr(args, name)}."
            )
    for name in ("max_train", "max_test", "timing_steps"):
        if getattr(args, name) < 0:
            parser.error(
                f"--{name.replace('_', '-')} must not be negative, not "
                f"{getattr(args, name)}."
            )
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, not {args.timeout}.")
    return args


def print0(rank: int, *parts: object) -> None:
    """Print one line on rank 0 only."""
    if rank == 0:
        print(*parts, flush=True)


def synchronize(device: torch.device) -> None:
    """Wait for the queued GPU kernels, so that a clock reading means something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- model


class Residual(nn.Module):
    """ResNet's basic block: two 3x3 convolutions plus a shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(
            in_channels, out_channels, 3, stride=stride, padding=1, bias=False
        )
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        # A 1x1 convolution matches the shortcut's shape when the block
        # changes the number of channels or the resolution.
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


def resnet18(
    num_classes: int = 10, in_channels: int = 1, width: int = 64
) -> nn.Sequential:
    """Return ResNet-18 for small images such as 28x28 or 32x32.

    Unlike the ImageNet model, the stem is a 3x3 convolution with stride 1 and
    no max pooling, so that a 28x28 image still has 4x4 pixels left in the last
    stage. Four stages of two blocks each have ``width``, 2, 4 and 8 times
    ``width`` channels; ``width=64`` is ResNet-18 (11 million parameters).
    """
    widths = [width, 2 * width, 4 * width, 8 * width]
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
    ]
    for stage, channels in enumerate(widths):
        stride = (
            1 if stage == 0 else 2
        )  # halve the resolution at the start of stages 2 to 4
        previous = widths[max(stage - 1, 0)]
        layers += [Residual(previous, channels, stride), Residual(channels, channels)]
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(widths[-1], num_classes),
    ]
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- data


def load_data(
    path: str, max_train: int, max_test: int, seed: int
) -> tuple[TensorDataset, TensorDataset, str]:
    """Return the training set, the test set and the data set's name."""
    if not path:
        train, test = make_synthetic_data(seed)
        name = "synthetic images (no --data given: the accuracy only shows that training runs)"
    else:
        blob = read_data_file(path)
        missing = [
            k
            for k in DATA_KEYS
            if not isinstance(blob, dict) or not isinstance(blob.get(k), torch.Tensor)
        ]
        if missing:
            raise UsageError(
                f"{path} lacks the tensors {', '.join(missing)}; it needs a dict with "
                f"{', '.join(DATA_KEYS)} (see --help)."
            )
        for split in ("train", "test"):
            images, labels = blob[f"{split}_images"], blob[f"{split}_labels"]
            if (
                images.dim() != 4
                or labels.dim() != 1
                or len(images) != len(labels)
                or len(labels) == 0
            ):
                raise UsageError(
                    f"{path}: {split}_images must be (N, C, H, W) and {split}_labels "
                    "(N,) "
                    f"with the same N > 0, not {tuple(images.shape)} and "
                    f"{tuple(labels.shape)}."
                )
        train = TensorDataset(blob["train_images"].float(), blob["train_labels"].long())
        test = TensorDataset(blob["test_images"].float(), blob["test_labels"].long())
        name = str(blob.get("name", Path(path).name))
    if max_train:
        train = TensorDataset(*(t[:max_train] for t in train.tensors))
    if max_test:
        test = TensorDataset(*(t[:max_test] for t in test.tensors))
    return train, test, name


def read_data_file(path: str) -> object:
    """``torch.load`` with ``weights_only=True``; each way it can fail gets its own sentence."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UsageError(
            f"there is no data file {path} on {socket.gethostname()}; save one with "
            "torch.save "
            "(see --help)."
        ) from None
    except pickle.UnpicklingError as err:
        if "weights only" in str(err).lower():
            raise UsageError(
                f"{path} holds Python objects that loading would have to run as code, "
                "so it was "
                "refused; save plain tensors in a dict (see --help)."
            ) from None
    except (MemoryError, OSError, RuntimeError) as err:
        if (
            isinstance(err, (MemoryError, OSError)) or "memory" in str(err).lower()
        ):  # not the file's fault
            detail = str(err).splitlines()[0] if str(err) else "no detail"
            raise UsageError(
                f"cannot read {path} ({type(err).__name__}: {detail}); the file itself "
                "may be "
                "fine."
            ) from None
    except Exception:  # noqa: S110 - a damaged file raises one of several types, depending on where it breaks
        pass
    raise UsageError(
        f"{path} is truncated or not a file written with torch.save; save it again "
        "(see --help)."
    )


def make_synthetic_data(
    seed: int, n_train: int = 1024, n_test: int = 256
) -> tuple[TensorDataset, TensorDataset]:
    """Return random 1x28x28 images labelled by a random linear "teacher" (10 classes)."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.rand(n_train + n_test, 1, 28, 28, generator=gen)
    teacher = torch.randn(28 * 28, 10, generator=gen)
    labels = (images.flatten(1) @ teacher).argmax(dim=1)
    return (
        TensorDataset(images[:n_train], labels[:n_train]),
        TensorDataset(images[n_train:], labels[n_train:]),
    )


# ---------------------------------------------------------------- training


@torch.no_grad()
def evaluate(
    model: nn.Module,
    test: TensorDataset,
    rank: int,
    world_size: int,
    device: torch.device,
) -> float:
    """Return the test accuracy; each rank scores every world_size-th image."""
    # BatchNorm's running statistics differ slightly between ranks (each saw
    # its own shards): evaluate every rank with rank 0's.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    images, labels = (t[rank::world_size] for t in test.tensors)
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, total
    for X, y in zip(images.split(256), labels.split(256)):
        X, y = X.to(device), y.to(device)
        counts[0] += (model(X).argmax(dim=1) == y).sum()
        counts[1] += len(y)
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def train(
    args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> dict:
    """Train, evaluate and time; return the results (the same on every rank)."""
    if args.global_batch_size % world_size:
        raise UsageError(
            f"the global batch ({args.global_batch_size}) does not split evenly over "
            f"{world_size} processes; use a multiple of {world_size}."
        )
    # Every rank reads the data; if one cannot (a file missing on one node), all
    # stop together.
    error, loaded = "", None
    try:
        loaded = load_data(args.data, args.max_train, args.max_test, args.seed)
    except UsageError as err:
        error = str(err)
    errors = [""] * world_size
    dist.all_gather_object(errors, error)
    if any(errors):
        first = next(r for r, e in enumerate(errors) if e)
        raise UsageError(
            errors[first] if first == 0 else f"on rank {first}: {errors[first]}"
        )
    train_set, test_set, data_name = loaded
    micro_batch_size = args.global_batch_size // world_size
    if len(train_set) < args.global_batch_size:
        raise UsageError(
            f"{len(train_set)} training images are fewer than one global batch "
            f"({args.global_batch_size}); lower --global-batch-size."
        )
    print0(
        rank,
        f"Data: {data_name}, {len(train_set):,} training and {len(test_set):,} test "
        "images.",
    )

    torch.manual_seed(
        args.seed
    )  # the same initial model everywhere (DDP also broadcasts rank 0's)
    num_classes = int(max(train_set.tensors[1].max(), test_set.tensors[1].max())) + 1
    model = resnet18(
        num_classes, in_channels=train_set.tensors[0].shape[1], width=args.width
    ).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(
        ddp_model.parameters(), lr=args.lr, momentum=args.momentum
    )
    # Each rank draws its own shard of every global batch; drop_last keeps
    # the number of steps equal on all ranks.
    sampler = DistributedSampler(
        train_set, world_size, rank, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(
        train_set, batch_size=micro_batch_size, sampler=sampler, drop_last=True
    )
    # The learning rate falls from --lr to 0 along a cosine: the last steps
    # barely move the weights, so BatchNorm's running statistics, which
    # evaluation uses, catch up with them even in a short run.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.epochs * len(loader)
    )
    n_params = sum(p.numel() for p in model.parameters())
    print0(
        rank,
        f"ResNet-18 (width {args.width}): {n_params:,} parameters; {world_size} "
        "process(es) x "
        f"{torch.get_num_threads()} thread(s), backend {dist.get_backend()}, global "
        "batch "
        f"{args.global_batch_size} = {world_size} x {micro_batch_size}.",
    )

    losses, accuracies, train_time, images_seen = [], [], 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        epoch_losses = []
        synchronize(device)
        start = time.perf_counter()
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp_model(X), y)
            loss.backward()  # DDP all-reduces the gradients here, bucket by bucket
            optimizer.step()
            schedule.step()
            epoch_losses.append(loss.detach())
        synchronize(device)
        elapsed = time.perf_counter() - start
        train_time += elapsed
        images_seen += len(epoch_losses) * args.global_batch_size
        # One all-reduce per epoch turns each rank's losses into the global batch's.
        step_losses = torch.stack(epoch_losses)
        dist.all_reduce(step_losses)
        losses += (step_losses / world_size).tolist()
        accuracies.append(evaluate(model, test_set, rank, world_size, device))
        print0(
            rank,
            f"epoch {epoch + 1}/{args.epochs}: loss "
            f"{step_losses.mean().item() / world_size:.3f}, "
            f"test accuracy {accuracies[-1]:.1%}, {elapsed:.2f} s, "
            f"{len(epoch_losses) * args.global_batch_size / elapsed:.0f} images/s",
        )

    results = {
        "world_size": world_size,
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "device": device.type,
        "data": data_name,
        "width": args.width,
        "parameters": n_params,
        "epochs": args.epochs,
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": micro_batch_size,
        "loss_curve": losses,  # the global batch's mean loss at every step
        "steps_per_epoch": len(loader),
        "test_accuracy_curve": accuracies,
        "test_accuracy": accuracies[-1],
        "train_time": train_time,  # seconds, evaluation excluded
        "throughput": images_seen / train_time,  # images/s over all epochs
    }
    if args.timing_steps:
        results["timing"] = time_parts(
            ddp_model, optimizer, loader, args.timing_steps, device
        )
    return results


def time_parts(
    ddp_model: DDP,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    rounds: int,
    device: torch.device,
) -> dict:
    """Time computation alone, communication alone and full steps, interleaved.

    Each round times one of each, so a machine that slows down slows all three
    alike. Returns medians over the rounds (the first round warms up), taken
    on the slowest rank: a step waits for every rank.
    """
    batches = []
    while len(batches) < rounds + 1:  # cycle through the loader when it has few batches
        batches += [(X.to(device), y.to(device)) for X, y in loader]
    grad_numel = sum(p.numel() for p in ddp_model.parameters())
    buffer = torch.zeros(grad_numel, device=device)  # as many floats as the gradients
    times: dict[str, list[float]] = {"compute": [], "allreduce": [], "step": []}

    def timed(name: str, fn) -> None:
        dist.barrier()  # start together, so no rank's time includes waiting for another
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times[name].append(time.perf_counter() - start)

    def compute_only(X: torch.Tensor, y: torch.Tensor) -> None:
        with ddp_model.no_sync():  # backward without DDP's all-reduce
            F.cross_entropy(ddp_model(X), y).backward()

    def full_step(X: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ddp_model(X), y).backward()
        optimizer.step()

    for X, y in batches[: rounds + 1]:
        optimizer.zero_grad(set_to_none=True)
        timed("compute", lambda: compute_only(X, y))
        timed("allreduce", lambda: dist.all_reduce(buffer))
        timed("step", lambda: full_step(X, y))
    medians = torch.tensor(
        [statistics.median(v[1:]) for v in times.values()], dtype=torch.float64
    )
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    compute, allreduce, step = medians.tolist()
    micro_batch_size = len(batches[0][1])
    return {
        "rounds": rounds,
        "gradient_floats": grad_numel,
        "compute_time": compute,  # seconds: forward + backward of one micro-batch, no sync
        "compute_time_per_image": compute / micro_batch_size,
        "allreduce_time": allreduce,  # seconds: all-reduce of gradient_floats float32 values
        "step_time": step,  # seconds: a full DDP step (forward, backward + all-reduce, update)
        "step_throughput": micro_batch_size * dist.get_world_size() / step,  # images/s
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, _, world_size, device = setup_distributed(args.timeout)
    try:
        results = train(args, rank, world_size, device)
        if rank == 0 and args.results:
            Path(args.results).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
