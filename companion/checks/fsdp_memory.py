"""What fsdp_gpt.py holds and sends per rank, against the ZeRO-3 formulas.

    launch("checks/fsdp_memory.py", ["--steps", "5", "--save", DIR], nproc=4)
    torchrun --standalone --nproc-per-node=2 companion/checks/fsdp_memory.py --steps 3

It takes fsdp_gpt.py's flags (and ``--tolerance``; ``--dtype`` is float64
unless given, or the checkpoint's with ``--load``), runs the script's own
functions, and measures:

- the bytes each rank holds after the first step, from the local shards of
  the parameters, their gradients and Adam's state, against ZeRO-3 with
  FSDP2's split (dim 0 as ``torch.chunk`` cuts it, padded to ``ceil(rows /
  N)`` rows in storage); Adam's step counters are float32 scalars, whole on
  every rank;
- the collectives of every step (``companion.collectives``) and the
  unsharded parameter bytes between forward and backward, for three
  settings of ``reshard_after_forward``: "on" (the blocks; the root left to
  FSDP2, which keeps it), "off" and "all-on" (the root too), and for "on"
  with FSDP2's mixed precision ("on, bf16": gathered in bfloat16, reduced
  in float32), against their formulas; one process makes no collective;
- with ``--replicate R``, all of it for HSDP: R replicas, each sharded
  over N / R processes, whose reduce-scattered gradients are then
  all-reduced across the replicas, once per step;
- with two or more processes, gradient accumulation over 2 parts of each
  rank's slice, with the "on" sharding: its collectives, reduce-scattered
  after the last part or after each, and the bytes live as the second
  part's forward pass begins beyond those as the first began: the whole,
  unsharded gradients (sync last) or this rank's padded shard of them
  (sync each), and the first part's loss;
- each rank's peak during the last step: the bytes of its live tensors
  (``companion.memory.LiveTensors``: shards, Adam's state, gathered
  parameters, activations, gradients), and on CUDA the allocator's
  ``max_memory_allocated`` over the same step;
- with ``--save``, the script's two saves: the seconds on rank 0, the
  tensors each rank holds in the state it saves and their bytes, the files
  written, the growth of rank 0's peak resident memory (``ru_maxrss``, KiB)
  and, on CUDA, the peak allocated;
- the losses against the plain model trained by rank 0 in one process from
  step 0 (``companion.gpt.plain_losses``); with ``--mixed-precision`` they
  differ by bfloat16's rounding, so give a ``--tolerance`` such as 0.05.

Writes rank 0's results (``--results FILE``) for chapter 12. Exit codes: 0
every measurement meets its formula; 3 one missed, said in one sentence; 2 bad
input; 1 crashed. The formulas describe FSDP2 as torch 2.10 to 2.14 implement
it (counts verified on both; the accumulation's on 2.14).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import resource
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor

from companion.checks._shared import clock, every_rank, finish, print0, tolerance
from companion.collectives import CollectiveCounter
from companion.gpt import GPTConfig, plain_losses
from companion.memory import LiveTensors, shard_rows, tensor_bytes
from companion.scripts import fsdp_gpt

STEP_BYTES = 4  # Adam's step counter: a float32 scalar per parameter tensor
# reshard_after_forward of the blocks and of the root (None: FSDP2's choice),
# and the mixed precision (a key of fsdp_gpt.MIXED, or None).
SETTINGS = {
    "on": (True, None, None),
    "off": (False, False, None),
    "all-on": (True, True, None),
    "on, bf16": (True, None, "bf16"),
}
# Gradient accumulation, with the "on" sharding: micro-batches per rank and
# step, and whether the gradients are reduce-scattered after the last or each.
ACCUMULATION = {
    "on, 2 parts, sync last": (2, "last"),
    "on, 2 parts, sync each": (2, "each"),
}
GATHER_BYTES = {"bf16": 2}  # bytes per element gathered and computed with
REDUCE_BYTES = {"bf16": 4}  # bytes per element reduce-scattered with


def counted_settings(world_size: int) -> tuple[str, ...]:
    """The settings a run counts: accumulation's only with something to reduce."""
    return (*SETTINGS, *(ACCUMULATION if world_size > 1 else ()))


