"""ConvNeXt with replicated parameters and activations sharded across processes (DTensor).

Launch lines:
    torchrun --standalone --nproc-per-node=4 convnext_sharded.py              # small model, halo exchange
    torchrun --standalone --nproc-per-node=4 convnext_sharded.py --conv-mode replicate
    torchrun --standalone --nproc-per-node=4 convnext_sharded.py --conv-mode naive   # shows the pitfall
    torchrun --standalone --nproc-per-node=4 convnext_sharded.py --full       # the large model; GPUs advised
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=convnext convnext_sharded.py                                # on each of 2 nodes
    srun --ntasks=4 --gpus-per-task=1 python convnext_sharded.py              # under SLURM

Every parameter is replicated on every process (``distribute_module``); the
input images are split along their width (``Shard(3)``) or, for comparison,
along the batch (``Shard(0)``), so each process computes the activations of its
slice only. Convolutions with padding need their neighbours' columns at a
slice's edges; DTensor in torch 2.14.1 does not fetch them: it runs the padded
convolution on each slice as if it were the whole image, labels the result
``Replicate()``, and the model either fails with a shape error or, worse,
returns a wrong number. ``--conv-mode`` picks the remedy for padded convs:

- ``halo``: each process receives the ``padding`` edge columns of its
  neighbours (point-to-point sends), convolves, and keeps its slice;
- ``replicate``: all-gather the input of each padded conv, convolve the whole
  image, keep the slice (simple, but each process holds full activations);
- ``naive``: let DTensor do it (wrong); the script shows a padded conv's
  wrong mean, then runs the model, which fails at its first residual add.

For each mode the script checks the loss and every gradient of the first step
against the unsharded model on the same input and prints the largest
differences; it counts the activations each process saves for backward,
times forward and backward passes, and reports each process's peak memory
(CUDA memory on GPUs, the process's peak resident set on a CPU). All
processes decide together: nccl with one GPU each when every process has a
GPU of its own, gloo on the CPUs otherwise.

Writes: log lines on rank 0; with ``--results FILE``, a JSON summary of every
mode (differences from the unsharded model, saved activations, timings).

Exit codes: 0 done, and the halo and replicate modes (if run) match the
unsharded model; 3 one of them does not (the naive mode is expected not to);
2 bad input (e.g. a process count that does not divide the sharded dim, or
more processes than the halo exchange allows), said in one sentence by rank 0;
1 anything unexpected. Needs PyTorch 2.5 or newer.
"""

import argparse
import collections
import copy
import datetime
import json
import os
import re
import resource
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
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
)  # noqa: E402
from torch.distributed.tensor import distribute_tensor, init_device_mesh  # noqa: E402


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


def print0(*args: object) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(*args, flush=True)


