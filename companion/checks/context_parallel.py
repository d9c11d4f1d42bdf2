"""Check ring_attention.py against attention on the whole sequence in one process.

    torchrun --standalone --nproc-per-node=4 companion/checks/context_parallel.py

For every split (plain, zig-zag), mask (causal or not) and method (ring,
all-gather), each rank runs the script's ``attention`` on its part of a
float64 sequence and its backward pass, and compares its output and its
gradients of q, k and v with ``F.scaled_dot_product_attention`` on the whole
sequence (which every rank computes alone). Meanwhile it counts, by wrapping
the script's own functions:

- the scores each rank computes at each step of the ring (``scores``),
  forward and backward;
- the bytes each rank sends to the next (``ring_pass``), and the elements
  the all-gather variant hands to its collectives;
- the bytes attention keeps for backward (``companion.memory.SavedTensors``),
  on every rank, and for the unsplit attention, written out and fused.

It also trains the script's copy model for a few steps in float64, split
across the ranks and, on rank 0, whole in one process, and then for the
script's default run (float32, split). On CUDA it runs torch's own
``context_parallel`` as well. Rank 0 compares every count with its formula
in ``companion.long_context`` and writes the results (``--results FILE``)
for chapter 14. Exit codes: 0 every count meets its formula; 3 one missed,
said in one sentence; 2 bad input; 1 crashed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

from companion.checking import every_rank, finish, first_miss, print0, tolerance
from companion.long_context import (
    attention_saved_bytes,
    chunks_held,
    ring_bytes_per_rank,
    ring_work_per_step,
)
from companion.memory import SavedTensors
from companion.scripts import ring_attention as ra

DTYPE = torch.float64


class Counters:
    """Scores per (phase, step) and bytes sent per phase, counted on this rank."""

    def __init__(self, world_size: int, split: str) -> None:
        self.world_size, self.phase = world_size, "forward"
        self.owner = {  # key chunk -> the rank that holds it
            chunk: rank
            for rank in range(world_size)
            for chunk in chunks_held(rank, world_size, split)
        }
        self.scores: dict[str, list[int]] = defaultdict(lambda: [0] * world_size)
        self.sent: dict[str, int] = defaultdict(int)
        self.collective: dict[str, int] = defaultdict(int)


@contextlib.contextmanager
def counting(counters: Counters) -> Iterator[None]:
    """Wrap the script's ``scores``, ``ring_pass`` and its two collectives."""
    rank = dist.get_rank()
    names = ("scores", "ring_pass", "all_gather_single", "reduce_scatter_single")
    original = {name: getattr(ra, name) for name in names}

    def scores(q, k, q_chunk, k_chunk, causal):
        step = (rank - counters.owner[k_chunk]) % counters.world_size
        counters.scores[counters.phase][step] += q.shape[-2] * k.shape[-2]
        return original["scores"](q, k, q_chunk, k_chunk, causal)

    def ring_pass(tensor):
        counters.sent[counters.phase] += tensor.numel() * tensor.element_size()
        return original["ring_pass"](tensor)

    def all_gather_single(out, x):
        counters.collective["all-gather input"] += x.numel() * x.element_size()
        return original["all_gather_single"](out, x)

    def reduce_scatter_single(out, x):
        counters.collective["reduce-scatter input"] += x.numel() * x.element_size()
        return original["reduce_scatter_single"](out, x)

    wrapped = (scores, ring_pass, all_gather_single, reduce_scatter_single)
    for name, function in zip(names, wrapped):
        setattr(ra, name, function)
    try:
        yield
    finally:
        for name, function in original.items():
            setattr(ra, name, function)


def whole_sequence(args: argparse.Namespace, device: torch.device) -> dict:
    """q, k, v and an output gradient for the whole sequence: the same on every rank."""
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    return {
        name: torch.randn(shape, generator=g, dtype=DTYPE).to(device)
        for name in ("q", "k", "v", "dout")
    }