def units_of(model: nn.Module) -> list[dict]:
    """The FSDP units (each block, then the root) and their parameters' shapes."""
    units = [
        {"name": f"blocks.{i}", "parameters": []} for i in range(len(model.blocks))
    ]
    units.append({"name": "root", "parameters": []})
    for name, p in model.named_parameters():
        index = int(name.split(".")[1]) if name.startswith("blocks.") else -1
        units[index]["parameters"].append({"name": name, "shape": list(p.shape)})
    return units


def padded_shard(shape: list[int], world_size: int) -> int:
    """Elements each rank allocates for a parameter: ``ceil(rows / N)`` rows."""
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def measure_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of this rank's parameters, gradients and Adam state (after a step)."""
    params = list(model.parameters())
    state = [kv for per_param in optimizer.state.values() for kv in per_param.items()]
    steps = [v for k, v in state if k == "step"]
    return {
        "parameters": tensor_bytes(params),
        "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": tensor_bytes(v for k, v in state if k != "step"),
        "step_counters": {
            "count": len(steps),
            "bytes": tensor_bytes(steps)["local"],
            "dtype": sorted({str(v.dtype) for v in steps}),
            "sharded": any(isinstance(v, DTensor) for v in steps),
        },
    }


def predict_state(units: list[dict], world_size: int, rank: int, b: int) -> dict:
    """What ``measure_state`` should find on ``rank``: ZeRO-3 as FSDP2 splits dim 0."""
    shapes = [p["shape"] for u in units for p in u["parameters"]]
    owned = b * sum(
        shard_rows(s[0], world_size, rank) * math.prod(s[1:]) for s in shapes
    )
    padded = b * sum(padded_shard(s, world_size) for s in shapes)
    return {
        "parameters": {"local": owned, "storage": padded},
        # One flat buffer per unit: the reduce-scatter's output, padded.
        "gradients": {"local": owned, "storage": padded},
        # exp_avg and exp_avg_sq: zeros_like the local shard, without padding.
        "optimizer_state": {"local": 2 * owned, "storage": 2 * owned},
        "step_counters": {
            "count": len(shapes),
            "bytes": STEP_BYTES * len(shapes),
            "dtype": ["torch.float32"],
            "sharded": False,
        },
    }


def zero_formulas(n_params: int, n_tensors: int, world_size: int, b: int) -> dict:
    """Bytes per rank for Adam under each ZeRO stage: P params of b bytes, N ranks."""
    psi, n = n_params * b, world_size
    rows = {
        "no sharding (DDP)": (psi, psi, 2 * psi),
        "ZeRO-1": (psi, psi, 2 * psi / n),
        "ZeRO-2": (psi, psi / n, 2 * psi / n),
        "ZeRO-3": (psi / n, psi / n, 2 * psi / n),
    }
    kinds = ("parameters", "gradients", "optimizer_state")
    return {
        "P": n_params,
        "bytes_per_element": b,
        "N": n,
        "step_counters_bytes": STEP_BYTES * n_tensors,  # on top, in every row
        "stages": {stage: dict(zip(kinds, row)) for stage, row in rows.items()},
    }


