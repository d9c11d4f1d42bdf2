"""FSDP2 on a small GPT: each rank holds a shard of the model and of Adam's state.

    python fsdp_gpt.py                                                  # one process
    torchrun --standalone --nproc-per-node=4 fsdp_gpt.py --save ckpt    # four, here
    torchrun --standalone --nproc-per-node=4 fsdp_gpt.py --replicate 2  # HSDP, 2 x 2
    torchrun --standalone --nproc-per-node=2 fsdp_gpt.py --load ckpt    # resume on 2
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=fsdp fsdp_gpt.py --save ckpt  # each node
    srun --ntasks=4 --gpus-per-task=1 python fsdp_gpt.py --save ckpt    # SLURM

Every rank builds the same GPT (the course's model, from the sibling
gpt_model.py) from the same seed, applies ``fully_shard`` to each block
and then to the root (embeddings, final LayerNorm, head), and trains with Adam
on its slice of the same global batches of the Zen of Python, read as
characters (``--mixed-precision bf16``: gathered and computed in bfloat16,
gradients reduced in float32, the shards and Adam's state in ``--dtype``;
``--microbatches K``: gradient accumulation over K parts of each rank's slice,
reduce-scattered after the last part, or with ``--sync each`` after each;
``--replicate R``: HSDP, R replicas of the model, each sharded over N / R
processes, on a 2-D mesh; each process's gradients are reduce-scattered
within its replica and then all-reduced across the replicas, once per step).
``--save DIR`` writes a sharded checkpoint with torch.distributed.checkpoint
(each rank its own shards, into DIR.tmp, renamed to DIR once complete, on a
file system every node sees) and the full state gathered to rank 0
(DIR/full_state.pt, which loads into the plain model);
``--load DIR`` resumes from a sharded checkpoint saved by any number of
processes, with its sizes and settings. companion/checks/fsdp_memory.py
measures what each rank holds and sends.

Exit codes: 0 done; 1 crashed; 2 a bad launch or input, said in one sentence.
"""

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DeviceMesh, init_device_mesh

from distributed_setup import fail, launched, setup_distributed, where_it_ran
from gpt_model import (
    DTYPES,
    GPT,
    CharText,
    GPTConfig,
    build_model,
    global_batches,
    lm_loss,
)

# ---- settings and data

# FSDP2's mixed precision: gather and compute in param_dtype, reduce-scatter the
# gradients in reduce_dtype; the sharded parameters keep the model's dtype.
MIXED = {"bf16": MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)}
MODEL = ("n_layer", "n_head", "n_embd", "block_size")
SETTINGS = (*MODEL, "dtype", "batch_size", "seq_len", "lr", "seed")  # in meta.json


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The model's sizes: the flags', and the text's vocabulary."""
    return GPTConfig(len(CharText().chars), **{k: getattr(args, k) for k in MODEL})


def local_slice(t: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous slice of the global batch (dim 0)."""
    return t.tensor_split(dist.get_world_size())[dist.get_rank()]


# ---- parallelise: FSDP2, one unit per block and one for the rest


def fsdp_mesh(device_type: str, world_size: int, replicate: int = 1) -> DeviceMesh:
    """FSDP2's mesh: one row of processes, or for HSDP ``replicate`` rows (the
    replicas) of S processes; process r holds shard r % S of replica r // S."""
    if replicate == 1:
        return init_device_mesh(device_type, (world_size,))
    shape = (replicate, world_size // replicate)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def shard_model(model: GPT, mesh, reshard_after_forward=True, root=None, mixed=None):
    """``fully_shard`` each block, then the root, in place.

    ``reshard_after_forward``: whether a block frees its gathered parameters
    after its forward pass (and gathers them again for backward). ``root``:
    the same for the root; None leaves it to FSDP2, which keeps the root's
    gathered, since its backward pass begins at once. ``mixed``: a key of
    MIXED, or None for no mixed precision. A 2-D ``mesh`` makes it HSDP.
    """
    policy = MIXED[mixed] if mixed else MixedPrecisionPolicy()  # default: none
    for block in model.blocks:
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
        )
    return fully_shard(model, mesh=mesh, reshard_after_forward=root, mp_policy=policy)


# ---- train


