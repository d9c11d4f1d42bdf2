"""Tests of companion.ensemble: functional training, vmap vs loop, compiled step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.func import functional_call, vmap

from companion.data import make_spirals
from companion.ensemble import (
    MLP,
    SGD,
    Adam,
    benchmark_ensemble,
    format_speed_table,
    init_ensemble,
    make_train_step,
    predict_grid,
    sample_subsets,
    stack,
    train_loop,
    train_vmap,
    unstack,
)

# vmap and the loop run the same float32 arithmetic; batched kernels may sum
# in another order, so after TOLERANCE_STEPS steps we allow this much.
TOLERANCE = 1e-5
TOLERANCE_STEPS = 30


@pytest.fixture(autouse=True)
def _one_thread():
    """The models are tiny: one thread, as in chapter 10 (and no spinning threads on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def spirals() -> tuple[torch.Tensor, torch.Tensor]:
    return make_spirals(100, noise_std=0.05, generator=torch.Generator().manual_seed(0))


def test_one_model_trains(spirals):
    points, labels = spirals
    model = MLP()
    params = {k: v.detach() for k, v in model.named_parameters()}
    optimizer = SGD(lr=0.2)
    state = optimizer.init(params)
    step = make_train_step(model, optimizer)
    losses = []
    for _ in range(300):
        loss, params, state = step(params, state, points, labels)
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0]
    # the step is pure: the module's own parameters are untouched
    assert not torch.equal(model.fc1.weight, params["fc1.weight"])


def test_functional_call_on_template_matches_module(spirals):
    points, _ = spirals
    torch.manual_seed(1)
    model = MLP()
    torch.manual_seed(1)
    template, params, _ = init_ensemble(1, SGD())
    member = unstack(params, 1)[0]
    torch.testing.assert_close(
        functional_call(template, member, (points,)), model(points)
    )


def test_adam_matches_torch_optim(spirals):
    points, labels = spirals
    model = MLP()
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    adam = Adam(lr=0.05)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = adam.init(params)
    step = make_train_step(model, adam)
    torch_adam = torch.optim.Adam(reference.parameters(), lr=0.05)
    for _ in range(20):
        _, params, state = step(params, state, points, labels)
        torch_adam.zero_grad()
        torch.nn.functional.cross_entropy(reference(points), labels).backward()
        torch_adam.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("optimizer", [SGD(), Adam(lr=0.02)], ids=["sgd", "adam"])
