"""companion.collectives: collectives counted by kind, bytes and phase.

In one gloo process of its own, so that every count is exact; the launches of
the scripts' checks count FSDP2's and DTensor's collectives on 2 and 4
processes against formulas (tests/test_scripts_*.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpt_scripts import one_process_group
from torch import nn

from companion.collectives import CollectiveCounter, add_counts


@pytest.fixture(autouse=True)
def group():
    with one_process_group():
        yield


class SumGradient(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient (Megatron-LM's f)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class SumOutput(torch.autograd.Function):
    """All-reduce forward; identity backward (Megatron-LM's g)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SumOutput.apply(self.layer(SumGradient.apply(x)))  # 5 x 3: 60 bytes


def test_each_phase_counts_its_own_collectives() -> None:
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *_: dist.all_reduce(torch.ones(2)))
    x = torch.randn(5, 4, requires_grad=True)
    with CollectiveCounter().follow(model, optimizer) as counter:
        model(x).sum().backward()  # the gradient of x: 5 x 4 float32, 80 bytes
        optimizer.step()

    def row(n: int) -> dict:
        return {"all-reduce": {"calls": 1, "input_bytes": n, "output_bytes": n}}

    assert counter.counts == {
        "forward": row(60),
        "backward": row(80),
        "optimizer": row(8),
    }
    assert counter.total() == {
        "all-reduce": {"calls": 3, "input_bytes": 148, "output_bytes": 148}
    }
    # The hooks are gone with the block: nothing switches phases any more.
    counter.phase = "forward"
    optimizer.step()
    assert counter.phase == "forward"


def test_an_all_gather_counts_its_input_and_output() -> None:
    shard = torch.arange(6.0)
    gathered = torch.empty(6)
    # FSDP2's calls: the *_single names in torch 2.14, the *_tensor ones before.
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    with CollectiveCounter() as counter:
        all_gather(gathered, shard)
        reduce_scatter(shard, gathered)
    assert counter.total() == {
        "all-gather": {"calls": 1, "input_bytes": 24, "output_bytes": 24},
        "reduce-scatter": {"calls": 1, "input_bytes": 24, "output_bytes": 24},
    }


def test_no_collective_counts_nothing() -> None:
    with CollectiveCounter() as counter:
        torch.ones(3).sum()
    assert counter.counts == {"forward": {}, "backward": {}, "optimizer": {}}
    assert counter.total() == {}


def test_counts_add_up() -> None:
    a = {"all-reduce": {"calls": 1, "input_bytes": 4, "output_bytes": 4}}
    b = {
        "all-reduce": {"calls": 2, "input_bytes": 8, "output_bytes": 8},
        "all-gather": {"calls": 1, "input_bytes": 2, "output_bytes": 4},
    }
    assert add_counts(a, b, {}) == {
        "all-reduce": {"calls": 3, "input_bytes": 12, "output_bytes": 12},
        "all-gather": {"calls": 1, "input_bytes": 2, "output_bytes": 4},
    }
    assert add_counts() == {}


def test_a_model_run_twice_in_one_block_is_counted_twice() -> None:
    """Two micro-batches under one counter: the module tracker of torch 2.10 and
    2.11 (before pytorch/pytorch#191452) raised an IndexError at the second
    forward pass; the counter carries the fix."""
    model = Model()
    with CollectiveCounter().follow(model) as counter:
        for _ in range(2):
            model(torch.randn(5, 4, requires_grad=True)).sum().backward()
        hooks = len(model.layer._forward_hooks)  # the tracker's, one per module
    assert counter.total() == {
        "all-reduce": {"calls": 4, "input_bytes": 280, "output_bytes": 280}
    }
    assert hooks == 1  # without the fix: one per forward pass (2)
    assert not model.layer._forward_hooks  # all removed when the block ends
