"""Training memory: state bytes and saved activations, counted and predicted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from companion import CourseError
from companion.gpt import GPT, GPTConfig, lm_loss, saved_activation_bytes_formula
from companion.memory import (
    Checkpointed,
    SavedTensors,
    memory_timeline,
    shard_rows,
    state_bytes,
    state_bytes_formula,
    tensor_bytes,
)

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 6)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_state_formula_matches_the_tensors(name: str, dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).to(dtype)
    optimizer = OPTIMIZERS[name](model.parameters())
    model(torch.randn(4, 6, dtype=dtype)).square().mean().backward()
    optimizer.step()
    params = list(model.parameters())
    predicted = state_bytes_formula(
        sum(p.numel() for p in params), name, n_tensors=len(params), dtype=dtype
    )
    assert state_bytes(model, optimizer) == predicted
    assert predicted["parameters"] == 53 * dtype.itemsize


def test_gradients_and_state_count_only_once_they_exist() -> None:
    model = nn.Linear(6, 5)
    optimizer = OPTIMIZERS["adam"](model.parameters())
    assert state_bytes(model, optimizer) == {
        "parameters": 35 * 4,
        "gradients": 0,
        "optimizer state": 0,
    }
    one_step(model, optimizer)
    assert state_bytes(model, optimizer)["optimizer state"] == 2 * 35 * 4 + 2 * 4


def test_an_unknown_optimizer_is_one_sentence() -> None:
    with pytest.raises(
        CourseError,
        match=r"^no formula for the optimizer 'lion'; choose one of sgd, "
        r"sgd-momentum, adam\.$",
    ):
        state_bytes_formula(10, "lion")


def test_adam_step_counters_count_only_when_the_tensors_are_given() -> None:
    assert state_bytes_formula(10, "adam")["optimizer state"] == 2 * 10 * 4
    with_steps = state_bytes_formula(10, "adam", n_tensors=3)["optimizer state"]
    assert with_steps == 2 * 10 * 4 + 3 * 4


def test_saved_tensors_count_what_backward_needs() -> None:
    x = torch.randn(100, requires_grad=True)
    with SavedTensors() as saved:
        y = x.exp()  # keeps its output
    assert saved.nbytes == 400
    with SavedTensors() as saved:
        (x * x.exp()).sum()  # keeps x and exp(x)
    assert saved.nbytes == 800
    with SavedTensors() as saved:
        (x + 1).sum()  # an addition keeps nothing
    assert saved.nbytes == 0
    y.sum().backward()
    torch.testing.assert_close(x.grad, x.exp())


def test_views_of_one_storage_count_once_and_whole() -> None:
    x = torch.randn(100, requires_grad=True)
    with SavedTensors() as saved:
        (x[:10] * x[50:60]).sum()
    assert saved.nbytes == 400


def test_excluded_tensors_do_not_count() -> None:
    layer = nn.Linear(10, 20)
    x = torch.randn(8, 10, requires_grad=True)
    with SavedTensors() as everything:
        layer(x)
    with SavedTensors(exclude=layer.parameters()) as activations:
        layer(x)
    assert activations.nbytes == 8 * 10 * 4  # the input only
    assert everything.nbytes == activations.nbytes + 10 * 20 * 4  # and the weight


def test_saved_storages_stay_live_until_backward_frees_them() -> None:
    """What a pipeline stage holds: live bytes rise in forward, fall in backward."""
    layer = nn.Linear(16, 16, bias=False)
    x = torch.randn(8, 16, requires_grad=True)
    with SavedTensors(layer.parameters()) as saved:
        h = layer(x)
        y = torch.tanh(h)  # saves its output, 8 x 16 float32
        z = (y * y).sum()  # saves y once, though twice as an argument
        assert saved.live == saved.nbytes == 8 * 16 * 4 * 2  # x (weight grad), y
        z.backward()
        assert saved.live == 0  # backward let go of everything
        layer(x).sum()  # a second forward pass, dropped at once
    assert saved.peak == 8 * 16 * 4 * 2
    assert saved.nbytes == 8 * 16 * 4 * 3  # x counted again: it became live again
    assert saved.live == 0


def test_tensor_bytes_count_elements_and_the_storage_behind_them() -> None:
    whole = torch.zeros(10, 4)  # 160 bytes of storage
    rows = whole[:3]  # a view: 48 bytes of elements
    assert tensor_bytes([rows]) == {"local": 48, "storage": 160}
    assert tensor_bytes([rows, whole[5:]]) == {"local": 48 + 80, "storage": 160}
    assert tensor_bytes([]) == {"local": 0, "storage": 0}


@pytest.mark.parametrize("rows, parts", [(64, 4), (45, 4), (3, 4), (45, 2), (1, 3)])
def test_shard_rows_follow_torch_chunk(rows: int, parts: int) -> None:
    chunks = torch.arange(rows).chunk(parts)
    expected = [len(chunks[i]) if i < len(chunks) else 0 for i in range(parts)]
    assert [shard_rows(rows, parts, i) for i in range(parts)] == expected


@pytest.mark.parametrize("sdpa", [False, True])
@pytest.mark.parametrize("seq_len", [16, 64])
def test_the_activation_formula_matches_the_saved_tensors(
    sdpa: bool, seq_len: int
) -> None:
    config = GPTConfig(vocab_size=40, block_size=64, sdpa=sdpa)
    model = GPT(config)
    x = torch.randint(40, (3, seq_len))
    y = torch.randint(40, (3, seq_len))
    with SavedTensors(exclude=[*model.parameters(), *model.buffers()]) as saved:
        loss = lm_loss(model(x), y)
    formula = saved_activation_bytes_formula(config, 3, seq_len)
    assert list(formula) == ["blocks", "embedding and head"]
    # Exact but for one float32 scalar the loss keeps (cross-entropy's total
    # weight), which the formula leaves out: 4 bytes in a few hundred thousand.
    assert saved.nbytes - sum(formula.values()) == 4
    loss.backward()  # the hooks handed back what autograd needs
    assert all(p.grad is not None for p in model.parameters())


def test_a_checkpointed_module_keeps_its_input_only_and_gives_the_same_gradients() -> (
    None
):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(10, 40), nn.GELU(), nn.Linear(40, 10))
    x = torch.randn(8, 10, requires_grad=True)
    results = {}
    for name, module in {"plain": mlp, "checkpointed": Checkpointed(mlp)}.items():
        mlp.zero_grad()
        x.grad = None
        with SavedTensors(exclude=mlp.parameters()) as saved:
            loss = module(x).square().sum()
        loss.backward()
        results[name] = saved.nbytes, [p.grad.clone() for p in mlp.parameters()]
    plain_bytes, plain_grads = results["plain"]
    kept_bytes, kept_grads = results["checkpointed"]
    assert plain_bytes == 8 * (10 + 40 + 40 + 10) * 4  # inputs, GELU in/out, output
    assert kept_bytes == 8 * 10 * 4 + 8 * 10 * 4  # the input, and the loss's square
    for plain, kept in zip(plain_grads, kept_grads):
        assert torch.equal(plain, kept)


def test_the_timeline_sorts_a_training_step_into_categories(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the profiler's export must not land here
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(128, 32)
    n_bytes = 4 * sum(p.numel() for p in model.parameters())
    live: dict[str, torch.Tensor] = {}
    timeline = memory_timeline(
        {
            "forward": lambda: live.update(loss=model(x).square().mean()),
            "backward": lambda: live.pop("loss").backward(),
            "step": optimizer.step,
        }
    )
    assert list(timeline.phases) == ["forward", "backward", "step"]
    assert timeline.times == sorted(timeline.times)
    assert timeline.at_end_of("forward", "parameters") == n_bytes
    assert timeline.at_end_of("forward", "activations") >= 128 * 64 * 4  # ReLU's output
    assert timeline.at_end_of("backward", "activations") == 0
    assert timeline.at_end_of("backward", "gradients") == n_bytes
    # Adam: two moments per parameter and a float32 step counter per tensor.
    assert timeline.at_end_of("step", "optimizer state") == 2 * n_bytes + 4 * 4
    assert timeline.peak() >= timeline.at_end_of("forward")
    assert timeline.peak("parameters") == n_bytes < timeline.peak()
    # The phases follow each other on the timeline's own clock (seconds).
    (f0, f1), (b0, b1), (s0, s1) = timeline.phases.values()
    assert f0 == 0 <= timeline.times[0]  # the clock starts with the first phase
    assert f0 <= f1 <= b0 <= b1 <= s0 <= s1 < 60  # seconds, not microseconds
    assert list(tmp_path.iterdir()) == []
