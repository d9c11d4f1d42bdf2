"""Check ring_attention.py against attention on the whole sequence in one process.

    torchrun --standalone --nproc-per-node=4 companion/checks/context_parallel.py

For every split (plain, zig-zag), mask (causal or not) and method (ring,
all-gather, Ulysses' all-to-all), each rank runs the script's ``attention`` on
its part of a float64 sequence and its backward pass, and compares its output
and its gradients of q, k and v with ``F.scaled_dot_product_attention`` on the
whole sequence (which every rank computes alone); then the ring once more
with grouped-query attention (half as many key-value heads) and once in
bfloat16 (against float64 attention on the same rounded inputs, beside
SDPA's own bfloat16 kernel on the whole sequence, whose error sets the
bound: 1.5 times it). Meanwhile it
counts, by wrapping the script's own functions:

- the scores each rank computes at each step of the ring (``scores``),
  forward and backward;
- the calls each method makes to ``ring_pass``, the all-gather, the
  reduce-scatter and ``send_slices`` (the all-to-all), and the bytes each
  sends to the others, as a ring algorithm sends them: all of a ring pass,
  N - 1 times its input for an all-gather, (N - 1)/N of it for a
  reduce-scatter or an all-to-all;
- the bytes attention keeps for backward (``companion.memory.SavedTensors``),
  on every rank, and for the unsplit attention, written out and fused.

It also trains the script's copy model for a few steps in float64, split
across the ranks and, on rank 0, whole in one process; for 2 steps without
the all-reduce of the gradients (a mistake); and then for the script's
default run (float32, split), whose trained model is scored on new
sequences with its own positions and with a plain split's (the other
mistake: positions that do not match the tokens' split). It tries torch's own ``context_parallel`` (on a CPU it raises, and
the error is kept). Rank 0 compares every count with its formula in
``companion.long_context`` and writes the results (``--results FILE``) for
chapter 14. Exit codes: 0 every count meets its formula; 3 one missed, said
in one sentence; 2 bad input; 1 crashed.
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

from companion.checks._shared import every_rank, finish, first_miss, print0, tolerance
from companion.long_context import (
    attention_saved_bytes,
    chunks_held,
    context_bytes_per_rank,
    ring_work_per_step,
)
from companion.memory import SavedTensors
from companion.scripts import ring_attention as ra

DTYPE = torch.float64
KERNEL_FACTOR = 1.5  # bfloat16: the ring within 1.5x of SDPA's own bf16 error


class Counters:
    """Scores per (phase, step), calls and bytes sent per phase, on this rank."""

    def __init__(self, world_size: int, split: str) -> None:
        self.world_size, self.phase = world_size, "forward"
        self.owner = {  # key chunk -> the rank that holds it
            chunk: rank
            for rank in range(world_size)
            for chunk in chunks_held(rank, world_size, split)
        }
        self.scores: dict[str, list[int]] = defaultdict(lambda: [0] * world_size)
        self.sent: dict[str, int] = defaultdict(int)
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


@contextlib.contextmanager
def counting(counters: Counters) -> Iterator[None]:
    """Wrap the script's ``scores``, ``ring_pass``, ``send_slices`` and its two
    collectives; count the bytes that leave this rank as a ring algorithm sends
    them."""
    rank, N = dist.get_rank(), dist.get_world_size()
    names = ("ring_pass", "all_gather_single", "reduce_scatter_single", "send_slices")
    share = {  # of the input's bytes, times N: what leaves this rank
        "ring_pass": N,
        "all_gather_single": N * (N - 1),
        "reduce_scatter_single": N - 1,
        "send_slices": N - 1,
    }
    original = {name: getattr(ra, name) for name in ("scores", *names)}

    def scores(q, k, q_chunk, k_chunk, causal):
        step = (rank - counters.owner[k_chunk]) % counters.world_size
        counters.scores[counters.phase][step] += q.shape[-2] * k.shape[-2]
        return original["scores"](q, k, q_chunk, k_chunk, causal)

    def counted(name: str):
        def function(*args):
            x = args[0] if name in ("ring_pass", "send_slices") else args[1]
            counters.calls[counters.phase][name] += 1
            counters.sent[counters.phase] += (
                x.numel() * x.element_size() * share[name] // N
            )
            return original[name](*args)

        return function

    ra.scores = scores
    for name in names:
        setattr(ra, name, counted(name))
    try:
        yield
    finally:
        for name, function in original.items():
            setattr(ra, name, function)


def whole_sequence(args: argparse.Namespace, device: torch.device) -> dict:
    """q, k, v and an output gradient for the whole sequence: the same on every rank."""
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    data = {
        name: torch.randn(shape, generator=g, dtype=DTYPE).to(device)
        for name in ("q", "k", "v", "dout")
    }
    data["k_few"], data["v_few"] = (  # grouped-query attention: half the heads
        data[n][:, : args.heads // 2].contiguous() for n in "kv"
    )
    return data


def check_case(case: dict, data: dict, rank: int, world_size: int) -> dict:
    """One case: differences from the whole sequence, and counts."""
    causal, split, method = case["causal"], case["split"], case["method"]
    dtype = torch.bfloat16 if case["dtype"] == "bfloat16" else DTYPE
    few = case["kv_heads"] < data["q"].shape[1]
    inputs = [data["q"], data["k_few" if few else "k"], data["v_few" if few else "v"]]
    inputs = [t.to(dtype).to(DTYPE) for t in inputs]  # the rounded values, in float64
    q, k, v = (t.clone().requires_grad_() for t in inputs)
    reference = F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=few
    )
    reference.backward(data["dout"].to(dtype).to(DTYPE))
    expected = [reference.detach(), q.grad, k.grad, v.grad]

    def mine(t: torch.Tensor) -> torch.Tensor:
        return ra.shard(t, 2, rank, world_size, split)

    local = [mine(t).to(dtype).requires_grad_() for t in inputs]
    counters = Counters(world_size, split)
    with counting(counters), SavedTensors() as saved:
        out = ra.attention(*local, causal, split, method)
    with counting(counters):
        counters.phase = "backward"
        out.backward(mine(data["dout"]).to(dtype))
    got = [out.detach(), *(t.grad for t in local)]
    diffs = [(g.to(DTYPE) - mine(e)).abs().max().item() for g, e in zip(got, expected)]
    kernel = {}
    if dtype != DTYPE:  # SDPA's own kernel in this dtype, on the same inputs
        q, k, v = (t.to(dtype).requires_grad_() for t in inputs)
        fused = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=few
        )
        fused.backward(data["dout"].to(dtype))
        kernel = {
            name: (mine(g.to(DTYPE)) - mine(e)).abs().max().item()
            for name, g, e in zip(
                ["out", "dq", "dk", "dv"],
                [fused.detach(), q.grad, k.grad, v.grad],
                expected,
            )
        }
    return {
        **case,
        "max_diff": dict(zip(["out", "dq", "dk", "dv"], diffs)),
        "kernel_max_diff": kernel,
        "scores": dict(counters.scores),
        "sent": dict(counters.sent),
        "calls": {phase: dict(c) for phase, c in counters.calls.items()},
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
    """Torch's context_parallel against the whole sequence, with each rotate method.

    Its ring kernels exist for CUDA's flash, efficient and cuDNN attention,
    in half precision or float32: float32 here, against float64. On a CPU it
    is tried once and raises (torch 2.10 to 2.14: NotImplementedError, no
    context-parallel rule for the CPU's flash kernel); the error is kept.
    Every rank must call it: the ring needs them all.
    """
    q, k, v = (data[n] for n in "qkv")
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    found = {}
    for rotate in (
        ("allgather", "alltoall") if device.type == "cuda" else ("allgather",)
    ):
        try:
            out = ra.torch_context_parallel(
                q.float(), k.float(), v.float(), device, rotate
            )
        except (NotImplementedError, RuntimeError) as err:  # said, not hidden
            found[rotate] = {
                "ran": False,
                "error": type(err).__name__,
                "message": str(err).strip().splitlines()[0],
            }
            continue
        found[rotate] = {
            "ran": True,
            "max_diff": (out.double() - reference).abs().max().item(),
        }
    return found


def held_out_loss(
    model, args, rank: int, world_size: int, device, positions_split: str
) -> float:
    """The mean loss over every rank's tokens of 4 x --batch-size new copy
    sequences, sharded with ``args.split``; the position embedding is given the
    positions of ``positions_split`` (the mistake when it is another split)."""
    generator = torch.Generator().manual_seed(args.seed + 1)  # not the training data
    x, y = ra.copy_batch(4 * args.batch_size, args.seq_len, args.vocab, generator)
    x, y = (ra.shard(t, 1, rank, world_size, args.split).to(device) for t in (x, y))
    pos = ra.positions(args.seq_len, rank, world_size, positions_split).to(device)
    with torch.no_grad():
        logits = model(x, pos, args.split)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        loss = loss / (4 * args.batch_size * args.seq_len)
        dist.all_reduce(loss)
    return loss.item()


def training(args: argparse.Namespace, rank: int, world_size: int, device) -> dict:
    """The script's copy model: a few float64 steps split here and whole on
    rank 0, two more without the all-reduce (a mistake), then the script's
    whole training run (float32) split here, its trained model scored with the
    right positions and with a plain split's (the other mistake)."""
    steps = ["--steps", str(args.train_steps), "--split", args.train_split]
    short, full = ra.parse_args(steps), ra.parse_args(["--split", args.train_split])
    two = ra.parse_args(["--steps", "2", "--split", args.train_split])  # mistakes

    def model(method: str) -> torch.nn.Module:
        torch.manual_seed(short.seed)
        return ra.CopyModel(
            short.vocab, short.seq_len, short.n_embd, short.n_head, method
        )

    split = ra.train(model("ring").to(device, DTYPE), short, rank, world_size, device)
    whole = (
        ra.train(model("local").to(device, DTYPE), short, 0, 1, device)
        if rank == 0
        else []
    )
    all_reduce = dist.all_reduce  # a mistake: each rank keeps its own gradients
    dist.all_reduce = lambda tensor, *args, **kwargs: None
    try:
        alone = model("ring").to(device, DTYPE)
        ra.train(alone, two, rank, world_size, device)
    finally:
        dist.all_reduce = all_reduce
    trained = model("ring").to(device)
    learned = ra.train(trained, full, rank, world_size, device)
    held_out = {  # the other mistake: a plain split's positions, zig-zag tokens
        where: held_out_loss(trained, full, rank, world_size, device, split_of)
        for where, split_of in (("right", full.split), ("plain split's", "plain"))
    }
    return {
        "split": short.split,
        "losses": split,
        "reference_losses": whole,
        "mistakes": {
            "weights without all-reduce": torch.cat(
                [p.detach().flatten() for p in alone.parameters()]
            ).tolist(),
        },
        "run": {
            "losses": learned,
            "held_out_losses": held_out,  # by the positions given
            **{k: v for k, v in vars(full).items() if k != "results"},
        },
    }


def judge(run: dict, everyone: list[dict], tol: float) -> tuple[dict, str]:
    """On rank 0: the results with their formulas, and the sentence for exit code 3."""
    B, H, T, D = run["shape"]
    N, fused = run["world_size"], run["device"] == "cpu"
    cases = []
    for i, case in enumerate(run["cases"]):
        mine = [e["cases"][i] for e in everyone]
        method, b = case["method"], 2 if case["dtype"] == "bfloat16" else 8
        work = ring_work_per_step(T, N, case["split"], case["causal"])
        size = (B, H, T, D, N, b)
        predicted = {
            "scores": [{"forward": w, "backward": w} for w in work]
            if method == "ring"
            else [{}] * N,
            "sent": [context_bytes_per_rank(method, *size, case["kv_heads"])] * N,
            "saved_bytes": [
                attention_saved_bytes(
                    method, *size, case["causal"], kv_heads=case["kv_heads"]
                )
            ]
            * N,
        }
        measured = {key: [m[key] for m in mine] for key in [*predicted, "calls"]}
        kernel = max(max(m["kernel_max_diff"].values(), default=0) for m in mine)
        allowed = KERNEL_FACTOR * kernel if case["dtype"] == "bfloat16" else tol
        cases.append(
            {
                **{
                    k: case[k]
                    for k in ("causal", "split", "method", "kv_heads", "dtype")
                },
                "max_diff": max(max(m["max_diff"].values()) for m in mine),
                "kernel_max_diff": kernel,  # SDPA's own, in this dtype (0: float64)
                "tolerance": allowed,
                "measured": measured,
                "predicted": predicted,
            }
        )
    unsplit = {
        m: attention_saved_bytes(m, B, H, T, D, 1, 8) for m in ("explicit", "sdpa")
    }
    train = everyone[0]["training"]
    loss_diff = max(
        abs(a - r) for a, r in zip(train["losses"], train["reference_losses"])
    )
    weights = [
        e["training"]["mistakes"]["weights without all-reduce"] for e in everyone
    ]
    mistakes = {
        "weights without all-reduce": max(
            abs(a - b) for w in weights[1:] for a, b in zip(w, weights[0])
        ),
    }
    # SDPA's formulas describe the CPU's fused kernel, which takes float64;
    # CUDA runs float64 SDPA on its math kernel, which keeps the probabilities:
    # there only the ring's bytes (its own autograd function) are predicted.
    counted = [c for c in cases if fused or c["method"] == "ring"]
    checks = {
        "outputs and gradients": all(c["max_diff"] <= c["tolerance"] for c in cases),
        "scores per step": all(
            c["measured"]["scores"] == c["predicted"]["scores"] for c in cases
        ),
        "bytes sent": all(
            c["measured"]["sent"] == c["predicted"]["sent"] for c in cases
        ),
        "saved bytes": all(
            c["measured"]["saved_bytes"] == c["predicted"]["saved_bytes"]
            for c in counted
        )
        and all(
            run["unsplit_saved_bytes"][m] == unsplit[m]
            for m in (("explicit", "sdpa") if fused else ("explicit",))
        ),
        "training": loss_diff <= tol,
    }
    worst = max(c["max_diff"] for c in cases if c["dtype"] == "float64")
    print0(
        f"{N} ranks: {len(cases)} cases, largest difference from the whole sequence "
        f"~{worst:.1e} (float64), from one process's training ~{loss_diff:.1e}"
    )
    print0(
        "checks: "
        + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in checks.items())
    )
    results = {
        **run,
        "cases": cases,
        "saved_bytes_predicted_for": "every case" if fused else "the ring's cases",
        "unsplit_saved_bytes": {
            "measured": run["unsplit_saved_bytes"],
            "predicted": unsplit,
        },
        "training": {**train, "max_loss_diff": loss_diff, "mistakes": mistakes},
        "tolerance": tol,
        "checks": checks,
    }
    return results, first_miss(checks)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--seq-len", type=int, default=48, help="positions (a multiple of 2 N)")
    add("--batch", type=int, default=2, help="sequences")
    add("--heads", type=int, default=4, help="attention heads (a multiple of N)")
    add("--head-dim", type=int, default=8, help="values per head")
    add("--train-steps", type=int, default=5, help="steps of the training comparison")
    add("--train-split", default="zigzag", help="the split of the training runs")
    add("--tolerance", type=float, help="of every comparison (default: 1e-10)")
    add("--seed", type=int, default=0, help="seed of q, k, v")
    add("--timeout", type=float, default=300, help="seconds to wait for other ranks")
    add("--results", help="a JSON file for rank 0's results")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, device) -> tuple[dict | None, str]:
    """Every case and count on this rank; rank 0's results and failure sentence."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.seq_len % (2 * world_size) or args.heads % world_size or args.heads % 2:
        ra.fail(
            f"--seq-len {args.seq_len} must be a multiple of 2 x {world_size}, and "
            f"--heads {args.heads} even and a multiple of {world_size}"
        )
    data = whole_sequence(args, device)
    H = args.heads
    cases = [
        {"causal": c, "split": s, "method": m, "kv_heads": H, "dtype": "float64"}
        for c, s, m in itertools.product(
            (False, True), ("plain", "zigzag"), ("ring", "allgather", "ulysses")
        )
    ] + [
        {
            "causal": True,
            "split": "zigzag",
            "method": "ring",
            "kv_heads": kv,
            "dtype": t,
        }
        for kv, t in ((H // 2, "float64"), (H, "bfloat16"))
    ]
    results = [check_case(case, data, rank, world_size) for case in cases]
    record = {"cases": results, "training": training(args, rank, world_size, device)}
    torch_cp = torch_context_parallel(data, device)  # on every rank
    everyone = every_rank(record)
    out, failure = None, ""
    if rank == 0:
        setting = {
            **ra.where_it_ran(device),
            "world_size": world_size,
            "shape": [args.batch, args.heads, args.seq_len, args.head_dim],
            "cases": cases,
            "unsplit_saved_bytes": unsplit_saved_bytes(data),
            "torch_context_parallel": torch_cp,
        }
        out, failure = judge(setting, everyone, tolerance("float64", args.tolerance))
    return out, failure


@record
def main() -> None:
    args = parse_args()
    _, _, device = ra.setup_distributed(args.timeout)
    finish(*run(args, device), args.results)


if __name__ == "__main__":
    main()
