"""Check convnext_sharded.py against the unsharded model; measure what each rank keeps.

    torchrun --standalone --nproc-per-node=4 \\
        companion/checks/convnext_vs_unsharded.py --conv-mode naive halo replicate

For each ``--conv-mode``, with the script's own model, batch and
parallelisation:

1. In float64 (the claim is equality; float32 convolutions differ between
   devices, TF32 in cuDNN included): the first padded convolution alone on
   the width-sharded input, its placement, the shape a rank holds and the
   mean against the unsharded convolution's; then the loss and every
   gradient of one step against the unsharded model on the whole batch,
   which every rank computes alone.
2. In float32, as one trains: the bytes autograd saves for backward on each
   rank (``companion.memory.SavedTensors``) and in the unsharded model, the
   forward and backward times of ``--iters`` steps after a warm-up (the
   device synchronised around each), and each rank's peak memory (CUDA
   memory on a GPU, reset per mode; on a CPU the peak resident set since
   the process started, which includes every earlier mode).

Rank 0 writes the results as JSON (``--results``). Used in chapter 11.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

from companion.memory import SavedTensors
from companion.scripts import convnext_sharded as cs

TOLERANCE = 1e-10  # float64: the loss's difference, and each gradient's relative one


def say(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a whole plain tensor."""
    return {
        n: p.grad.full_tensor() if isinstance(p.grad, cs.DTensor) else p.grad
        for n, p in model.named_parameters()
    }


def first_padded_conv(model, x) -> torch.Tensor:
    """The stem, then the first 7x7 convolution: the first padded one."""
    return model.stages[0][0].dwconv(model.downsample[0](x))


def compare(mode: str, reference, x_full, y_full, mesh, shard_dim: int) -> dict:
    """One step of ``mode`` in float64 against the unsharded model."""
    model = cs.replicate_parameters(reference, mesh)
    x, y = cs.shard_batch(x_full, y_full, mesh, shard_dim)
    result: dict = {"conv_mode": mode}
    if shard_dim == 3:
        probe = first_padded_conv(model, x)
        value = probe.mean().full_tensor().item()  # no error, whatever the label
        expected = first_padded_conv(reference, x_full).mean().item()
        result.update(
            probe_placements=[repr(p) for p in probe.placements],
            probe_local_shape=list(probe.to_local().shape),
            probe_global_shape=list(probe.shape),
            probe_diff=abs(value - expected),
        )
    try:  # a wrong label meets the residual add; or, alone, a halo to itself
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    except RuntimeError as err:
        return {**result, "model_error": str(err).splitlines()[0], "ok": False}
    ref_loss = F.cross_entropy(reference(x_full), y_full)
    reference.zero_grad()
    ref_loss.backward()
    ref, got = gradients(reference), gradients(model)
    result["loss_diff"] = abs(loss.full_tensor().item() - ref_loss.item())
    result["grad_rel_diff"] = max(  # each against its own parameter's largest
        (got[n] - g).abs().max().item() / (g.abs().max().item() or 1.0)
        for n, g in ref.items()
    )
    result["ok"] = max(result["loss_diff"], result["grad_rel_diff"]) <= TOLERANCE
    return result


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that the clock measures work, not launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure(model, x, y, iters: int, device: torch.device) -> dict:
    """Bytes saved in the first step; forward and backward times of ``iters`` more."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    params = list(model.parameters())
    forward, backward = [], []
    for i in range(iters + 1):  # the first step allocates the optimiser's state
        synchronize(device)
        t0 = time.perf_counter()
        with SavedTensors(exclude=params) as saved:
            loss = F.cross_entropy(model(x), y)
        synchronize(device)
        t1 = time.perf_counter()
        optimizer.zero_grad()
        loss.backward()
        synchronize(device)
        t2 = time.perf_counter()
        optimizer.step()
        if i == 0:
            saved_bytes = saved.nbytes
        else:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    return {
        "saved_bytes": saved_bytes,
        "forward_s": forward,
        "backward_s": backward,
        "peak_bytes": peak_bytes(device),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    modes = ("halo", "replicate", "naive")
    add("--conv-mode", nargs="+", choices=modes, default=["halo"], help="in turn")
    add("--shard-dim", type=int, choices=(0, 3), default=3, help="3: width, 0: batch")
    add("--iters", type=int, default=3, help="timed training steps")
    add("--timeout", type=float, default=300, help="seconds to wait for other ranks")
    add("--results", help="a JSON file for rank 0's results")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    for mode in args.conv_mode:  # the script's checks of the launch, for each mode
        cs.parse_args(["--conv-mode", mode, "--shard-dim", str(args.shard_dim)])
    config = cs.SMALL
    rank, world_size, device = cs.setup_distributed(args.timeout)
    mesh = cs.init_device_mesh(device.type, (world_size,), mesh_dim_names=("sp",))
    exact = cs.build_model(config, "float64", device)
    x64, y = cs.example_batch(config, "float64", device)
    model32, x32 = cs.build_model(config, "float32", device), x64.float()
    with SavedTensors(exclude=model32.parameters()) as unsharded:
        F.cross_entropy(model32(x32), y)
    modes = []
    for mode in args.conv_mode:
        cs.ShardedConv2d.mode = mode
        result = compare(mode, exact, x64, y, mesh, args.shard_dim)
        verdict = "matches" if result["ok"] else "does not match"
        say(f"{mode}: {verdict} the unsharded model (float64, within {TOLERANCE:g})")
        if result["ok"]:  # a wrong model's memory and time mean nothing
            model = cs.replicate_parameters(model32, mesh)
            x, y_sharded = cs.shard_batch(x32, y, mesh, args.shard_dim)
            ranks: list = [None] * world_size
            dist.all_gather_object(
                ranks, measure(model, x, y_sharded, args.iters, device)
            )
            result["ranks"] = ranks
            say(
                f"{mode}: activations saved for backward "
                f"{ranks[0]['saved_bytes'] / 2**20:.2f} MiB per process "
                f"(unsharded: {unsharded.nbytes / 2**20:.2f} MiB; float32)"
            )
        modes.append(result)
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump(
                {
                    **cs.where_it_ran(device),
                    "torch": torch.__version__.split("+")[0],
                    "world_size": world_size,
                    "config": config,
                    "shard_dim": args.shard_dim,
                    "tolerance": TOLERANCE,
                    "reference_saved_bytes": unsharded.nbytes,
                    "modes": modes,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
