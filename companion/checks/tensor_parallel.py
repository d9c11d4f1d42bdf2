"""tensor_parallel_gpt.py's splits against the plain model: results, traffic, memory.

    launch("checks/tensor_parallel.py", [], nproc=2)             # hand, tp and sp
    launch("checks/tensor_parallel.py", ["--layout", "2d"], nproc=4)  # 2 x 2 mesh

It takes tensor_parallel_gpt.py's flags (``--dtype`` float64 unless given)
and runs the script's own functions.
``--layout 1d`` (the default; 3 steps unless ``--steps`` says otherwise)
splits the model three ways over all the processes, ``hand``, ``tp`` and
``sp``, and measures each:

- one block split by hand against the whole block (output, input gradient,
  each rank's slice of every weight gradient), and its all-reduces: 2
  forward and 2 backward, of B T d elements each;
- the logits and losses of each split against the plain model's
  (``companion.gpt.plain_losses``), and DTensor's gradients against the
  hand-written version's;
- the collectives of every training step, per phase
  (``companion.collectives``), against formulas: by hand 2 all-reduces per
  block forward and 2 backward; DTensor 2 forward and 4 backward (every
  ``ColwiseParallel`` layer all-reduces its own input gradient: q, k and v
  make three where f makes one); with sequence parallelism all-gathers and
  reduce-scatters in their place, the logits' all-gather, and 2L + 1
  small all-reduces after the backward pass (the replicated LayerNorm
  weights have partial gradients, which the script sums once; left partial,
  DTensor would all-reduce them each time Adam reads them, three times a
  step);
- the bytes saved for backward per rank (``companion.memory.SavedTensors``),
  against formulas per position and block: plain 16d + 4 + hT; TP 4d + 4 +
  (12d + hT)/N; TP+SP 2d + (14d + 4 + hT)/N (DTensor keeps the gathered
  inputs of attention and MLP whole);
- for a cost model, never checked: the seconds of ``--repeats`` forward and
  backward passes after a warm-up, on a clock that waits for the device
  before and after each pass (not inside it):
  the plain model on rank 0 with all the processes' threads; then, in turn
  round after round, the plain model on rank 0 with one process's threads
  and each split between barriers (every sample, and the medians); one
  all-reduce of B T d elements alone, and the median of those the
  hand-split steps ran, marked on the device's timeline (CUDA events on a
  GPU, which add no synchronisation inside the step).

``--layout 2d`` trains DTensor's split inside each row of the ``--mesh`` and
FSDP2 along its columns (5 steps unless told otherwise), and checks its
losses and the parameter bytes per rank (a TP slice by ``torch.chunk``, then
FSDP2's dim-0 chunk of it).

Writes rank 0's results (``--results FILE``) for chapter 13. Exit codes: 0
every check holds; 3 one missed, said in one sentence; 2 bad input; 1
crashed. Collective counts verified on torch 2.10 and 2.14.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import re
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor

from companion.checks._shared import (
    DeviceClock,
    clock,
    every_rank,
    finish,
    print0,
    tolerance,
)
from companion.collectives import PHASES, CollectiveCounter
from companion.gpt import GPTConfig, plain_losses
from companion.memory import SavedTensors, shard_rows, tensor_bytes
from companion.scripts import tensor_parallel_gpt as tpg

SPLITS = ("hand", "tp", "sp")
DEFAULT_STEPS = {"1d": 3, "2d": 5}


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local tensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (local(a) - local(b)).abs().max().item()


def split_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits a parameter along (None: whole):
    q, k, v and fc keep rows (output features), the two proj columns."""
    if re.search(r"\.(q|k|v|fc)\.weight$", name):
        return 0
    return 1 if re.search(r"\.proj\.weight$", name) else None


# ---- formulas


def row(calls: int, input_bytes: int, output_bytes: int) -> dict:
    return {"calls": calls, "input_bytes": input_bytes, "output_bytes": output_bytes}