def check_case(
    data: dict, causal: bool, split: str, method: str, rank: int, world_size: int
) -> dict:
    """One split, mask and method: differences from the whole sequence, and counts."""
    q, k, v = (data[n].clone().requires_grad_() for n in "qkv")
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    reference.backward(data["dout"])
    expected = [reference.detach(), q.grad, k.grad, v.grad]

    def mine(t: torch.Tensor) -> torch.Tensor:
        return ra.shard(t, 2, rank, world_size, split)

    local = [mine(data[n]).requires_grad_() for n in "qkv"]
    counters = Counters(world_size, split)
    with counting(counters), SavedTensors() as saved:
        out = ra.attention(*local, causal, split, method)
    with counting(counters):
        counters.phase = "backward"
        out.backward(mine(data["dout"]))
    got = [out.detach(), *(t.grad for t in local)]
    diffs = [(g - mine(e)).abs().max().item() for g, e in zip(got, expected)]
    return {
        "causal": causal,
        "split": split,
        "method": method,
        "max_diff": dict(zip(["out", "dq", "dk", "dv"], diffs)),
        "scores": dict(counters.scores),
        "sent": dict(counters.sent),
        "collective_input": dict(counters.collective),
        "saved_bytes": saved.nbytes,
    }


def unsplit_saved_bytes(data: dict) -> dict[str, int]:
    """Bytes the whole sequence's causal attention keeps, written out and fused."""
    q, k, v = (data[n].clone().requires_grad_() for n in "qkv")
    T = q.shape[2]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    with SavedTensors(exclude=[future]) as explicit:  # the mask is a buffer
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v
    with SavedTensors() as fused:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return {"explicit": explicit.nbytes, "sdpa": fused.nbytes}


def torch_context_parallel(data: dict, device: torch.device) -> dict:
    """Torch's context_parallel against the whole sequence, where it runs.

    Its ring kernels exist for CUDA's flash, efficient and cuDNN attention,
    in half precision or float32: float32 here, against float64. The CPU's
    SDPA kernel has no context-parallel rule (torch 2.10 to 2.14 raise
    NotImplementedError), so on a CPU this says so and runs nothing. Every
    rank must call it: the ring needs them all.
    """
    if device.type != "cuda":
        return {"ran": False, "reason": "it needs CUDA's attention kernels"}
    q, k, v = (data[n] for n in "qkv")
    try:
        out = ra.torch_context_parallel(q.float(), k.float(), v.float(), device)
    except (NotImplementedError, RuntimeError) as err:  # said, not hidden
        return {"ran": False, "reason": f"{type(err).__name__}: {err}".splitlines()[0]}
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return {"ran": True, "max_diff": (out.double() - reference).abs().max().item()}


def training(args: argparse.Namespace, rank: int, world_size: int, device) -> dict:
    """The script's copy model: a few float64 steps split here and whole on
    rank 0, then the script's whole training run (float32) split here."""
    steps = ["--steps", str(args.train_steps), "--split", args.train_split]
    short, full = ra.parse_args(steps), ra.parse_args(["--split", args.train_split])

    def model(method: str) -> torch.nn.Module:
        torch.manual_seed(short.seed)
        return ra.CopyModel(
            short.vocab, short.seq_len, short.width, short.heads, method
        )

    split = ra.train(model("ring").to(device, DTYPE), short, rank, world_size, device)
    whole = (
        ra.train(model("local").to(device, DTYPE), short, 0, 1, device)
        if rank == 0
        else []
    )
    learned = ra.train(model("ring").to(device), full, rank, world_size, device)
    return {
        "split": short.split,
        "losses": split,
        "reference_losses": whole,
        "run": {
            "losses": learned,
            **{k: v for k, v in vars(full).items() if k != "results"},
        },
    }