def train_step(
    model: nn.Module,
    optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    microbatches: int = 1,
    sync: str = "last",
):
    """One Adam step on this rank's slice of a global batch, in ``microbatches``
    equal parts whose gradients add up (gradient accumulation); its loss, detached.

    ``sync``: "each" reduce-scatters every micro-batch's gradients, which
    stay sharded; "last" turns gradient sync off until the last micro-batch
    (``set_requires_gradient_sync``, FSDP2's ``no_sync``), so that every rank
    adds up whole, unsharded gradients and reduce-scatters them once.
    """
    optimizer.zero_grad(set_to_none=True)
    parts = zip(
        local_slice(x).tensor_split(microbatches),
        local_slice(y).tensor_split(microbatches),
    )
    losses = []
    for i, (xs, ys) in enumerate(parts):
        last = i == microbatches - 1
        model.set_requires_gradient_sync(last or sync == "each")
        model.set_requires_all_reduce(last)  # HSDP: across replicas once per step
        loss = lm_loss(model(xs), ys) / microbatches  # all-gathers per unit
        loss.backward()  # gathers again where resharded, reduce-scatters if synced
        losses.append(loss.detach())
    optimizer.step()  # on this rank's shards only
    return torch.stack(losses).sum()


def mean_over_ranks(loss: torch.Tensor) -> float:
    """The global batch's loss: the ranks' slices are equal, so the mean of theirs."""
    loss = loss.clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()  # .item(): waits for the device


# ---- checkpoint


def sharded_state(model: nn.Module, optimizer) -> dict:
    """The model's and Adam's state as DTensors: each rank's shards, no copies."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def full_state(model: nn.Module, optimizer) -> dict:
    """The whole state, every tensor all-gathered; kept by rank 0 only, on the CPU."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=full),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=full),
    }