def predict_collectives(config, batch_size: int, seq_len: int, n: int, b: int) -> dict:
    """Collectives of one training step per phase, for hand, block, tp and sp.

    S = B T d b bytes, the residual stream. Hand (Megatron-LM's f and g):
    2 all-reduces of S per block forward, 2 backward; ``block`` is one
    block's forward and backward. DTensor TP: 2 per block forward, 4
    backward. SP: all-gathers of S/N in, S out: 2L + 1 forward (attention
    and MLP inputs, the head's input), 2L + 1 backward (proj output
    gradients, the gradient entering the embeddings), plus the logits, B T V'
    b out with V' the vocabulary rounded up to a multiple of N;
    reduce-scatters of S in, S/N out: 2L forward (the proj outputs), 2L + 1
    backward (attention, MLP and head input gradients); 2L + 1 all-reduces
    of d b bytes at the end of the backward pass (the LayerNorms' partial
    weight gradients, summed once). One process: none.
    """
    B, T, N = batch_size, seq_len, n
    d, V, L = config.n_embd, config.vocab_size, config.n_layer
    S = B * T * d * b
    if N == 1:
        empty = {phase: {} for phase in PHASES}
        return {
            "hand": empty,
            "block": {p: {} for p in PHASES[:2]},
            "tp": empty,
            "sp": empty,
        }

    def all_reduce(calls: int, size: int = S) -> dict:
        return {"all-reduce": row(calls, calls * size, calls * size)}

    logits = B * T * math.ceil(V / N) * b  # one rank's padded share of the logits
    return {
        "hand": {
            "forward": all_reduce(2 * L),
            "backward": all_reduce(2 * L),
            "optimizer": {},
        },
        "block": {"forward": all_reduce(2), "backward": all_reduce(2)},
        "tp": {
            "forward": all_reduce(2 * L),
            "backward": all_reduce(4 * L),
            "optimizer": {},
        },
        "sp": {
            "forward": {
                "all-gather": row(
                    2 * L + 2,
                    (2 * L + 1) * S // N + logits,
                    (2 * L + 1) * S + N * logits,
                ),
                "reduce-scatter": row(2 * L, 2 * L * S, 2 * L * S // N),
            },
            "backward": {
                "all-gather": row(2 * L + 1, (2 * L + 1) * S // N, (2 * L + 1) * S),
                "reduce-scatter": row(2 * L + 1, (2 * L + 1) * S, (2 * L + 1) * S // N),
                **all_reduce(2 * L + 1, d * b),
            },
            "optimizer": {},
        },
    }


def predict_saved_bytes(config, batch_size: int, seq_len: int, n: int, b: int) -> dict:
    """Bytes saved for backward per rank: plain, tp (and hand) and sp.

    In elements per position and block (P = B T positions, N ranks, d wide,
    h heads): plain 16d + 4 + hT; TP 4d + 4 + (12d + hT)/N, since both
    LayerNorms (2d + 4) and the inputs of attention and MLP (2d) stay whole
    while q, k, v and the heads side by side (4d), the softmax (hT) and the
    GELU's input and output (8d) are split; TP+SP 2d + (14d + 4 + hT)/N.
    Around the blocks: the final LayerNorm (d + 2, split under SP), the
    head's input (d), the loss's log-softmax (V), the int64 ids and targets
    (2P) and positions (T), and one scalar, cross-entropy's total weight.
    """
    B, T, N = batch_size, seq_len, n
    d, h, V, L = config.n_embd, config.n_head, config.vocab_size, config.n_layer
    P, P_local = B * T, B * T // N
    blocks = {
        "plain": P * (16 * d + 4 + h * T),
        "tp": P * (4 * d + 4) + P * (12 * d + h * T) // N,
        "sp": P * 2 * d + P_local * (14 * d + 4 + h * T),
    }
    around = {
        "plain": P * (2 * d + 2 + V),
        "tp": P * (2 * d + 2 + V),
        "sp": P_local * (d + 2) + P * (d + V),
    }
    rest = (2 * P + T) * 8 + b  # int64 ids, targets, positions; the scalar
    saved = {
        split: {
            "blocks": L * blocks[split] * b,
            "embedding and head": around[split] * b + rest,
            "total": L * blocks[split] * b + around[split] * b + rest,
        }
        for split in blocks
    }
    return saved | {"hand": saved["tp"]}


def predict_parameter_bytes(shapes: dict, dp: int, tp: int, rank: int, b: int) -> dict:
    """Parameter bytes on ``rank`` of a dp x tp mesh (rank = dp_rank * tp + tp_rank):
    a ``torch.chunk`` slice along the TP split, then FSDP2's chunk of dim 0 of
    that ("local"), allocated as ceil(rows / dp) rows ("storage")."""
    dp_rank, tp_rank = divmod(rank, tp)
    owned = padded = 0
    for name, shape in shapes.items():
        kept = list(shape)
        dim = split_dim(name)
        if dim is not None:
            kept[dim] = shard_rows(kept[dim], tp, tp_rank)
        rest = math.prod(kept[1:])
        owned += shard_rows(kept[0], dp, dp_rank) * rest
        padded += math.ceil(kept[0] / dp) * rest
    return {"local": owned * b, "storage": padded * b}


# ---- measurements


def check_block(block: nn.Module, shape: tuple, seed: int) -> dict:
    """One block, whole and split by hand, on the same input and output gradient:
    the largest differences, and the split block's collectives."""
    whole = copy.deepcopy(block)
    split = tpg.split_block_by_hand(copy.deepcopy(block))
    weight = whole.ln_1.weight
    g = torch.Generator().manual_seed(seed)
    x, upstream = (
        torch.randn(shape, generator=g, dtype=weight.dtype).to(weight.device)
        for _ in range(2)
    )
    x_whole, x_split = (x.clone().requires_grad_() for _ in range(2))
    out_whole = whole(x_whole)
    out_whole.backward(upstream)
    with CollectiveCounter() as counter:
        out_split = split(x_split)
        counter.phase = "backward"
        out_split.backward(upstream)
    rank, n = dist.get_rank(), dist.get_world_size()
    full = dict(whole.named_parameters())
    weight_diffs = []
    for name, p in split.named_parameters():
        dim, expected = split_dim("." + name), full[name].grad
        expected = expected if dim is None else expected.chunk(n, dim=dim)[rank]
        weight_diffs.append(max_diff(p.grad, expected))
    return {
        "max_diff": {
            "output": max_diff(out_split, out_whole),
            "input_gradient": max_diff(x_split.grad, x_whole.grad),
            "weight_gradients": max(weight_diffs),
        },
        "collectives": {p: counter.counts[p] for p in PHASES[:2]},
    }


def train_counted(model: nn.Module, batches: list, lr: float) -> dict:
    """Train with the script's ``train_step``; the losses, each step's collectives
    per phase, the first step's logits and gradients (this rank's tensors)."""
    optimizer = tpg.make_adam(model, lr)
    out: dict[str, Any] = {"losses": [], "collectives": []}

    def first_logits(_module: nn.Module, _inputs: Any, logits: torch.Tensor) -> None:
        out.setdefault("logits", local(logits).detach().clone())

    hook = model.register_forward_hook(first_logits)
    for x, y in batches:
        with CollectiveCounter().follow(model, optimizer) as counter:
            loss = tpg.train_step(model, optimizer, x, y)
        out.setdefault(
            "gradients",
            {n: local(p.grad).detach().clone() for n, p in model.named_parameters()},
        )
        out["collectives"].append(counter.counts)
        out["losses"].append(tpg.mean_over_ranks(loss))
    hook.remove()
    return out


def saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd saves in one forward pass and the loss, on this rank."""
    kept = [*model.parameters(), *model.buffers()]
    with SavedTensors(exclude=kept) as saved:
        tpg.lm_loss(model(x), y)
    return saved.nbytes


def median_seconds(fn: Callable[[], Any], repeats: int, together: bool = True) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after a warm-up; with
    ``together`` every rank calls it between two barriers (the slowest sets
    the time), else this rank alone."""
    fn()
    return statistics.median(seconds_of(fn, together) for _ in range(repeats))


def seconds_of(fn: Callable[[], Any], together: bool = True) -> float:
    """Seconds of one call of ``fn()``; with ``together`` every rank calls it
    between two barriers, else this rank alone."""
    if together:
        dist.barrier()
    tic = clock()
    fn()
    if together:
        dist.barrier()
    return clock() - tic


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        tpg.lm_loss(model(x), y).backward()

    return step


@contextlib.contextmanager
def timed_all_reduces(marks: list[tuple], device: torch.device) -> Iterator[None]:
    """Mark where every ``torch.distributed.all_reduce`` call (the hand-split
    model's) starts and ends, on the device's timeline (``DeviceClock``: on
    a GPU no synchronisation around them, which would stall the step's own
    queue of work); read them with ``DeviceClock.seconds`` after the step."""
    original, device_clock = dist.all_reduce, DeviceClock(device)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = device_clock.mark()
        out = original(*args, **kwargs)
        marks.append((start, device_clock.mark()))
        return out

    dist.all_reduce = timed
    try:
        yield
    finally:
        dist.all_reduce = original


def measure_times(models: dict, plain: nn.Module, x, y, repeats: int) -> dict:
    """Seconds per forward and backward pass, and of one all-reduce of B T d.

    The plain model with one process's threads and the splits are timed in
    turn, round after round (``samples``), so that a machine that slows down
    for a while slows all of them; their medians are the entries by name.
    """
    rank, n, threads = dist.get_rank(), dist.get_world_size(), torch.get_num_threads()
    seconds: dict[str, Any] = {"threads_per_process": threads}
    if rank == 0:  # the others wait at the barrier below
        torch.set_num_threads(n * threads)
        seconds["plain_same_cpus"] = median_seconds(
            forward_backward(plain, x, y), repeats, together=False
        )
        torch.set_num_threads(threads)
    dist.barrier()
    steps = {name: forward_backward(model, x, y) for name, model in models.items()}
    plain_step = forward_backward(plain, x, y)
    samples: dict[str, list[float]] = {
        "plain_one_process": [],
        **{k: [] for k in steps},
    }
    in_step: list[float] = []
    for round_ in range(repeats + 1):  # round 0 warms up
        dist.barrier()
        alone = seconds_of(plain_step, together=False) if rank == 0 else 0.0
        timed = {"plain_one_process": alone}
        for name, step in steps.items():
            calls: list[tuple] = []
            with (
                timed_all_reduces(calls, x.device)
                if name == "hand"
                else contextlib.nullcontext()
            ):
                timed[name] = seconds_of(step)
            if round_:  # the step is over: reading the marks waits for nothing
                in_step += [DeviceClock(x.device).seconds(*m) for m in calls]
        for name, value in timed.items():
            if round_:
                samples[name].append(value)
    seconds |= {name: statistics.median(values) for name, values in samples.items()}
    seconds["samples"] = samples
    if in_step:  # one process alone makes none
        seconds["all_reduce_in_step"] = statistics.median(in_step)
    stream = torch.randn(
        x.numel() * plain.tok_emb.embedding_dim,
        dtype=plain.tok_emb.weight.dtype,
        device=x.device,
    )
    many = 5 * repeats  # short calls, noisy on a shared CPU: a steadier median
    seconds["all_reduce"] = median_seconds(lambda: dist.all_reduce(stream), many)
    seconds["all_reduce_bytes"] = stream.numel() * stream.element_size()
    seconds["barrier"] = median_seconds(lambda: None, many)
    return seconds


# ---- the two layouts


def run_1d(args, config, batches, device, repeats: int) -> dict:
    """Everything ``--layout 1d`` measures on this rank."""
    mesh = tpg.build_mesh(args, device)
    plain = tpg.build_model(config, args.seed, args.dtype, device)
    x, y = batches[0]
    mine: dict[str, Any] = {}
    tic = clock()
    shape = (args.batch_size, args.seq_len, config.n_embd)
    mine["block"] = check_block(plain.blocks[0], shape, args.seed + 1)
    reference = {
        "logits": plain(x).detach(),
        "losses": plain_losses(
            GPTConfig(**asdict(config)),
            batches,
            lr=args.lr,
            seed=args.seed,
            dtype=tpg.DTYPES[args.dtype],
            device=device,
        ),
    }
    models = {s: tpg.parallelize(copy.deepcopy(plain), s, mesh) for s in SPLITS}
    for split, model in models.items():
        run = mine[split] = train_counted(model, batches, args.lr)
        run["max_diff"] = {
            "logits": max_diff(run.pop("logits"), reference["logits"]),
            "losses": max(
                abs(a - r) for a, r in zip(run["losses"], reference["losses"])
            ),
        }
    hand = mine["hand"].pop("gradients")
    mine["tp"]["max_diff"]["gradients_vs_hand"] = max(
        max_diff(g, hand[name]) for name, g in mine["tp"].pop("gradients").items()
    )
    del mine["sp"]["gradients"]
    mine["reference_losses"] = reference["losses"]
    mine["seconds_train"] = clock() - tic
    tic = clock()
    mine["activations"] = {
        split: saved_bytes(model, x, y)
        for split, model in {"plain": plain, **models}.items()
    }
    mine["seconds_activations"] = clock() - tic
    tic = clock()
    mine["timing"] = measure_times(models, plain, x, y, repeats)
    mine["seconds_timing"] = clock() - tic
    return mine


def judge_1d(args, config, everyone: list[dict], tol: float) -> tuple[dict, str]:
    """On rank 0: the results and the sentence for exit code 3 ("" if none)."""
    n, b = len(everyone), tpg.DTYPES[args.dtype].itemsize
    predicted = predict_collectives(config, args.batch_size, args.seq_len, n, b)
    saved = predict_saved_bytes(config, args.batch_size, args.seq_len, n, b)

    def largest(split: str, *keys: str) -> float:
        return max(e[split]["max_diff"][k] for e in everyone for k in keys)

    def every_step(split: str) -> bool:
        return all(
            s == predicted[split] for e in everyone for s in e[split]["collectives"]
        )

    block_diff = max(max(e["block"]["max_diff"].values()) for e in everyone)
    checks = {
        "hand_block": block_diff <= tol,
        "hand_collectives": every_step("hand")
        and all(e["block"]["collectives"] == predicted["block"] for e in everyone),
        "hand_losses": largest("hand", "logits", "losses") <= tol,
        "tp_losses": largest("tp", "logits", "losses") <= tol,
        "tp_gradients": largest("tp", "gradients_vs_hand") <= tol,
        "tp_collectives": every_step("tp"),
        "sp_losses": largest("sp", "logits", "losses") <= tol,
        "sp_collectives": every_step("sp"),
        "activations": all(
            e["activations"][s] == saved[s]["total"] for e in everyone for s in saved
        ),
    }
    first = everyone[0]
    results: dict[str, Any] = {
        "reference_losses": first["reference_losses"],
        "activations": {
            "measured": {s: [e["activations"][s] for e in everyone] for s in saved},
            "predicted": saved,
        },
        "timing": first["timing"],
        "seconds_per_part": {
            k: first[k]
            for k in ("seconds_train", "seconds_activations", "seconds_timing")
        },
    }
    for split in SPLITS:
        results[split] = {
            "losses": first[split]["losses"],
            "max_diff": {k: largest(split, k) for k in first[split]["max_diff"]},
            "collectives": first[split]["collectives"],
            "predicted": predicted[split],
            "same_on_every_rank": all(
                e[split]["collectives"] == first[split]["collectives"] for e in everyone
            ),
        }
    results["hand"]["block"] = {
        "max_diff": {
            k: max(e["block"]["max_diff"][k] for e in everyone)
            for k in first["block"]["max_diff"]
        },
        "collectives": first["block"]["collectives"],
        "predicted": predicted["block"],
    }
    print0(
        f"one block split by hand: largest difference ~{block_diff:.1e}; "
        f"{len(first['hand']['losses'])} steps of each split, largest loss "
        "difference from the plain model: "
        + ", ".join(f"{s} ~{results[s]['max_diff']['losses']:.1e}" for s in SPLITS)
    )
    for split in SPLITS:
        step = first[split]["collectives"][0]
        said = [
            f"{phase} "
            + (" + ".join(f"{v['calls']} {k}" for k, v in step[phase].items()) or "-")
            for phase in PHASES
        ]
        print0(f"{split:4s} collectives per step: {', '.join(said)}")
    print0(
        "saved for backward on rank 0: "
        + ", ".join(f"{s} {b} B" for s, b in first["activations"].items())
    )
    timing = first["timing"]
    print0(
        f"forward+backward: plain {timing['plain_same_cpus'] * 1e3:.1f} ms "
        f"(one process, all {n} processes' threads), hand TP "
        f"{timing['hand'] * 1e3:.1f} ms, DTensor TP {timing['tp'] * 1e3:.1f} ms, "
        f"TP+SP {timing['sp'] * 1e3:.1f} ms; an all-reduce of "
        f"{timing['all_reduce_bytes']} B: {timing['all_reduce'] * 1e3:.2f} ms "
        f"alone, {timing.get('all_reduce_in_step', math.nan) * 1e3:.2f} ms "
        "inside the hand-split steps"
    )
    beyond = f"beyond --tolerance {tol:g}"
    sentences = {
        "hand_block": f"the block split by hand differs from the whole block by "
        f"{block_diff:.1e}, {beyond}",
        "hand_collectives": "the all-reduces of the split by hand differ from their "
        "formula; see hand in the results",
        "hand_losses": f"the model split by hand ended "
        f"{largest('hand', 'logits', 'losses'):.1e} from the plain model, {beyond}",
        "tp_losses": f"DTensor tensor parallelism ended "
        f"{largest('tp', 'logits', 'losses'):.1e} from the plain model, {beyond}",
        "tp_gradients": "DTensor's gradients differ from the hand-written ones by "
        f"{largest('tp', 'gradients_vs_hand'):.1e}, {beyond}",
        "tp_collectives": "DTensor's collectives differ from their formula; see tp "
        "in the results",
        "sp_losses": f"sequence parallelism ended "
        f"{largest('sp', 'logits', 'losses'):.1e} from the plain model, {beyond}",
        "sp_collectives": "the collectives of sequence parallelism differ from "
        "their formula; see sp in the results",
        "activations": "the bytes saved for backward differ from their formula; "
        "see activations in the results",
    }
    failure = next((sentences[k] + "." for k, ok in checks.items() if not ok), "")
    return results | {"checks": checks}, failure


def run_2d(args, config, batches, device) -> dict:
    """Train the script's 2-D layout; this rank's losses, bytes and placements."""
    mesh = tpg.build_mesh(args, device)
    model = tpg.build_model(config, args.seed, args.dtype, device)
    model = tpg.parallelize(model, "2d", mesh)
    optimizer = tpg.make_adam(model, args.lr)
    losses, tic = [], clock()
    for x, y in batches:
        x, y = tpg.local_batch(x, mesh), tpg.local_batch(y, mesh)
        losses.append(tpg.mean_over_ranks(tpg.train_step(model, optimizer, x, y)))
    return {
        "losses": losses,
        "seconds_train": clock() - tic,
        "parameter_bytes": tensor_bytes(model.parameters()),
        "placements": {
            name: {
                "placements": [str(p) for p in param.placements],
                "mesh": list(param.device_mesh.mesh_dim_names or ()),
                "local_shape": list(local(param).shape),
            }
            for name, param in model.named_parameters()
        },
    }


def judge_2d(args, config, everyone: list[dict], device, tol: float):
    """On rank 0: the results and the sentence for exit code 3 ("" if none)."""
    dp, tp = args.mesh
    b = tpg.DTYPES[args.dtype].itemsize
    plain = tpg.build_model(config, args.seed, args.dtype, "meta")
    shapes = {name: list(p.shape) for name, p in plain.named_parameters()}
    n_params = sum(math.prod(s) for s in shapes.values())
    predicted = [predict_parameter_bytes(shapes, dp, tp, r, b) for r in range(dp * tp)]
    measured = [e["parameter_bytes"] for e in everyone]
    losses = everyone[0]["losses"]
    reference = plain_losses(
        GPTConfig(**asdict(config)),
        tpg.global_batches(args, device),
        lr=args.lr,
        seed=args.seed,
        dtype=tpg.DTYPES[args.dtype],
        device=device,
    )
    diff = max(abs(a - r) for a, r in zip(losses, reference))
    checks = {"losses": diff <= tol, "parameter_bytes": measured == predicted}
    print0(
        f"dp {dp} x tp {tp}: {len(losses)} steps, largest loss difference from the "
        f"plain model ~{diff:.1e}; parameters per rank "
        f"{[m['local'] for m in measured]} B (roughly {n_params * b // (dp * tp)} B)"
    )
    results = {
        "mesh": {"dp": dp, "tp": tp},
        "losses": losses,
        "reference_losses": reference,
        "max_diff": {"losses": diff},
        "parameter_bytes": {
            "measured": measured,
            "predicted": predicted,
            "rough": n_params * b / (dp * tp),
            "whole_model": n_params * b,
        },
        "placements_rank0": everyone[0]["placements"],
        "seconds_train": everyone[0]["seconds_train"],
        "checks": checks,
    }
    failure = ""
    if not checks["losses"]:
        failure = f"the 2-D run ended {diff:.1e} from the plain model's losses, beyond --tolerance {tol:g}."
    elif not checks["parameter_bytes"]:
        failure = "the parameter bytes per rank differ from their formula; see parameter_bytes in the results."
    return results, failure


@record
def main() -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--layout", choices=DEFAULT_STEPS, default="1d")
    own.add_argument("--repeats", type=int, default=9, help="timed runs (default: 9)")
    own.add_argument("--tolerance", type=float, help="of the losses (default: 1e-10)")
    mine, rest = own.parse_known_args()
    layout = "sp" if mine.layout == "1d" else "2d"  # sp: the strictest flags
    steps = ["--steps", str(DEFAULT_STEPS[mine.layout]), "--dtype", "float64"]
    args = tpg.parse_args([*steps, *rest, "--layout", layout])
    if mine.repeats < 1:
        tpg.fail(f"--repeats must be at least 1, not {mine.repeats}.")
    rank, world_size, device = tpg.setup_distributed(args.timeout)
    wall = clock()
    config = tpg.model_config(args)
    print0(
        f"{world_size} process{'es' if world_size > 1 else ''} on {device.type}, "
        + (
            f"dp {args.mesh[0]} x tp {args.mesh[1]}"
            if layout == "2d"
            else f"tensor parallel over {world_size}"
        )
        + f": {config.n_layer} blocks of width {config.n_embd}, {config.n_head} heads, "
        f"in {args.dtype}, batch {args.batch_size} x {args.seq_len}, {args.steps} steps"
    )
    batches = tpg.global_batches(args, device)
    tol = tolerance(args.dtype, mine.tolerance)
    if layout == "2d":
        everyone = every_rank(run_2d(args, config, batches, device))
    else:
        everyone = every_rank(run_1d(args, config, batches, device, mine.repeats))
    results, failure = None, ""
    if rank == 0:
        if layout == "2d":
            part, failure = judge_2d(args, config, everyone, device, tol)
        else:
            part, failure = judge_1d(args, config, everyone, tol)
        print0(
            "checks: "
            + ", ".join(
                f"{k} {'ok' if v else 'MISSED'}" for k, v in part["checks"].items()
            )
        )
        results = {
            **tpg.where_it_ran(device),
            "check": "tensor_parallel.py",
            "torch": str(torch.__version__),
            "layout": mine.layout,
            "world_size": world_size,
            "config": asdict(config),
            "dtype": args.dtype,
            "dtype_bytes": tpg.DTYPES[args.dtype].itemsize,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "seed": args.seed,
            "steps": args.steps,
            "tolerance": tol,
            **part,
            "seconds": clock() - wall,
        }
    finish(results, failure, args.results)


if __name__ == "__main__":
    main()