# ---------------------------------------------------------------- halo exchange
class HaloExchange(torch.autograd.Function):
    """Pad a width slice with ``halo`` columns from each neighbouring rank.

    Forward: send my first columns left and my last columns right, receive
    theirs; the outer edges of the image get zeros (the conv's own padding).
    Backward: the gradient of a received column belongs to the rank that sent
    it, so send it back and add it to that rank's edge columns.
    """

    @staticmethod
    def forward(
        ctx, local: torch.Tensor, halo: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
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


def exchange(to_left: torch.Tensor, to_right: torch.Tensor, group: dist.ProcessGroup):
    """Send ``to_left``/``to_right`` to the neighbours; return what they sent (zeros at the ends)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    from_left, from_right = torch.zeros_like(to_right), torch.zeros_like(to_left)
    ops = []
    if rank > 0:
        peer = dist.get_global_rank(group, rank - 1)
        ops += [
            dist.P2POp(dist.isend, to_left, peer, group),
            dist.P2POp(dist.irecv, from_left, peer, group),
        ]
    if rank < size - 1:
        peer = dist.get_global_rank(group, rank + 1)
        ops += [
            dist.P2POp(dist.isend, to_right, peer, group),
            dist.P2POp(dist.irecv, from_right, peer, group),
        ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return from_left, from_right


class PaddedConv2d(nn.Conv2d):
    """``nn.Conv2d`` that stays correct on width-sharded DTensors (see ``--conv-mode``)."""

    mode = "halo"  # set for the whole model by set_conv_mode()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width_sharded = isinstance(x, DTensor) and any(
            isinstance(p, Shard) and p.dim in (2, 3) for p in x.placements
        )
        if not width_sharded or self.mode == "naive" or self.padding == (0, 0):
            return super().forward(x)
        if self.mode == "replicate":
            return (
                super()
                .forward(x.redistribute(placements=[Replicate()]))
                .redistribute(placements=x.placements)
            )
        return self._halo_forward(x)

    def _halo_forward(self, x: DTensor) -> DTensor:
        if x.placements != (Shard(3),) or self.stride != (1, 1):
            raise UsageError(
                "the halo exchange here handles 1-D meshes, Shard(3) and stride 1 only."
            )
        halo = self.padding[1]
        local = x.to_local()
        if local.shape[-1] < halo:
            raise UsageError(
                f"each process holds {local.shape[-1]} columns here, fewer than the "
                f"halo of {halo}; "
                "use a wider input, fewer processes or --conv-mode replicate."
            )
        padded = HaloExchange.apply(local, halo, x.device_mesh.get_group())
        # Each rank's weight gradient covers its columns only: their sum is the
        # true gradient, which is what a Partial() placement says.
        weight = self.weight.to_local(grad_placements=[Partial()])
        bias = (
            self.bias.to_local(grad_placements=[Partial()])
            if self.bias is not None
            else None
        )
        out = F.conv2d(
            padded,
            weight,
            bias,
            padding=(self.padding[0], 0),
            dilation=self.dilation,
            groups=self.groups,
        )
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)


def set_conv_mode(mode: str) -> None:
    """Choose how every ``PaddedConv2d`` treats width-sharded input."""
    PaddedConv2d.mode = mode


# ---------------------------------------------------------------- the model
class LayerNorm2d(nn.Module):
    """Layer norm over the channel dim of an (N, C, H, W) tensor."""

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
    """ConvNeXt block: 7x7 depthwise conv, norm, 1x1 expand, GELU, 1x1 project, scaled residual."""

    def __init__(self, dim: int, layer_scale: float) -> None:
        super().__init__()
        self.dwconv = PaddedConv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = LayerNorm2d(dim)
        self.pwconv1 = nn.Conv2d(dim, 4 * dim, kernel_size=1)
        self.act = nn.GELU()
        self.pwconv2 = nn.Conv2d(4 * dim, dim, kernel_size=1)
        self.gamma = nn.Parameter(torch.full((dim, 1, 1), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pwconv2(self.act(self.pwconv1(self.norm(self.dwconv(x)))))
        return x + self.gamma * y


class ConvNeXt(nn.Module):
    """ConvNeXt: a patchify stem, stages of blocks joined by 2x2 downsampling, a linear head."""

    def __init__(
        self,
        depths: list[int],
        dims: list[int],
        classes: int,
        layer_scale: float = 1e-6,
    ) -> None:
        super().__init__()
        self.downsample = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0]))]
        )
        for d_in, d_out in zip(dims, dims[1:]):
            self.downsample.append(
                nn.Sequential(LayerNorm2d(d_in), nn.Conv2d(d_in, d_out, 2, stride=2))
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


# ---------------------------------------------------------------- measuring
def peak_memory(device: torch.device) -> int:
    """Peak bytes: CUDA memory allocated on a GPU, the process's peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )  # Linux reports KiB


def sync(device: torch.device) -> None:
    """Wait for queued kernels, so that the clock measures work, not launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full plain tensor."""
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for n, p in model.named_parameters()
    }


