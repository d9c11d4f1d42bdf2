"""Check expert_parallel.py against the same mixture of experts in one process.

    torchrun --standalone --nproc-per-node=4 companion/checks/expert_parallel.py

Each rank holds n_experts / N of the experts of the script's ``MoE`` layer
and routes its own tokens (one group per rank). In float64, the check
compares, by wrapping the script's ``send_slices`` (the all-to-all) and
counting FLOPs (``torch.utils.flop_counter``):

- the layer's output and the gradients of its input, its experts and its
  router (summed over the ranks) with the layer holding every expert in one
  process, run on each rank's tokens in turn: with fixed buffers (GShard's
  capacity), and dropless with renormalised gates and a shared expert;
- the tokens the experts receive (nonzero rows after the dispatch) and the
  results that come back, with the choices kept: every token accounted for;
- the bytes each rank sends to the others per all-to-all, from the slices it
  hands over: fixed buffers, and dropless slices as long as the routing;
- the rows the experts compute, from their FLOPs: every slot of the fixed
  buffers, only the choices dropless;
- the choices each expert gets from each rank, the dropped ones and each
  rank's rows for several capacity factors;
- a layer whose router starts out sending nearly every token to one expert
  (top-1, as in the Switch Transformer), trained to imitate a fixed MLP with
  and without the load-balancing loss: the busiest expert's load and the
  dropped tokens at every step, and what one step of the balance loss alone
  does to each expert's mean probability. These runs route 4 groups in one
  process (rank 0 without the loss, rank 1 with it): the same arithmetic as 4
  ranks, which the layer's comparison checks;
- the script's GPT trained a few steps with its experts split across the
  ranks, against the same model in one process (rank 0), loss by loss.

Rank 0 compares every count with its formula in ``companion.long_context``
and writes the results (``--results FILE``) for chapter 14. Exit codes: 0
every count meets its formula; 3 one missed, said in one sentence; 2 bad
input; 1 crashed.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.flop_counter import FlopCounterMode

from companion.checks._shared import every_rank, finish, first_miss, print0, tolerance
from companion.long_context import (
    all_to_all_bytes_per_rank,
    dropless_bytes_per_rank,
    dropped_tokens,
    expert_capacity,
    expert_flops_per_byte,
)
from companion.scripts import expert_parallel as ep

DTYPE = torch.float64


class Traffic:
    """What each call of ``send_slices`` on this rank sent and received."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    @contextlib.contextmanager
    def watching(self, phase: str) -> Iterator[None]:
        original = ep.send_slices
        rank, world_size = dist.get_rank(), dist.get_world_size()

        def send_slices(x: torch.Tensor, send=None, recv=None) -> torch.Tensor:
            out = original(x, send, recv)
            rows = out.reshape(out.shape[0], -1)
            row_bytes = rows.shape[1] * x.element_size()
            sizes = send or [x.shape[0] // world_size] * world_size
            self.calls.append(
                {
                    "phase": phase,
                    "what": "rows" if x.dim() > 1 else "counts",
                    "bytes_to_others": row_bytes * (sum(sizes) - sizes[rank]),
                    "nonzero_rows_received": int((rows != 0).any(dim=1).sum()),
                }
            )
            return out

        ep.send_slices = send_slices
        try:
            yield
        finally:
            ep.send_slices = original


def layer_config(args: argparse.Namespace, capacity_factor: float, top_k: int, **kw):
    return ep.GPTConfig(
        n_embd=args.width,
        n_experts=args.experts,
        top_k=top_k,
        capacity_factor=capacity_factor,
        **kw,
    )


def layers(config, rank: int, world_size: int):
    """The layer with this rank's experts, and the whole layer, equal at start."""
    torch.manual_seed(0)  # the router and the shared experts: the same everywhere
    split = ep.MoE(config, rank, world_size).to(DTYPE)
    whole = ep.MoE(config).to(DTYPE)
    torch.manual_seed(0)
    whole.router.load_state_dict(split.router.state_dict())
    if split.shared is not None:
        whole.shared.load_state_dict(split.shared.state_dict())
    return split, whole


def all_tokens(args: argparse.Namespace, world_size: int) -> torch.Tensor:
    """Every rank's tokens, (N, tokens, width): each rank can make all of them."""
    g = torch.Generator().manual_seed(args.seed)
    return torch.randn(world_size, args.tokens, args.width, generator=g, dtype=DTYPE)


def expert_flops(moe: ep.MoE, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The layer's output, and the FLOPs of its experts (router and shared aside)."""
    with FlopCounterMode(display=False) as counter:
        y = moe(x)
    counts = counter.get_flop_counts()

    def total(name: str) -> int:
        return sum(counts.get(name, {}).values())

    return y, total("MoE") - total("MoE.router") - total("MoE.shared")


def check_layer(args, rank: int, world_size: int, device, **config) -> dict:
    """The split layer against the whole one: output, gradients, traffic, FLOPs."""
    factor = config.pop("capacity_factor", args.capacity_factor)
    split, whole = layers(
        layer_config(args, factor, args.top_k, **config), rank, world_size
    )
    split, whole = split.to(device), whole.to(device)
    tokens = all_tokens(args, world_size).to(device)
    x = tokens[rank][None].clone().requires_grad_()
    traffic = Traffic()
    with traffic.watching("forward"):
        y, flops = expert_flops(split, x)
    with traffic.watching("backward"):
        y.backward(torch.ones_like(y))  # the gradient of sum(y)
    replicated = [split.router, *([split.shared] if split.shared else [])]
    for p in (p for module in replicated for p in module.parameters()):
        dist.all_reduce(p.grad)  # data parallel: summed over the ranks
    counts = []
    for r in range(world_size):  # the whole layer on each rank's group in turn
        xr = tokens[r][None].clone().requires_grad_()
        yr = whole(xr)
        yr.backward(torch.ones_like(yr))
        counts.append(whole.load.tolist())
        if r == rank:
            expected = (yr.detach(), xr.grad)
    mine = slice(rank * split.local, (rank + 1) * split.local)
    pairs = {
        "output": (y.detach(), expected[0]),
        "input gradient": (x.grad, expected[1]),
        "expert gradients": (
            torch.cat([split.fc.grad.flatten(), split.proj.grad.flatten()]),
            torch.cat([whole.fc.grad[mine].flatten(), whole.proj.grad[mine].flatten()]),
        ),
        "router and shared gradients": (
            torch.cat([p.grad.flatten() for m in replicated for p in m.parameters()]),
            torch.cat(
                [
                    p.grad.flatten()
                    for m in [whole.router, *([whole.shared] if whole.shared else [])]
                    for p in m.parameters()
                ]
            ),
        ),
    }
    return {
        "max_diff": {k: (a - b).abs().max().item() for k, (a, b) in pairs.items()},
        "counts": counts,  # [source rank][expert], from the whole layer
        "capacity": split.capacity(args.tokens),
        "traffic": traffic.calls,
        "expert_flops": flops,
    }


def capacity_sweep(args, rank: int, world_size: int, device) -> list[dict]:
    """Choices, the rows the experts receive and compute, for several capacity factors."""
    rows = []
    tokens = all_tokens(args, world_size).to(device)
    for factor in args.sweep:
        split, _ = layers(layer_config(args, factor, args.top_k), rank, world_size)
        traffic = Traffic()
        with torch.no_grad(), traffic.watching("forward"):
            _, flops = expert_flops(split.to(device), tokens[rank][None])
        rows.append(
            {
                "capacity_factor": factor,
                "capacity": split.capacity(args.tokens),
                "counts": split.load.tolist(),  # this rank's choices per expert
                "received": traffic.calls[0]["nonzero_rows_received"],
                "returned": traffic.calls[1]["nonzero_rows_received"],
                "rows_computed": flops // (2 * 2 * args.width * 4 * args.width),
            }
        )
    return rows


def balance_run(args, world_size: int, device, weight: float) -> dict:
    """A top-1 layer whose router favours expert 0, trained to imitate a fixed MLP,
    its tokens routed as ``world_size`` groups; the busiest expert's share of the
    tokens and the dropped ones, step by step; and the experts' mean probability
    before and after one step of the balance loss alone, from the start."""
    torch.manual_seed(0)
    moe = ep.MoE(layer_config(args, args.capacity_factor, 1)).to(device, DTYPE)
    g = torch.Generator().manual_seed(args.seed + 1)
    favoured = torch.randn(args.width, generator=g, dtype=DTYPE)
    favoured /= favoured.norm()
    with torch.no_grad():  # tokens lean towards one direction, and so does expert 0
        moe.router.weight[0] += favoured.to(device)
    teacher = torch.nn.Sequential(
        torch.nn.Linear(args.width, 2 * args.width),
        torch.nn.GELU(),
        torch.nn.Linear(2 * args.width, args.width),
    ).to(device, DTYPE)

    def batch() -> torch.Tensor:
        x = torch.randn(world_size, args.tokens, args.width, generator=g, dtype=DTYPE)
        return (x + 2 * favoured).to(device)

    def mean_probs(x: torch.Tensor) -> list[float]:
        with torch.no_grad():
            return moe.router(x).softmax(dim=-1).mean(dim=(0, 1)).tolist()

    probe = batch()
    router = torch.nn.Linear(args.width, args.experts, bias=False).to(device, DTYPE)
    router.load_state_dict(moe.router.state_dict())
    before, original = mean_probs(probe), moe.router
    moe.router = router  # one SGD step on a copy, with the balance loss alone
    moe(probe[:1])
    moe.aux_loss.backward()
    with torch.no_grad():
        router.weight -= 0.1 * router.weight.grad
    after = mean_probs(probe)
    moe.router = original
    optimizer = torch.optim.Adam(moe.parameters(), lr=args.balance_lr)
    busiest, dropped = [], []
    for _ in range(args.balance_steps):
        x = batch()
        with torch.no_grad():
            target = teacher(x)
        loss, load, drop = 0, 0, 0
        for group, goal in zip(x, target):  # each rank's tokens, routed alone
            out = moe(group[None])[0]
            loss = loss + F.mse_loss(out, goal) + weight * moe.aux_loss
            load = load + moe.load
            drop += int((moe.load - moe.capacity(args.tokens)).clamp(min=0).sum())
        optimizer.zero_grad()
        (loss / world_size).backward()
        optimizer.step()
        busiest.append(load.max().item() / load.sum().item())
        dropped.append(drop)
    return {
        "aux_weight": weight,
        "busiest_share": busiest,
        "dropped": dropped,
        "mean_probability": {"before": before, "after": after},
    }


def training(args, rank: int, world_size: int, device) -> dict:
    """The script's GPT in float64: experts split over the ranks, whole on rank 0."""
    train_args = ep.parse_args(
        ["--steps", str(args.train_steps), "--experts", str(args.experts)]
        + ["--batch-size", str(8 * world_size)]  # 8 sequences per process
    )
    split = ep.train(
        ep.build(train_args, rank, world_size).to(device, DTYPE),
        train_args,
        rank,
        world_size,
        device,
    )
    whole = {}
    if rank == 0:
        model = ep.build(train_args, 0, 1).to(device, DTYPE)
        whole = ep.train(model, train_args, 0, 1, device, groups=world_size)
    return {"split": split, "whole": whole}


def kept_rows(counts: list[list[int]], capacity: int, local: int) -> tuple[list, list]:
    """Rows each rank's experts receive (dispatch), and rows each rank gets back."""
    N = len(counts)
    kept = [[min(c, capacity) for c in row] for row in counts]
    received = [
        sum(kept[s][e] for s in range(N) for e in range(r * local, (r + 1) * local))
        for r in range(N)
    ]
    return received, [sum(row) for row in kept]


def judge(run: dict, everyone: list[dict], tol: float) -> tuple[dict, str]:
    """On rank 0: the results with their formulas, and the sentence for exit code 3."""
    N, E, k, S, d = (
        run[key] for key in ("world_size", "experts", "top_k", "tokens", "width")
    )
    local, b = E // N, run["dtype_bytes"]
    layer, dropless = everyone[0]["layer"], everyone[0]["dropless"]
    counts, C = layer["counts"], layer["capacity"]
    padded_bytes = all_to_all_bytes_per_rank(E, C, d, N, b)
    expected_calls = [
        {"phase": phase, "bytes_to_others": padded_bytes}
        for phase in ("forward", "forward", "backward", "backward")
    ]
    # dispatch: rank r's experts receive the kept choices of every rank; combine:
    # rank r gets back its own kept choices (backward: the same rows, reversed)
    received, returned = kept_rows(counts, C, local)
    rows_per_call = [[rec, ret, rec, ret] for rec, ret in zip(received, returned)]
    measured_calls = [e["layer"]["traffic"] for e in everyone]
    moved = dropless_bytes_per_rank(dropless["counts"], d, b)
    expected_dropless = [  # forward: rows there, results back; backward: the
        [m["dispatch"], m["combine"]] * 2
        for m in moved  # results' gradients to
    ]  # the experts (as many bytes as the dispatch), then the rows' back
    measured_dropless = [
        [c["bytes_to_others"] for c in e["dropless"]["traffic"] if c["what"] == "rows"]
        for e in everyone
    ]
    per_row = 2 * 2 * d * 4 * d  # two products of an expert MLP
    flops = {
        "fixed buffers": [e["layer"]["expert_flops"] // per_row for e in everyone],
        "dropless": [e["dropless"]["expert_flops"] // per_row for e in everyone],
    }
    sweep = []
    for i, row in enumerate(everyone[0]["sweep"]):
        per_rank = [e["sweep"][i] for e in everyone]
        C_i = expert_capacity(S, E, k, row["capacity_factor"])
        choices = [r["counts"] for r in per_rank]
        received_i, returned_i = kept_rows(choices, C_i, local)
        sweep.append(
            {
                "capacity_factor": row["capacity_factor"],
                "capacity": {"measured": row["capacity"], "predicted": C_i},
                "choices": choices,
                "dropped": {
                    "measured": N * S * k - sum(r["received"] for r in per_rank),
                    "predicted": sum(dropped_tokens(r, C_i) for r in choices),
                },
                "received": {
                    "measured": [r["received"] for r in per_rank],
                    "predicted": received_i,
                },
                "returned": {
                    "measured": [r["returned"] for r in per_rank],
                    "predicted": returned_i,
                },
                "rows_computed": {
                    "measured": [r["rows_computed"] for r in per_rank],
                    "predicted": [E * C_i] * N,
                },
            }
        )
    train = everyone[0]["training"]
    loss_diff = max(
        abs(a - r) for a, r in zip(train["split"]["loss"], train["whole"]["loss"])
    )
    worst = {
        name: max(v for e in everyone for v in e[name]["max_diff"].values())
        for name in ("layer", "dropless")
    }
    checks = {
        "layer": max(worst.values()) <= tol,
        "all-to-all bytes": all(
            [
                {"phase": c["phase"], "bytes_to_others": c["bytes_to_others"]}
                for c in calls
            ]
            == expected_calls
            for calls in measured_calls
        )
        and measured_dropless == expected_dropless,
        "tokens": all(
            [c["nonzero_rows_received"] for c in calls] == rows
            for calls, rows in zip(measured_calls, rows_per_call)
        ),
        "rows computed": flops["fixed buffers"] == [E * C] * N
        and flops["dropless"] == kept_rows(dropless["counts"], S, local)[0],
        "capacity": all(
            row[key]["measured"] == row[key]["predicted"]
            for row in sweep
            for key in ("capacity", "dropped", "received", "returned", "rows_computed")
        ),
        "training": loss_diff <= tol
        and train["split"]["load"] == train["whole"]["load"],
    }
    print0(
        f"{N} ranks, {E} experts: the layer differs from one process by "
        f"~{worst['layer']:.1e} (dropless ~{worst['dropless']:.1e}), the GPT's "
        f"losses by ~{loss_diff:.1e}"
    )
    print0(
        "checks: "
        + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in checks.items())
    )
    results = {
        **run,
        "layer": {
            "max_diff": [e["layer"]["max_diff"] for e in everyone],
            "counts": counts,
            "capacity": C,
            "traffic": {
                "measured": measured_calls,
                "predicted_bytes": expected_calls,
                "predicted_rows": rows_per_call,
            },
        },
        "dropless": {
            "max_diff": [e["dropless"]["max_diff"] for e in everyone],
            "counts": dropless["counts"],
            "bytes": {"measured": measured_dropless, "predicted": expected_dropless},
        },
        "rows_computed": flops,
        "flops_per_byte": {
            "measured": [
                e["layer"]["expert_flops"]
                / sum(c["bytes_to_others"] for c in calls if c["phase"] == "forward")
                for e, calls in zip(everyone, measured_calls)
            ],
            "predicted": expert_flops_per_byte(4 * d, b, N),
        },
        "sweep": sweep,
        "balance": [e["balance"] for e in everyone[:2]],
        "training": {**train, "max_loss_diff": loss_diff},
        "tolerance": tol,
        "checks": checks,
    }
    return results, first_miss(checks)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--experts", type=int, default=8, help="experts (a multiple of N)")
    add("--top-k", type=int, default=2, help="experts per token")
    add("--capacity-factor", type=float, default=1.25, help="of the layer check")
    add("--sweep", type=float, nargs="+", default=[0.5, 1.0, 1.25, 2.0, 4.0])
    add("--tokens", type=int, default=128, help="tokens per rank")
    add("--width", type=int, default=16, help="model width d")
    add("--balance-steps", type=int, default=30, help="steps of the balance runs")
    add("--balance-lr", type=float, default=0.01, help="Adam's, in the balance runs")
    add("--train-steps", type=int, default=3, help="steps of the GPT comparison")
    add("--tolerance", type=float, help="of every comparison (default: 1e-10)")
    add("--seed", type=int, default=0, help="seed of the tokens")
    add("--timeout", type=float, default=300, help="seconds to wait for other ranks")
    add("--results", help="a JSON file for rank 0's results")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, device) -> tuple[dict | None, str]:
    """Every comparison and count on this rank; rank 0's results and failure."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.experts % world_size or not 1 <= args.top_k <= args.experts:
        ep.fail(
            f"--experts {args.experts} must be a multiple of {world_size}, "
            "and --top-k between 1 and --experts"
        )
    if world_size < 2:
        ep.fail("the check compares ranks: start at least 2 processes")
    record = {
        "layer": check_layer(args, rank, world_size, device),
        "dropless": check_layer(
            args,
            rank,
            world_size,
            device,
            capacity_factor=0,
            normalize_gates=True,
            n_shared=1,
        ),
        "sweep": capacity_sweep(args, rank, world_size, device),
        "balance": balance_run(args, world_size, device, (0.0, 0.01)[rank])
        if rank < 2
        else {},
        "training": training(args, rank, world_size, device),
    }
    everyone = every_rank(record)
    results, failure = None, ""
    if rank == 0:
        setting = {
            **ep.where_it_ran(device),
            "world_size": world_size,
            "experts": args.experts,
            "top_k": args.top_k,
            "tokens": args.tokens,
            "width": args.width,
            "dtype_bytes": DTYPE.itemsize,
        }
        results, failure = judge(
            setting, everyone, tolerance("float64", args.tolerance)
        )
    return results, failure


@record
def main() -> None:
    args = parse_args()
    _, _, device = ep.setup_distributed(args.timeout)
    finish(*run(args, device), args.results)


if __name__ == "__main__":
    main()
