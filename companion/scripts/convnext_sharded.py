"""A ConvNeXt whose activations are split across processes along the width (DTensor).

    python convnext_sharded.py                                         # one process
    torchrun --standalone --nproc-per-node=4 convnext_sharded.py       # halo exchange
    torchrun --standalone --nproc-per-node=4 convnext_sharded.py --conv-mode replicate
    torchrun --standalone --nproc-per-node=2 convnext_sharded.py --shard-dim 0
    srun --ntasks=4 --gpus-per-task=1 python convnext_sharded.py --full   # large model

Every parameter is replicated on every process (``distribute_module``) and the
input images are split along their width (``Shard(3)``), or along the batch
with ``--shard-dim 0``, so that each process computes the activations of its
slice only. A convolution with padding needs its neighbours' columns at the
edges of a slice. Torch 2.10 to 2.12 fetch them for DTensor inputs
(``torch/distributed/tensor/_tp_conv.py``), but their backward pass returns
wrong gradients (measured with torch 2.10); torch 2.13 and 2.14 do not fetch
them: they pad every slice with zeros as if it were the whole image and label
the result ``Replicate()`` (2.13 labels unpadded convolutions so too). So the
model's convolutions convolve each rank's slice themselves (``ShardedConv2d``),
and ``--conv-mode`` chooses what the padded ones do:

- ``halo``: each process receives the edge columns of its neighbours
  (point-to-point sends), convolves, and keeps its slice;
- ``replicate``: all-gather the input, convolve the whole image, keep the
  slice (simple, but each process then holds the whole activation);
- ``naive``: leave it to DTensor (wrong, in a way that depends on the version).

It trains the model with Adam on one batch of random images for ``--steps``
steps and prints the loss. companion/checks/convnext_vs_unsharded.py compares
each mode with the unsharded model and measures what each process keeps.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import copy
import itertools
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    init_device_mesh,
)

from distributed_setup import fail, launched, setup_distributed, where_it_ran

# ---- padded convolutions on width shards: a halo exchange


def exchange(to_left: torch.Tensor, to_right: torch.Tensor, group) -> tuple:
    """Send ``to_left`` and ``to_right`` to the neighbouring ranks; return what
    they sent (zeros at the outer edges of the image)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    from_left, from_right = torch.zeros_like(to_right), torch.zeros_like(to_left)
    ops = []
    for peer, send, receive in (
        (rank - 1, to_left, from_left),
        (rank + 1, to_right, from_right),
    ):
        if 0 <= peer < size:
            peer = dist.get_global_rank(group, peer)
            ops += [
                dist.P2POp(dist.isend, send, peer, group),
                dist.P2POp(dist.irecv, receive, peer, group),
            ]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return from_left, from_right