def local_storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage behind this rank's part of ``t``."""
    with torch.no_grad():
        return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def saved_bytes(fn, model: nn.Module):
    """Call ``fn``; return its result and the bytes of activations autograd saved for backward.

    Counts this rank's local storages once each, ``model``'s parameters
    excluded. Unlike a process's memory, this number is the same on every machine.
    """
    params = {local_storage(p).data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local_storage(t)
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def probe_naive_conv(model, reference, x, x_full) -> dict:
    """Run the first padded conv on width shards as DTensor does; compare its mean with the unsharded one."""
    probe = model.stages[0][0].dwconv(model.downsample[0](x))
    expected = (
        reference.stages[0][0].dwconv(reference.downsample[0](x_full)).mean().item()
    )
    # mean() of a tensor labelled Replicate just averages the local values: no error.
    value = probe.mean().full_tensor().item()
    print0(
        f"naive: the first padded conv says it returns {probe.placements} of shape "
        f"{tuple(probe.shape)}, "
        f"but rank 0 holds {tuple(probe.to_local().shape)}"
    )
    print0(
        f"naive: conv(x).mean() = {value:.6f} on rank 0, unsharded {expected:.6f}, "
        f"difference {abs(value - expected):.1e}"
    )
    return {
        "probe_mean": value,
        "reference_probe_mean": expected,
        "probe_diff": abs(value - expected),
    }


def time_steps(model, optimizer, x, y, iters: int, device: torch.device) -> dict:
    """Mean forward and backward seconds over ``iters`` training steps, after one warm-up step."""
    forward = backward = 0.0
    for i in range(iters + 1):
        sync(device)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        sync(device)
        t1 = time.perf_counter()
        optimizer.zero_grad()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        optimizer.step()
        if i > 0:  # the first step allocates memory and optimiser state
            forward, backward = forward + t1 - t0, backward + t2 - t1
    return {"forward_s": forward / iters, "backward_s": backward / iters}


def distribute_copy(reference: nn.Module, mesh) -> nn.Module:
    """A copy of ``reference`` with every parameter replicated on ``mesh``."""
    model = distribute_module(
        copy.deepcopy(reference), mesh
    )  # default: replicate every parameter
    for p in model.parameters():
        # A weight's gradient comes back Partial (each rank's slice adds one
        # term of the sum): all-reduce it to Replicate.
        p.register_hook(lambda grad: grad.redistribute(placements=[Replicate()]))
    return model


def run_mode(mode: str, reference, ref, x, y, x_full, args, mesh, device) -> dict:
    """Check one ``--conv-mode`` against the unsharded reference, then time it."""
    set_conv_mode(mode)
    model = distribute_copy(reference, mesh)
    result = {"conv_mode": mode}
    if mode == "naive" and args.shard_dim == 3:
        result.update(probe_naive_conv(model, reference, x, x_full))
    try:
        loss, saved = saved_bytes(lambda: F.cross_entropy(model(x), y), model)
    except (
        RuntimeError
    ) as exc:  # what the naive mode runs into at the first residual add
        error = str(exc).splitlines()[0]
        print0(f"{mode}: the model fails: {error}")
        return {**result, "model_error": error, "ok": False}
    loss.backward()
    grads = full_grads(model)
    grad_diff = max((grads[n] - g).abs().max().item() for n, g in ref["grads"].items())
    grad_scale = max(g.abs().max().item() for g in ref["grads"].values())
    loss_diff = abs(loss.full_tensor().item() - ref["loss"])
    ok = loss_diff <= args.tolerance and grad_diff <= args.tolerance * grad_scale
    ok = ok and result.get("probe_diff", 0.0) <= args.tolerance
    print0(
        f"{mode}: loss {loss.full_tensor().item():.6f} vs unsharded {ref['loss']:.6f}, "
        f"difference {loss_diff:.1e}; "
        f"largest gradient difference {grad_diff:.1e} ({grad_diff / grad_scale:.1e} "
        "of the largest gradient); "
        f"{'matches' if ok else 'DOES NOT MATCH'} the unsharded model"
    )
    print0(
        f"{mode}: activations saved for backward {saved / 2**20:.2f} MiB per process "
        f"(unsharded: {ref['saved'] / 2**20:.2f} MiB)"
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    timing = time_steps(model, optimizer, x, y, args.iters, device)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(
        ranks, {"rank": dist.get_rank(), **timing, "peak_bytes": peak_memory(device)}
    )
    memory = "CUDA memory" if device.type == "cuda" else "resident set"
    for r in ranks:
        print0(
            f"{mode}: rank {r['rank']} forward {r['forward_s'] * 1e3:.1f} ms, "
            f"backward {r['backward_s'] * 1e3:.1f} ms, peak {memory} "
            f"{r['peak_bytes'] / 2**20:.0f} MiB"
        )
    return {
        **result,
        "loss": loss.full_tensor().item(),
        "loss_diff": loss_diff,
        "grad_diff": grad_diff,
        "grad_rel_diff": grad_diff / grad_scale,
        "ok": ok,
        "saved_bytes": saved,
        "ranks": ranks,
    }


def main() -> None:
    parser = ArgumentParser(
        prog=SCRIPT,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--full", action="store_true", help="the seed's large ConvNeXt (default: small)"
    )
    parser.add_argument(
        "--shard-dim",
        type=int,
        default=3,
        choices=[0, 3],
        help="3: width, 0: batch (default: 3)",
    )
    parser.add_argument(
        "--conv-mode",
        nargs="+",
        default=["halo"],
        choices=["halo", "replicate", "naive"],
        help="padded convs on width shards; several run one after another (default: halo)",
    )
    parser.add_argument(
        "--iters", type=int, default=3, help="timed training steps (default: 3)"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="largest loss difference, and gradient difference relative to the largest gradient, "
        "that still counts as a match (default: 1e-5, float32)",
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
    config = FULL if args.full else SMALL
    world_size = read_topology()[2]
    shard_size = config["input"][args.shard_dim]
    if args.iters < 1 or args.timeout <= 0:
        parser.error("--iters must be at least 1 and --timeout positive.")
    if shard_size % world_size:
        parser.error(
            f"{world_size} processes do not divide the sharded dim ({shard_size}); use "
            "a divisor of it."
        )
    # The last stage's 7x7 convolutions need 3 columns from each neighbour (the halo).
    last_width = config["input"][3] // 4 // 2 ** (len(config["dims"]) - 1)
    if (
        args.shard_dim == 3
        and "halo" in args.conv_mode
        and last_width // world_size < 3
    ):
        most = max(n for n in range(1, last_width // 3 + 1) if shard_size % n == 0)
        parser.error(
            f"with {world_size} processes each holds {last_width // world_size} "
            "column(s) of the last "
            f"stage, fewer than the halo of 3; use at most {most} processes, or "
            "--conv-mode replicate."
        )

    rank, _, world_size, device = setup_distributed(args.timeout)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("sp",))
    torch.manual_seed(12)  # the same weights and data on every rank
    reference = ConvNeXt(config["depths"], config["dims"], config["classes"]).to(device)
    x_full = torch.randn(config["input"], device=device)
    y_full = torch.randint(config["classes"], (config["input"][0],), device=device)
    x = distribute_tensor(x_full, mesh, [Shard(args.shard_dim)])
    y = distribute_tensor(y_full, mesh, [Replicate()])
    n_params = sum(p.numel() for p in reference.parameters())
    print0(
        f"ConvNeXt depths {config['depths']} dims {config['dims']}, "
        f"{n_params / 1e6:.2f} M parameters, "
        f"input {config['input']} as Shard({args.shard_dim}) on {world_size} "
        "processes, "
        f"each holding {list(x.to_local().shape)}"
    )

    ref_loss, ref_saved = saved_bytes(
        lambda: F.cross_entropy(reference(x_full), y_full), reference
    )
    ref_loss.backward()
    ref = {"loss": ref_loss.item(), "saved": ref_saved, "grads": full_grads(reference)}
    modes = [
        run_mode(m, reference, ref, x, y, x_full, args, mesh, device)
        for m in args.conv_mode
    ]
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump(
                {
                    "config": config,
                    "world_size": world_size,
                    "shard_dim": args.shard_dim,
                    "device": device.type,
                    "reference_loss": ref["loss"],
                    "reference_saved_bytes": ref_saved,
                    "tolerance": args.tolerance,
                    "modes": modes,
                },
                f,
            )
    dist.destroy_process_group()
    wrong = [m["conv_mode"] for m in modes if m["conv_mode"] != "naive" and not m["ok"]]
    if wrong:
        fail(
            f"the {' and '.join(wrong)} mode(s) do not match the unsharded model "
            "within --tolerance "
            f"{args.tolerance:g}.",
            code=3,
        )


if __name__ == "__main__":
    run_main(main)