def predict_communication(
    units: list[dict], n: int, b: int, setting: str, replicate: int = 1
) -> dict:
    """Collectives of one training step, the unsharded bytes after forward and,
    with gradient accumulation, the gradient bytes held between micro-batches,
    on each of ``replicate`` replicas sharded over ``n`` processes.

    Unit u's padded shard has S_u elements; its all-gather sends S_u and
    receives N S_u, its reduce-scatter sends N S_u and keeps S_u. Every unit
    all-gathers before forward; a unit that resharded after forward gathers
    again before backward. Elements are b bytes, or with mixed precision
    2 gathered (bfloat16) and 4 reduced (float32). In K micro-batches each
    unit gathers K times as often, and reduce-scatters K times (sync each)
    or once (sync last: until then every rank adds up the whole, unsharded
    gradients, the model's P b bytes, where sync each holds its padded
    shards). One process: no collectives. HSDP (``replicate`` R > 1)
    all-reduces each unit's reduced shard, S_u elements of the reduced
    dtype, across the R replicas, once per step (the script holds the
    earlier micro-batches' with ``set_requires_all_reduce(False)``); with
    n = 1 it all-reduces the whole gradients alone, as DDP would.
    """
    blocks, root, mixed = SETTINGS.get(setting, SETTINGS["on"])
    k, sync = ACCUMULATION.get(setting, (1, "each"))
    gather_b, reduce_b = GATHER_BYTES.get(mixed, b), REDUCE_BYTES.get(mixed, b)
    numel = {
        u["name"]: sum(padded_shard(p["shape"], n) for p in u["parameters"])
        for u in units
    }
    shard = {name: gather_b * s for name, s in numel.items()}  # gathered
    grads = {name: reduce_b * s for name, s in numel.items()}  # reduced
    resharded = {name: bool(root if name == "root" else blocks) for name in shard}
    kept = sum(n * s for name, s in shard.items() if not resharded[name])
    whole = reduce_b * sum(
        math.prod(p["shape"]) for u in units for p in u["parameters"]
    )
    # And the first part's loss, one element of b bytes, kept for the step's.
    held = {"last": whole, "each": sum(grads.values())}[sync] + b if k > 1 else None
    gathers = {name: k * (2 if resharded[name] else 1) for name in shard}
    reduces = k if sync == "each" else 1
    collectives = {}
    if n > 1:
        collectives["all-gather"] = {
            "calls": sum(gathers.values()),
            "input_bytes": sum(gathers[u] * s for u, s in shard.items()),
            "output_bytes": sum(gathers[u] * n * s for u, s in shard.items()),
        }
        collectives["reduce-scatter"] = {
            "calls": reduces * len(grads),
            "input_bytes": reduces * sum(n * s for s in grads.values()),
            "output_bytes": reduces * sum(grads.values()),
        }
    if replicate > 1:  # once per step, whatever the sync (set_requires_all_reduce)
        reduced = sum(grads.values())
        collectives["all-reduce"] = {
            "calls": len(grads),
            "input_bytes": reduced,
            "output_bytes": reduced,
        }
    return {
        "collectives": collectives,
        "unsharded_bytes_after_forward": kept,
        "gradient_bytes_between_microbatches": held,
    }


def unsharded_parameter_bytes(model: nn.Module) -> int:
    """Bytes behind the parameters that are unsharded now (plain tensors)."""
    return tensor_bytes(p for p in model.parameters() if not isinstance(p, DTensor))[
        "storage"
    ]


def held_at_start(model: nn.Module, optimizer, *batch: torch.Tensor) -> LiveTensors:
    """A ``LiveTensors`` that follows what the rank holds now: its parameter
    shards, their gradients, Adam's state and the batch (no reference kept
    here: what the step frees must die)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values()]
    return LiveTensors([*params, *grads, *state, *batch])


def train_counted(
    model: nn.Module,
    optimizer,
    batches: list,
    device,
    accumulation: tuple[int, str] = (1, "last"),
) -> dict:
    """Train with fsdp_gpt's ``train_step`` (in ``accumulation``'s micro-batches
    and sync); count every step's collectives, the unsharded bytes between the
    first forward and its backward, the state's bytes after the first step,
    while the gradients exist, and the peak of the last step (with Adam's
    state, from the second step on), and in it the bytes live as each
    micro-batch's forward pass begins."""
    run: dict[str, Any] = {"losses": [], "per_step": [], "live_at_forward": []}
    tensors: LiveTensors | None = None

    def before_forward(*_: object) -> None:
        if tensors is not None:
            run["live_at_forward"].append(tensors.live)

    def after_forward(*_: object) -> None:  # after FSDP2's own post-forward hook
        run.setdefault("after_forward", unsharded_parameter_bytes(model))

    hooks = [
        model.register_forward_pre_hook(before_forward),
        model.register_forward_hook(after_forward),
    ]
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        tensors = held_at_start(model, optimizer, x, y) if last else None
        if last and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with CollectiveCounter() as counter, tensors or contextlib.nullcontext():
            loss = fsdp_gpt.train_step(model, optimizer, x, y, *accumulation)
        if tensors is not None:
            run["peak"] = {"step": i, "bytes": tensors.peak, "cuda": cuda_peak(device)}
        run["per_step"].append(counter.total())
        run.setdefault("state", measure_state(model, optimizer))
        run["losses"].append(fsdp_gpt.mean_over_ranks(loss))
    for hook in hooks:
        hook.remove()
    return run