class HaloExchange(torch.autograd.Function):
    """Pad a width slice with ``halo`` columns from each neighbouring rank.

    Forward: send my first columns left and my last columns right, receive
    theirs. Backward: the gradient of a received column belongs to the rank
    that sent it, so send it back and add it to that rank's edge columns.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, halo: int, group) -> torch.Tensor:
        ctx.halo, ctx.group = halo, group
        left, right = exchange(
            local[..., :halo].contiguous(), local[..., -halo:].contiguous(), group
        )
        return torch.cat([left, local, right], dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h = ctx.halo
        grad_local = grad[..., h:-h].clone()
        from_left, from_right = exchange(
            grad[..., :h].contiguous(), grad[..., -h:].contiguous(), ctx.group
        )
        grad_local[..., :h] += from_left
        grad_local[..., -h:] += from_right
        return grad_local, None, None


class ShardedConv2d(nn.Conv2d):
    """``nn.Conv2d`` that convolves each rank's slice of width-sharded input
    itself, in the class-wide ``mode``, rather than leave it to DTensor."""

    mode = "halo"  # "halo", "replicate" or "naive"; see the module docstring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width_sharded = isinstance(x, DTensor) and Shard(3) in x.placements
        if not width_sharded or self.mode == "naive":
            return super().forward(x)
        halo, mesh = self.padding[1], x.device_mesh
        if halo and self.mode == "replicate":  # all-gather it, convolve, keep mine
            whole = x.redistribute(placements=[Replicate()]).to_local()
            weight, bias = self.weight.to_local(), self.bias.to_local()
            out = F.conv2d(
                whole,
                weight,
                bias,
                self.stride,
                self.padding,
                self.dilation,
                self.groups,
            )
            out = DTensor.from_local(out, mesh, [Replicate()], run_check=False)
            return out.redistribute(placements=x.placements)
        if x.placements != (Shard(3),) or self.dilation != (1, 1):
            raise NotImplementedError("a 1-D mesh and no dilation only")
        if self.stride[1] != (1 if halo else self.kernel_size[1]):
            raise NotImplementedError("stride 1 with padding, else kernel = stride")
        local = x.to_local()
        if halo:
            local = HaloExchange.apply(local, halo, mesh.get_group())
        # A rank's weight gradient covers its columns only: the true gradient is
        # the sum over ranks, which is what a Partial() placement says.
        weight = self.weight.to_local(grad_placements=[Partial()])
        bias = self.bias.to_local(grad_placements=[Partial()])
        out = F.conv2d(
            local, weight, bias, self.stride, (self.padding[0], 0), groups=self.groups
        )
        return DTensor.from_local(out, mesh, x.placements, run_check=False)


# ---- the model: ConvNeXt, as in PyTorch's DTensor example


class LayerNorm2d(nn.Module):
    """Layer norm over the channels of an (N, C, H, W) tensor: per pixel."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(1, keepdim=True)
        var = (x - mean).pow(2).mean(1, keepdim=True)
        x = (x - mean) / torch.sqrt(var + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class Block(nn.Module):
    """7x7 depthwise conv, norm, 1x1 expand, GELU, 1x1 project, scaled residual."""

    def __init__(self, dim: int, layer_scale: float) -> None:
        super().__init__()
        self.dwconv = ShardedConv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = LayerNorm2d(dim)
        self.pwconv1 = ShardedConv2d(dim, 4 * dim, kernel_size=1)
        self.act = nn.GELU()
        self.pwconv2 = ShardedConv2d(4 * dim, dim, kernel_size=1)
        self.gamma = nn.Parameter(torch.full((dim, 1, 1), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pwconv2(self.act(self.pwconv1(self.norm(self.dwconv(x)))))
        return x + self.gamma * y


class ConvNeXt(nn.Module):
    """A 4x4 patchify stem, stages of blocks joined by 2x2 downsampling, a head."""

    def __init__(self, depths: list, dims: list, classes: int, layer_scale=1e-6):
        super().__init__()
        stem = ShardedConv2d(3, dims[0], 4, stride=4)  # 4x4 patches
        self.downsample = nn.ModuleList([nn.Sequential(stem, LayerNorm2d(dims[0]))])
        for d_in, d_out in itertools.pairwise(dims):
            self.downsample.append(
                nn.Sequential(
                    LayerNorm2d(d_in), ShardedConv2d(d_in, d_out, 2, stride=2)
                )
            )
        self.stages = nn.ModuleList(
            nn.Sequential(*(Block(d, layer_scale) for _ in range(n)))
            for d, n in zip(dims, depths)
        )
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for down, stage in zip(self.downsample, self.stages):
            x = stage(down(x))
        return self.head(x.mean([-2, -1]))


SMALL = {
    "depths": [1, 1, 1],
    "dims": [16, 32, 64],
    "input": [2, 3, 32, 256],
    "classes": 10,
}
FULL = {
    "depths": [3, 3, 27, 3],
    "dims": [256, 512, 1024, 2048],
    "input": [7, 3, 512, 1024],
    "classes": 1000,
}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build_model(config: dict, dtype: str, device: torch.device) -> ConvNeXt:
    """The same ConvNeXt on every rank: initialised from seed 12, then cast."""
    torch.manual_seed(12)
    model = ConvNeXt(config["depths"], config["dims"], config["classes"])
    return model.to(device=device, dtype=DTYPES[dtype])


def example_batch(config: dict, dtype: str, device: torch.device) -> tuple:
    """Random images and labels: the same on every rank and every device."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(config["input"], generator=g, dtype=DTYPES[dtype])
    y = torch.randint(config["classes"], config["input"][:1], generator=g)
    return x.to(device), y.to(device)


# ---- parallelise: parameters replicated, activations sharded


def replicate_parameters(model: nn.Module, mesh) -> nn.Module:
    """A copy of ``model`` with every parameter a ``Replicate()`` DTensor."""
    model = distribute_module(copy.deepcopy(model), mesh)  # replicates by default
    for p in model.parameters():
        # A weight's gradient comes back Partial (each rank's slice adds one
        # term of the sum): all-reduce it to Replicate.
        p.register_hook(lambda grad: grad.redistribute(placements=[Replicate()]))
    return model


def shard_batch(x: torch.Tensor, y: torch.Tensor, mesh, shard_dim: int) -> tuple:
    """The images split along ``shard_dim``; the labels whole, or split with a
    split batch."""
    label_placement = Shard(0) if shard_dim == 0 else Replicate()
    return (
        distribute_tensor(x, mesh, [Shard(shard_dim)]),
        distribute_tensor(y, mesh, [label_placement]),
    )


# ---- train


def train_step(model: nn.Module, optimizer, x, y) -> float:
    """One Adam step; the loss of the whole batch."""
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.full_tensor().item()  # .item(): waits for the device


# ---- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--full", action="store_true", help="the example's large ConvNeXt")
    add("--shard-dim", type=int, choices=(0, 3), default=3, help="3: width, 0: batch")
    modes = ("halo", "replicate", "naive")
    add("--conv-mode", choices=modes, default="halo", help="(default: halo)")
    add("--steps", type=int, default=3, help="training steps (default: 3)")
    add("--lr", type=float, default=1e-4, help="Adam's learning rate (default: 1e-4)")
    add("--dtype", choices=DTYPES, default="float32", help="(default: float32)")
    add("--timeout", type=float, default=600, help="seconds to wait for the others")
    add("--results", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    args.config = FULL if args.full else SMALL
    world_size = launched().world_size
    split = args.config["input"][args.shard_dim]
    if args.steps < 1:
        fail(f"--steps must be at least 1, not {args.steps}.")
    if split % world_size:
        fail(f"{world_size} processes do not divide dim {args.shard_dim} ({split}).")
    # Each 7x7 convolution of the last stage needs 3 columns from a neighbour.
    last = split // 4 // 2 ** (len(args.config["dims"]) - 1) // world_size
    if args.shard_dim == 3 and args.conv_mode == "halo" and last < 3:
        fail(
            f"with {world_size} processes each holds {last} column(s) of the last "
            "stage, fewer than the halo of 3; use fewer processes, or --conv-mode "
            "replicate."
        )
    return args


@record
def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_distributed(args.timeout)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("sp",))
    ShardedConv2d.mode = args.conv_mode
    model = replicate_parameters(build_model(args.config, args.dtype, device), mesh)
    x, y = shard_batch(
        *example_batch(args.config, args.dtype, device), mesh, args.shard_dim
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        held = list(x.to_local().shape)
        print(
            f"input {args.config['input']} as Shard({args.shard_dim}) on "
            f"{world_size} processes, each holding {held}"
        )
    losses = []
    for step in range(args.steps):
        losses.append(train_step(model, optimizer, x, y))
        if rank == 0:
            print(f"step {step}  loss {losses[-1]:.6f}", flush=True)
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump({**where_it_ran(device), "losses": losses}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