def judge(run: dict, everyone: list[dict], tol: float) -> tuple[dict, str]:
    """On rank 0: the results with their formulas, and the sentence for exit code 3."""
    B, H, T, D = run["shape"]
    N, b = run["world_size"], run["dtype_bytes"]
    ring_bytes = ring_bytes_per_rank(B, H, T, D, N, b)
    block = B * H * (T // N) * D * b
    cases = []
    for i, case in enumerate(run["cases"]):
        mine = [e["cases"][i] for e in everyone]
        work = ring_work_per_step(T, N, case["split"], case["causal"])
        ring = case["method"] == "ring"
        predicted = {
            "scores": [{"forward": w, "backward": w} for w in work]
            if ring
            else [{}] * N,
            "sent": [ring_bytes] * N if ring else [{}] * N,
            "collective_input": [{}] * N
            if ring
            else [
                {"all-gather input": 2 * block, "reduce-scatter input": 2 * N * block}
            ]
            * N,
            "saved_bytes": [
                attention_saved_bytes(case["method"], B, H, T, D, N, b, case["causal"])
            ]
            * N,
        }
        measured = {key: [m[key] for m in mine] for key in predicted}
        cases.append(
            {
                **{k: case[k] for k in ("causal", "split", "method")},
                "max_diff": max(max(m["max_diff"].values()) for m in mine),
                "measured": measured,
                "predicted": predicted,
            }
        )
    unsplit = {
        m: attention_saved_bytes(m, B, H, T, D, 1, b) for m in ("explicit", "sdpa")
    }
    fused = run["device"] == "cpu"
    train = everyone[0]["training"]
    loss_diff = max(
        abs(a - r) for a, r in zip(train["losses"], train["reference_losses"])
    )
    checks = {
        "outputs and gradients": all(c["max_diff"] <= tol for c in cases),
        "scores per step": all(
            c["measured"]["scores"] == c["predicted"]["scores"] for c in cases
        ),
        "bytes sent": all(
            c["measured"][k] == c["predicted"][k]
            for c in cases
            for k in ("sent", "collective_input")
        ),
        # SDPA's formulas describe the CPU's fused kernel, which takes float64;
        # CUDA runs float64 SDPA on its math kernel, which keeps the T x T
        # probabilities: there only the ring and the written-out attention count.
        "saved bytes": all(
            c["measured"]["saved_bytes"] == c["predicted"]["saved_bytes"]
            for c in cases
            if fused or c["method"] == "ring"
        )
        and all(
            run["unsplit_saved_bytes"][m] == unsplit[m]
            for m in (("explicit", "sdpa") if fused else ("explicit",))
        ),
        "training": loss_diff <= tol,
    }
    worst = max(c["max_diff"] for c in cases)
    print0(
        f"{N} ranks: {len(cases)} cases, largest difference from the whole sequence "
        f"~{worst:.1e}, from one process's training ~{loss_diff:.1e}"
    )
    print0(
        "checks: "
        + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in checks.items())
    )
    results = {
        **run,
        "cases": cases,
        "unsplit_saved_bytes": {
            "measured": run["unsplit_saved_bytes"],
            "predicted": unsplit,
        },
        "training": {**train, "max_loss_diff": loss_diff},
        "tolerance": tol,
        "checks": checks,
    }
    return results, first_miss(checks)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--seq-len", type=int, default=48, help="positions (a multiple of 2 N)")
    add("--batch", type=int, default=2, help="sequences")
    add("--heads", type=int, default=2, help="attention heads")
    add("--head-dim", type=int, default=8, help="values per head")
    add("--train-steps", type=int, default=5, help="steps of the training comparison")
    add("--train-split", default="zigzag", help="the split of the training runs")
    add("--tolerance", type=float, help="of every comparison (default: 1e-10)")
    add("--seed", type=int, default=0, help="seed of q, k, v")
    add("--timeout", type=float, default=300, help="seconds to wait for other ranks")
    add("--results", help="a JSON file for rank 0's results")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    rank, _, world_size, device = ra.setup_distributed(args.timeout)
    if args.seq_len % (2 * world_size):
        ra.fail(f"--seq-len {args.seq_len} must be a multiple of 2 x {world_size}")
    data = whole_sequence(args, device)
    cases = [
        check_case(data, causal, split, method, rank, world_size)
        for causal, split, method in itertools.product(
            (False, True), ("plain", "zigzag"), ("ring", "allgather")
        )
    ]
    record = {"cases": cases, "training": training(args, rank, world_size, device)}
    torch_cp = torch_context_parallel(data, device)  # on every rank
    everyone = every_rank(record)
    results, failure = None, ""
    if rank == 0:
        run = {
            **ra.where_it_ran(device),
            "world_size": world_size,
            "shape": [args.batch, args.heads, args.seq_len, args.head_dim],
            "dtype_bytes": DTYPE.itemsize,
            "cases": [{k: c[k] for k in ("causal", "split", "method")} for c in cases],
            "unsplit_saved_bytes": unsplit_saved_bytes(data),
            "torch_context_parallel": torch_cp,
        }
        results, failure = judge(run, everyone, tolerance("float64", args.tolerance))
    finish(results, failure, args.results)


if __name__ == "__main__":
    main()