@contextlib.contextmanager
def measured(device: torch.device) -> Iterator[dict]:
    """Time a block that every rank runs, on rank 0, and record its memory."""
    record: dict[str, Any] = {}
    dist.barrier()  # everyone starts together
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss, start = max_rss_kib(), clock()
    yield record
    dist.barrier()  # and the last one to finish ends it
    record["seconds"] = clock() - start
    record["max_rss_growth_kib"] = max_rss_kib() - rss
    record["cuda_max_memory_allocated"] = cuda_peak(device)


def max_rss_kib() -> int:
    """Peak resident memory of this process so far, in KiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # macOS: bytes


def cuda_peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def held_tensors(state: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) state dict."""
    if isinstance(state, dict):
        return [t for v in state.values() for t in held_tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in held_tensors(v)]
    return [state] if isinstance(state, torch.Tensor) else []


def held_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict, local shards for DTensors."""
    return tensor_bytes(held_tensors(state))["local"]


def save_measured(model, optimizer, folder: Path, meta: dict, device) -> dict:
    """The script's two saves, each measured: sharded (DCP), then gathered."""
    with measured(device) as dcp:
        state = fsdp_gpt.sharded_state(model, optimizer)  # DTensors: no copies
        dcp["held_bytes_per_rank"] = every_rank(held_bytes(state))
        dcp["tensors_per_rank"] = every_rank(len(held_tensors(state)))
        fsdp_gpt.save_checkpoint(state, folder, meta)
    with measured(device) as gathered:
        state = fsdp_gpt.full_state(model, optimizer)  # on rank 0, on the CPU
        gathered["held_bytes_per_rank"] = every_rank(held_bytes(state))
        gathered["tensors_per_rank"] = every_rank(len(held_tensors(state)))
        fsdp_gpt.save_full_state(state, folder / "full_state.pt")
    del state
    files = [
        {"name": p.name, "bytes": p.stat().st_size}
        for p in sorted(folder.iterdir())
        if p.is_file()
    ]
    dcp["files"] = [f for f in files if f["name"] != "full_state.pt"]
    gathered["files"] = [f for f in files if f["name"] == "full_state.pt"]
    return {"path": str(folder), "dcp": dcp, "gathered": gathered}


