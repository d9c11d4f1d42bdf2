"""Train a small-input ResNet-18 with DistributedDataParallel (chapter 08).

    python ddp_resnet.py --data images.pt                                 # one process
    torchrun --standalone --nproc-per-node=2 ddp_resnet.py --data images.pt
    srun --ntasks=4 --gpus-per-task=1 python ddp_resnet.py --data images.pt

``--data`` is a file written with ``torch.save``: a dict with ``train_images``
and ``test_images`` (float, N x C x H x W), ``train_labels`` and
``test_labels`` (int64, N, classes 0 to K-1) and optionally a ``name``. It is
loaded with ``weights_only=True``: tensors, numbers and strings only. Without
``--data`` the script trains on synthetic images, which only shows that it runs.

Each process trains a replica on its shard of every global batch
(``DistributedSampler``); DDP averages the gradients in ``backward()``. Rank 0
logs each epoch and, with ``--results FILE``, writes the loss curve, the test
accuracies and the throughput as JSON.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from distributed_setup import fail, setup_distributed, where_it_ran


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
        stride = 1 if stage == 0 else 2  # stages 2 to 4 halve the resolution
        previous = widths[max(stage - 1, 0)]
        layers += [Residual(previous, channels, stride), Residual(channels, channels)]
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(widths[-1], num_classes),
    ]
    return nn.Sequential(*layers)


def load_data(path: str, seed: int = 0) -> tuple[TensorDataset, TensorDataset, str]:
    """The training set, the test set and the data's name (synthetic without a path)."""
    if not path:
        gen = torch.Generator().manual_seed(seed)
        images = torch.rand(1280, 1, 28, 28, generator=gen)
        labels = (images.flatten(1) @ torch.randn(784, 10, generator=gen)).argmax(1)
        train, test = (images[:1024], labels[:1024]), (images[1024:], labels[1024:])
        return TensorDataset(*train), TensorDataset(*test), "synthetic images"
    try:  # weights_only: a data file may hold tensors, not code
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        fail(f"there is no data file {path}; save one with torch.save (see --help)")
    except Exception as err:  # noqa: BLE001 - a damaged file fails in several ways
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        fail(f"cannot load {path} ({why}); see --help")
    keys = [
        f"{split}_{kind}"
        for split in ("train", "test")
        for kind in ("images", "labels")
    ]
    if not isinstance(blob, dict) or not all(
        isinstance(blob.get(k), torch.Tensor) for k in keys
    ):
        fail(f"{path} must hold a dict of the tensors {', '.join(keys)} (see --help)")
    train, test = (
        TensorDataset(blob[f"{s}_images"].float(), blob[f"{s}_labels"].long())
        for s in ("train", "test")
    )
    return train, test, str(blob.get("name", Path(path).name))


@torch.no_grad()
def evaluate(model: nn.Module, test: TensorDataset, device: torch.device) -> float:
    """Return the test accuracy: each rank scores every world_size-th image."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for buffer in model.buffers():  # BatchNorm's statistics: rank 0's for everyone
        dist.broadcast(buffer, src=0)
    model.eval()
    images, labels = (t[rank::world_size] for t in test.tensors)
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, seen
    for X, y in zip(images.split(256), labels.split(256)):
        X, y = X.to(device), y.to(device)
        counts[0] += (model(X).argmax(dim=1) == y).sum()
        counts[1] += len(y)
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def train(
    args: argparse.Namespace,
    train_set: TensorDataset,
    test_set: TensorDataset,
    device: torch.device,
) -> tuple[DDP, dict]:
    """Train with DDP; return the wrapped model and the results (same on all ranks)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.global_batch_size % world_size or len(train_set) < args.global_batch_size:
        fail(
            f"the global batch ({args.global_batch_size}) must split evenly over "
            f"{world_size} processes and fit in {len(train_set)} training images"
        )
    torch.manual_seed(args.seed)  # the same model on every rank (DDP broadcasts it too)
    classes = int(torch.cat([train_set.tensors[1], test_set.tensors[1]]).max()) + 1
    model = resnet18(classes, train_set.tensors[0].shape[1], args.width).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    # Each rank draws its shard of every global batch; drop_last keeps the
    # number of steps equal on all ranks.
    sampler = DistributedSampler(
        train_set, shuffle=True, seed=args.seed, drop_last=True
    )
    micro_batch = args.global_batch_size // world_size
    loader = DataLoader(
        train_set, batch_size=micro_batch, sampler=sampler, drop_last=True
    )
    # A cosine schedule down to 0: BatchNorm's running statistics, which
    # evaluation uses, catch up with the weights in the last, small steps.
    steps = args.epochs * len(loader)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    losses, accuracies, seconds = [], [], 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        epoch_losses = []
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a clock means something only after this
        start = time.perf_counter()
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            loss = F.cross_entropy(ddp_model(X), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here, bucket by bucket
            optimizer.step()
            schedule.step()
            epoch_losses.append(loss.detach())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - start
        mean_losses = torch.stack(epoch_losses)  # this rank's; then the global batch's
        dist.all_reduce(mean_losses)
        losses += (mean_losses / world_size).tolist()
        accuracies.append(evaluate(model, test_set, device))
        if rank == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}: loss {losses[-1]:.3f}, "
                f"test accuracy {accuracies[-1]:.1%}",
                flush=True,
            )
    results = {
        **where_it_ran(device),
        "width": args.width,
        "parameters": sum(p.numel() for p in model.parameters()),
        "epochs": args.epochs,
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": micro_batch,
        "steps_per_epoch": len(loader),
        "loss_curve": losses,  # the global batch's mean loss, step by step
        "test_accuracy_curve": accuracies,
        "test_accuracy": accuracies[-1],
        "train_time": seconds,  # evaluation excluded
        "throughput": steps * args.global_batch_size / seconds,  # images per second
    }
    return ddp_model, results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--data", default="", help="a torch.save file of images (default: synthetic)")
    add("--epochs", type=int, default=10, help="passes over the data (default: 10)")
    add(
        "--global-batch-size",
        "--batch-size",
        type=int,
        default=128,
        help="images per step (default: 128)",
    )
    add("--lr", type=float, default=0.1, help="peak SGD learning rate (default: 0.1)")
    add("--width", type=int, default=64, help="channels of stage 1; 64 is ResNet-18")
    add("--seed", type=int, default=0, help="seed of the model and the shuffling")
    add("--timeout", type=float, default=600, help="seconds to wait (default: 600)")
    add("--results", default="", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    if min(args.epochs, args.global_batch_size, args.width) < 1:
        parser.error("--epochs, --global-batch-size and --width must be at least 1")
    return args


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world_size, device = setup_distributed(args.timeout)
    train_set, test_set, name = load_data(args.data, args.seed)
    if rank == 0:
        print(
            f"{name}: {len(train_set):,} training, {len(test_set):,} test images; "
            f"{world_size} process(es) on {device.type}",
            flush=True,
        )
    _, results = train(args, train_set, test_set, device)
    del _  # the DDP model
    if rank == 0 and args.results:
        Path(args.results).write_text(json.dumps({**results, "data": name}, indent=1))
    gc.collect()  # no DDP reducer may outlive the group: it can hang destroying it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