def save_checkpoint(state: dict, folder: Path, meta: dict) -> None:
    """Every rank writes its shards into ``folder``.tmp, renamed to ``folder`` at
    the end: an interrupted save leaves the previous checkpoint whole."""
    tmp, old = (folder.with_name(folder.name + end) for end in (".tmp", ".old"))
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the remains of an interrupted save
    dist.barrier()  # before any rank writes there
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()  # every shard is on disk
    if dist.get_rank() == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
            folder.rename(old)  # folder.old stays whole until folder is
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def save_full_state(state: dict, path: Path) -> None:
    """Rank 0 writes the gathered state with ``torch.save``, via a temporary file."""
    if dist.get_rank() == 0:
        torch.save(state, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # readers see old or new, whole
    dist.barrier()


def read_meta(folder: Path) -> dict:
    """The checkpoint's meta.json; each way it can be missing or broken, one sentence."""
    hint = "give a directory that this script wrote with --save"
    old = folder.with_name(folder.name + ".old")
    if not folder.is_dir() and (old / "meta.json").is_file():  # stopped mid-rename
        fail(
            f"there is no checkpoint directory {folder}, but {old.name} holds the "
            f"one before an interrupted save; rename it to {folder.name}."
        )
    if not folder.is_dir():
        fail(f"there is no checkpoint directory {folder}; {hint}.")
    if not (folder / "meta.json").is_file():
        fail(
            f"{folder} holds no meta.json, so it is not a complete checkpoint of this "
            f"script (an interrupted save leaves {folder.name}.tmp); {hint}."
        )
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if not (
            isinstance(meta["step"], int) and set(SETTINGS) <= meta["settings"].keys()
        ):
            raise ValueError
    except (ValueError, KeyError, TypeError, AttributeError):
        fail(f"{folder / 'meta.json'} is not this script's; {hint}.")
    if not (folder / ".metadata").is_file():
        fail(f"{folder} lacks torch.distributed.checkpoint's .metadata file; {hint}.")
    return meta


def load_checkpoint(model: nn.Module, optimizer, folder: Path) -> None:
    """Load a sharded checkpoint, saved by any number of processes, into this sharding."""
    # get_state_dict gives Adam, which has no state before its first step, a step
    # with zero gradients and lr 0, so that there is state to load into.
    state = sharded_state(model, optimizer)
    # DCP logs a failed read on the root logger itself, with a traceback from
    # torch 2.14 on (torch/distributed/checkpoint/state_dict_loader.py): off for
    # this call only.
    logging.getLogger().disabled = True
    try:
        dcp.load(state, checkpoint_id=folder)
    except (dcp.CheckpointException, OSError, RuntimeError, ValueError) as err:
        # CheckpointException derives from BaseException: every rank raises it.
        fail(
            f"cannot read the sharded checkpoint in {folder} ({type(err).__name__}): "
            "it is damaged or incomplete; save it again with --save."
        )
    finally:
        logging.getLogger().disabled = False
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


# ---- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked before the processes meet. With --load, the checkpoint's
    settings are the defaults; ``args.meta`` is its meta.json (else None)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = fail  # a bad flag too: one sentence, without the usage lines
    add = parser.add_argument
    add("--steps", type=int, default=10, help="training steps (default: 10)")
    add(
        "--batch-size", type=int, default=8, help="global batch, sequences (default: 8)"
    )
    add("--seq-len", type=int, default=64, help="characters per sequence (default: 64)")
    add("--lr", type=float, default=3e-3, help="Adam's learning rate (default: 3e-3)")
    add("--seed", type=int, default=0, help="of the model and batches (default: 0)")
    add("--dtype", choices=DTYPES, default="float32", help="(default: float32)")
    add("--n-layer", type=int, default=2, help="transformer blocks (default: 2)")
    add("--n-head", type=int, default=4, help="attention heads (default: 4)")
    add("--n-embd", type=int, default=64, help="width, in features (default: 64)")
    add("--block-size", type=int, default=64, help="longest sequence (default: 64)")
    add(
        "--reshard-after-forward",
        choices=("on", "off"),
        default="on",
        help="free each block's gathered parameters after forward (default: on)",
    )
    add(
        "--mixed-precision",
        choices=MIXED,
        help="bf16: gather and compute in bfloat16, reduce in float32 (default: off)",
    )
    add(
        "--microbatches",
        type=int,
        default=1,
        help="gradient accumulation: parts of each rank's slice (default: 1)",
    )
    add("--replicate", type=int, default=1, help="HSDP's replicas (default: 1)")
    add(
        "--sync",
        choices=("last", "each"),
        default="last",
        help="reduce-scatter the gradients after the last micro-batch or each "
        "(default: last)",
    )
    add("--save", type=Path, help="checkpoint directory to write after training")
    add("--load", type=Path, help="checkpoint directory to resume from")
    add("--timeout", type=float, default=600, help="seconds to wait for the others")
    add("--results", help="a JSON file for rank 0's results")
    args = parser.parse_args(argv)
    meta = read_meta(args.load.resolve()) if args.load else None
    if meta:
        parser.set_defaults(**meta["settings"])  # the checkpoint's, unless given
        args = parser.parse_args(argv)
    args.meta = meta
    for key in (*MODEL, "dtype") if meta else ():  # these must match the shards
        given, saved = getattr(args, key), meta["settings"][key]
        if given != saved:
            flag = "--" + key.replace("_", "-")
            fail(f"{flag} {given} differs from the checkpoint's {saved}; leave it out.")
    world_size = launched().world_size
    if args.n_embd % args.n_head:
        fail(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}.")
    if args.batch_size % world_size:  # else the mean of the ranks' losses is wrong
        fail(
            f"--batch-size {args.batch_size} does not split evenly over {world_size} "
            f"processes; use a multiple of {world_size}."
        )
    if args.replicate < 1:
        fail(f"--replicate must be at least 1, not {args.replicate}.")
    if world_size % args.replicate:
        fail(
            f"--replicate {args.replicate} does not divide the {world_size} "
            "processes into equal replicas; give a divisor of the process count."
        )
    parts = world_size * args.microbatches  # equal micro-batches weigh alike
    if args.microbatches < 1:
        fail(f"--microbatches must be at least 1, not {args.microbatches}.")
    if args.batch_size % parts:
        fail(
            f"--batch-size {args.batch_size} does not split into {args.microbatches} "
            f"equal micro-batches on each of {world_size} processes; use a multiple "
            f"of {parts}."
        )
    if not 0 < args.seq_len <= min(args.block_size, 855):  # the text: 856 chars
        fail(f"--seq-len {args.seq_len} must be 1 to --block-size, under 856.")
    return args


@record
def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_distributed(args.timeout)
    model = build_model(model_config(args), args.seed, args.dtype, device)
    mesh = fsdp_mesh(device.type, world_size, args.replicate)
    on = args.reshard_after_forward == "on"
    shard_model(model, mesh, on, mixed=args.mixed_precision)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = args.meta["step"] if args.meta else 0
    if args.load:
        load_checkpoint(model, optimizer, args.load.resolve())
    losses = []
    batches = global_batches(args, device, start)
    for step, (x, y) in enumerate(batches, start):
        loss = train_step(model, optimizer, x, y, args.microbatches, args.sync)
        losses.append(mean_over_ranks(loss))
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    if args.save:
        settings = {k: getattr(args, k) for k in SETTINGS}
        meta = {"step": start + args.steps, "world_size": world_size}
        folder = args.save.resolve()
        save_checkpoint(
            sharded_state(model, optimizer), folder, meta | {"settings": settings}
        )
        save_full_state(full_state(model, optimizer), folder / "full_state.pt")
    steps = list(range(start, start + args.steps))
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump({**where_it_ran(device), "steps": steps, "losses": losses}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