def judge(run: dict, everyone: list[dict], reference: list[float], tol: float):
    """On rank 0: the results and the sentence for exit code 3 ("" if none)."""
    world, b, units = run["world_size"], run["dtype_bytes"], run.pop("units")
    replicate = run["replicate"]
    n = world // replicate  # the processes each replica is sharded over
    predicted_state = [predict_state(units, n, r % n, b) for r in range(world)]
    counted = counted_settings(world)
    predicted = {s: predict_communication(units, n, b, s, replicate) for s in counted}
    measured_states = [e["state"] for e in everyone]
    comm = everyone[0]["communication"]
    diff = max(abs(a - r) for a, r in zip(run["losses"], reference))
    checks = {
        "memory": measured_states == predicted_state,
        "communication": all(
            step == predicted[s]["collectives"]
            and e["communication"][s]["unsharded_bytes_after_forward"]
            == predicted[s]["unsharded_bytes_after_forward"]
            for e in everyone
            for s in counted
            for step in e["communication"][s]["per_step"]
        ),
        "losses": diff <= tol,
        "accumulation": all(
            e["communication"][s]["gradient_bytes_between_microbatches"]
            == predicted[s]["gradient_bytes_between_microbatches"]
            for e in everyone
            for s in ACCUMULATION
            if s in counted
        ),
    }
    results = {
        **run,
        "reference_losses": reference,
        "max_loss_diff": diff,
        "tolerance": tol,
        "memory": {
            "measured": measured_states,
            "predicted": predicted_state,
            "zero": zero_formulas(run["n_params"], run["n_param_tensors"], n, b),
            "units": [
                {
                    "name": u["name"],
                    "numel": sum(math.prod(p["shape"]) for p in u["parameters"]),
                    "padded_shard_numel": sum(
                        padded_shard(p["shape"], n) for p in u["parameters"]
                    ),
                    "parameters": [
                        p
                        | {
                            "rows_per_rank": [
                                shard_rows(p["shape"][0], n, r % n)
                                for r in range(world)
                            ],
                            "padded_rows": math.ceil(p["shape"][0] / n),
                        }
                        for p in u["parameters"]
                    ],
                }
                for u in units
            ],
        },
        "communication": {
            s: comm[s]
            | {
                "predicted": predicted[s]["collectives"],
                "predicted_unsharded_bytes_after_forward": predicted[s][
                    "unsharded_bytes_after_forward"
                ],
                "predicted_gradient_bytes_between_microbatches": predicted[s][
                    "gradient_bytes_between_microbatches"
                ],
                "gradient_bytes_between_microbatches_per_rank": [
                    e["communication"][s]["gradient_bytes_between_microbatches"]
                    for e in everyone
                ],
                "same_on_every_rank": all(
                    e["communication"][s]["per_step"] == comm[s]["per_step"]
                    for e in everyone
                ),
                "microbatches": ACCUMULATION.get(s, (1,))[0],
                "sync": ACCUMULATION.get(s, (1, None))[1],
            }
            for s in counted
        },
        "peak": {
            "step": everyone[0]["peak"]["step"],
            "bytes_per_rank": [e["peak"]["bytes"] for e in everyone],
        },
        "cuda_peak_bytes_per_rank": [e["peak"]["cuda"] for e in everyone]
        if run["device"] == "cuda"
        else None,
        "checks": checks,
    }
    mine = measured_states[0]
    print0(
        f"rank 0 holds {mine['parameters']['storage']} B of parameters, "
        f"{mine['gradients']['storage']} B of gradients and "
        f"{mine['optimizer_state']['storage'] + mine['step_counters']['bytes']} B of "
        f"Adam state; the model's parameters take {run['n_params'] * b} B"
    )
    peak = results["peak"]
    print0(
        f"rank 0's live tensors peaked at ~{peak['bytes_per_rank'][0]} B in step "
        f"{run['steps'][peak['step']]}"
    )
    for s in counted:
        said = [
            f"{v['calls']} {k}s ({v['output_bytes']} B out)"
            for k, v in comm[s]["per_step"][0].items()
        ]
        held = comm[s]["gradient_bytes_between_microbatches"]
        print0(
            f"reshard_after_forward {s:22s}: {', '.join(said) or 'no collectives'} "
            f"per step; {comm[s]['unsharded_bytes_after_forward']} B unsharded "
            "between forward and backward"
            + (f"; ~{held} B more live as the second part began" if held else "")
        )
    print0(
        "checks: "
        + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in checks.items())
        + f" (largest loss difference ~{diff:.1e})"
    )
    failures = {
        "losses": f"the losses ended {diff:.1e} from the plain one-process run, "
        f"beyond --tolerance {tol:g}",
        "memory": "the bytes a rank holds differ from the ZeRO-3 formula; see "
        "memory in the results",
        "communication": "the collectives of a step differ from their formula; "
        "see communication in the results",
        "accumulation": "the gradient bytes held between micro-batches differ "
        "from their formula; see communication in the results",
    }
    return results, next((failures[k] for k, ok in checks.items() if not ok), "")