@pytest.mark.parametrize(
    "subset_size", [None, 32], ids=["shared-data", "per-model-subsets"]
)
def test_vmap_ensemble_equals_python_loop(spirals, optimizer, subset_size):
    points, labels = spirals
    template, params, state = init_ensemble(4, optimizer)
    step = make_train_step(template, optimizer)
    args = (step, params, state, points, labels, TOLERANCE_STEPS)
    v_loss, v_params, v_state = train_vmap(*args, subset_size=subset_size, seed=3)
    l_loss, l_params, l_state = train_loop(*args, subset_size=subset_size, seed=3)
    assert v_loss.shape == (TOLERANCE_STEPS, 4)
    torch.testing.assert_close(v_loss, l_loss, atol=TOLERANCE, rtol=0)
    for k in params:
        torch.testing.assert_close(v_params[k], l_params[k], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(v_state, l_state, atol=TOLERANCE, rtol=0)
    # training moved the parameters and lowered every member's loss
    assert not torch.equal(v_params["fc1.weight"], params["fc1.weight"])
    assert (v_loss[-5:].mean(0) < v_loss[:5].mean(0)).all()


def test_members_see_different_data_with_subsets(spirals):
    points, labels = spirals
    template, params, state = init_ensemble(2, SGD())
    # two identical members: only their data can make them differ
    params = {k: v[:1].expand_as(v).clone() for k, v in params.items()}
    step = make_train_step(template, SGD())
    _, shared, _ = train_vmap(step, params, state, points, labels, 5)
    _, subsets, _ = train_vmap(step, params, state, points, labels, 5, subset_size=50)
    assert torch.equal(shared["fc1.weight"][0], shared["fc1.weight"][1])
    assert not torch.allclose(subsets["fc1.weight"][0], subsets["fc1.weight"][1])


def test_sample_subsets():
    idx = sample_subsets(3, 10, 4, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (3, 4)
    assert all(len(set(row.tolist())) == 4 for row in idx)
    assert ((idx >= 0) & (idx < 10)).all()
    assert not all(torch.equal(idx[0], row) for row in idx[1:])
    with pytest.raises(ValueError, match="subset_size"):
        sample_subsets(3, 10, 11)


def test_unstack_and_stack_round_trip():
    _, params, state = init_ensemble(3, Adam())
    members = unstack(state, 3)
    assert members[0]["exp_avg"]["fc1.weight"].shape == (32, 2)
    torch.testing.assert_close(stack(members), state)
    assert unstack({}, 2) == [{}, {}]
    with pytest.raises(ValueError, match="at least one model"):
        init_ensemble(0, SGD())


def test_predict_grid_is_each_members_probability_of_class_1():
    template, params, _ = init_ensemble(3, SGD())
    # Different ranges and lengths along x and y: a transposed grid cannot pass.
    xs, ys = torch.linspace(-1, 1, 5), torch.linspace(-0.5, 2, 4)
    probs = predict_grid(template, params, xs, ys)
    assert probs.shape == (3, 4, 5)  # (models, rows = y, columns = x)
    for m, member in enumerate(unstack(params, 3)):
        for i, y in enumerate(ys):
            for j, x in enumerate(xs):
                logits = functional_call(template, member, (torch.stack([x, y])[None],))
                expected = torch.softmax(logits, dim=1)[0, 1]
                torch.testing.assert_close(probs[m, i, j], expected)
    assert not torch.allclose(probs[0], probs[1])  # members differ


@pytest.mark.timeout(300)
def test_compiled_vmap_step_equals_eager(spirals):
    points, labels = spirals
    adam = Adam(lr=0.02)
    template, params, state = init_ensemble(3, adam)
    idx = sample_subsets(3, 100, 32, generator=torch.Generator().manual_seed(0))
    batch = (points[idx], labels[idx])
    eager = vmap(make_train_step(template, adam))
    compiled = torch.compile(eager, fullgraph=True, dynamic=False)
    e_params, e_state, c_params, c_state = params, state, params, state
    for _ in range(3):  # the step counter is a tensor: no recompilation per step
        e_loss, e_params, e_state = eager(e_params, e_state, *batch)
        c_loss, c_params, c_state = compiled(c_params, c_state, *batch)
    torch.testing.assert_close(c_loss, e_loss, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(c_params, e_params, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(c_state, e_state, atol=TOLERANCE, rtol=0)


@pytest.mark.timeout(300)
def test_benchmark_ensemble_reports_every_count():
    torch._dynamo.reset()  # no entries left by other tests' compiled vmaps (they share a code object)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # Dynamo's limit of compiled versions is lifted to one per model count.
    with torch._dynamo.config.patch(recompile_limit=1):
        rows = benchmark_ensemble([1, 3], min_run_time=0.01)
    if not os.environ.get("MUTANT_UNDER_TEST"):  # `make mutation` runs it eagerly
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    assert [row["models"] for row in rows] == [1, 3]
    for n, row in zip([1, 3], rows):
        for key, name in [
            ("module loop", "module loop"),
            ("loop", "loop"),
            ("vmap", "vmap"),
            ("compiled", "compiled vmap"),
        ]:
            assert row[key].label == f"{name}, {n} models"
        assert row["compile"] > 0
    lines = format_speed_table(rows).splitlines()
    # A title, two header lines, a rule, the rows, the hardware line.
    assert lines[1].split()[:3] == ["module", "functional", "eager"]
    assert lines[2].split()[:3] == ["models", "loop", "loop"]
    assert [line.split()[0] for line in lines[4:6]] == ["1", "3"]
    speed_up = rows[1]["module loop"].median / rows[1]["compiled"].median
    assert f"{speed_up:.1f}" in lines[5]
    assert len(lines) == 7 and lines[-1].startswith("Measured on:")
    with pytest.raises(ValueError, match="model_counts"):
        benchmark_ensemble([0])
    with pytest.raises(ValueError, match="model_counts"):
        benchmark_ensemble([])


def test_benchmark_script_rejects_bad_input():
    script = Path(__file__).parents[1] / "benchmarks" / "ensemble_speed.py"
    result = subprocess.run(
        [sys.executable, str(script), "--models", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "--models and --threads need positive numbers, --min-run-time a positive time."
    ]