@record
def main() -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--tolerance", type=float, help="of the losses (default: 1e-10)")
    mine, rest = own.parse_known_args()
    # float64 unless told (a resumed run keeps its checkpoint's): the losses are
    # compared with one process's to 1e-10.
    args = fsdp_gpt.parse_args(rest)
    if not args.meta:  # a --dtype of the user's, later in the list, still wins
        args = fsdp_gpt.parse_args(["--dtype", "float64", *rest])
    saved = args.meta["settings"] if args.meta else {}
    changed = [k for k, v in saved.items() if getattr(args, k) != v]
    if changed:  # the plain run that the losses are compared with starts at step 0
        flag = "--" + changed[0].replace("_", "-")
        fsdp_gpt.fail(f"{flag} differs from the checkpoint's; leave it out.")
    rank, world_size, device = fsdp_gpt.setup_distributed(args.timeout)
    wall = clock()
    config = fsdp_gpt.model_config(args)
    start = args.meta["step"] if args.meta else 0
    batches = fsdp_gpt.global_batches(args, device, start)
    mesh = fsdp_gpt.fsdp_mesh(device.type, world_size, args.replicate)
    hsdp = f", HSDP: {args.replicate} replicas" if args.replicate > 1 else ""
    print0(
        f"{world_size} process{'es' if world_size > 1 else ''} on {device.type}: "
        f"{config.n_layer} blocks of width {config.n_embd} in {args.dtype}, global "
        f"batch {args.batch_size} x {args.seq_len}, steps {start} to "
        f"{start + args.steps - 1}{hsdp}"
    )

    def sharded(setting: tuple) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = fsdp_gpt.build_model(config, args.seed, args.dtype, device)
        fsdp_gpt.shard_model(model, mesh, *setting)
        return model, torch.optim.Adam(model.parameters(), lr=args.lr)

    on = args.reshard_after_forward == "on"
    # As fsdp_gpt.main shards (its root's None keeps the root gathered, as False).
    chosen = (on, None if on else False, args.mixed_precision)
    model, optimizer = sharded(chosen)
    units = units_of(model)
    checkpoint: dict[str, Any] = {}
    if args.load:
        with measured(device) as checkpoint["load"]:
            fsdp_gpt.load_checkpoint(model, optimizer, args.load.resolve())
        checkpoint["load"] |= {"saved_by_world_size": args.meta["world_size"]}
        print0(
            f"loaded {args.load.name} (saved by {args.meta['world_size']} processes "
            f"at step {start}) in {checkpoint['load']['seconds']:.2f} s"
        )
    tic = clock()
    # The main run's micro-batches and sync (one micro-batch: nothing to sync).
    steps = (args.microbatches, args.sync if args.microbatches > 1 else "last")
    run = train_counted(model, optimizer, batches, device, steps)
    seconds = {"train": clock() - tic}
    for step, loss in enumerate(run["losses"], start):
        print0(f"step {step:3d}  loss {loss:.6f}")
    # One counted step of each other setting, on a fresh model: the counts and
    # sizes do not depend on the values.
    communication = {}
    for setting in counted_settings(world_size):
        values = SETTINGS.get(setting, SETTINGS["on"])
        accumulation = ACCUMULATION.get(setting, (1, "last"))
        counted = (
            run  # the main run's own setting: counted already
            if (values, accumulation) == (chosen, steps)
            else train_counted(*sharded(values), batches[:1], device, accumulation)
        )
        live = counted["live_at_forward"]  # as each micro-batch of the last step began
        communication[setting] = {
            "per_step": counted["per_step"],
            "unsharded_bytes_after_forward": counted["after_forward"],
            "gradient_bytes_between_microbatches": live[1] - live[0]
            if len(live) > 1
            else None,
        }
    if args.save:
        settings = {k: getattr(args, k) for k in fsdp_gpt.SETTINGS}
        meta = {
            "step": start + args.steps,
            "world_size": world_size,
            "settings": settings,
        }
        checkpoint["save"] = save_measured(
            model, optimizer, args.save.resolve(), meta, device
        )
        print0(
            f"saved {args.save.name}: sharded with DCP in "
            f"{checkpoint['save']['dcp']['seconds']:.3f} s, gathered to rank 0 and "
            f"torch.save in {checkpoint['save']['gathered']['seconds']:.3f} s"
        )
    everyone = every_rank(
        {"state": run["state"], "communication": communication, "peak": run["peak"]}
    )
    results, failure = None, ""
    if rank == 0:
        tic = clock()
        all_batches = fsdp_gpt.global_batches(args, device, 0, start + args.steps)
        reference = plain_losses(
            GPTConfig(**asdict(config)),
            all_batches,
            lr=args.lr,
            seed=args.seed,
            dtype=fsdp_gpt.DTYPES[args.dtype],
            device=device,
        )[start:]
        seconds["reference"] = clock() - tic
        seconds["total"] = clock() - wall
        shapes = [p["shape"] for u in units for p in u["parameters"]]
        info = {
            **fsdp_gpt.where_it_ran(device),
            "check": "fsdp_memory.py",
            "torch": str(torch.__version__),
            "world_size": world_size,
            "replicate": args.replicate,
            "config": asdict(config),
            "n_params": sum(math.prod(s) for s in shapes),
            "n_param_tensors": len(shapes),
            "dtype": args.dtype,
            "dtype_bytes": fsdp_gpt.DTYPES[args.dtype].itemsize,
            "batch_size": args.batch_size,
            "micro_batch_size": args.batch_size // world_size,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "seed": args.seed,
            "reshard_after_forward": args.reshard_after_forward,
            "steps": list(range(start, start + args.steps)),
            "losses": run["losses"],
            "units": units,
            "checkpoint": checkpoint,
            "seconds": seconds,
        }
        results, failure = judge(
            info, everyone, reference, tolerance(args.dtype, mine.tolerance)
        )
    finish(results, failure, args.results)


if __name__ == "__main__":
    main()
