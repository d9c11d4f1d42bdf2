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
    plot_probability_map,
    predict_grid,
    sample_subsets,
    speed_verdicts,
    stack,
    train_loop,
    train_vmap,
    unstack,
)
from companion.harness.timing import Timing

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
@pytest.mark.slow
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


@pytest.mark.slow  # chapter 10 runs benchmark_ensemble in `make test`
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
        assert isinstance(row["cache hit"], bool)
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


def test_speed_verdicts_judge_only_the_large_ensembles() -> None:
    def row(models: int, compiled: float) -> dict:
        return {
            "models": models,
            "compiled": Timing("c", compiled, 0.0, 7, "hw", 1),
            "module loop": Timing("l", 1.0, 0.0, 7, "hw", 1),
        }

    verdicts = speed_verdicts([row(8, 0.5), row(32, 0.1), row(64, 0.25)])
    assert [str(v) for v in verdicts] == [
        (
            "✓ 32 models: compiled vmap is faster than the module loop (at least 5x): "
            "yes  [measured 10.00×, noise ±5%]"
        ),
        (
            "✗ 64 models: compiled vmap is faster than the module loop (at least 5x): "
            "NO  [measured 4.00×, noise ±5%]"
        ),
    ]
    small = speed_verdicts([row(8, 0.5)], target=1.5, from_models=8)
    assert [v.holds for v in small] == [True]  # 2x, at least 1.5x after the noise
    assert speed_verdicts([row(31, 0.1)]) == []


def test_plot_probability_map_draws_values_and_labelled_points() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    values = torch.tensor([[0.25, 0.5], [0.5, 0.75]])  # rows are y
    points = torch.tensor([[0.0, 0.1], [1.0, -1.0], [0.5, 0.25]])
    labels = torch.tensor([0, 1, 1])
    image = plot_probability_map(
        ax, values, (-1.0, 1.0, -2.0, 2.0), points, labels, title="member 1"
    )
    assert image.get_array().tolist() == values.tolist()
    assert (image.origin, image.get_extent()) == ("lower", [-1.0, 1.0, -2.0, 2.0])
    assert (image.norm.vmin, image.norm.vmax, image.cmap.name) == (0.0, 1.0, "RdBu_r")
    assert ax.get_aspect() == 1.0
    class0, class1 = ax.collections
    assert class0.get_offsets().tolist()[0] == pytest.approx([0.0, 0.1])
    assert class1.get_offsets().tolist() == [[1.0, -1.0], [0.5, 0.25]]
    assert [
        matplotlib.colors.to_hex(c.get_facecolor()[0]) for c in (class0, class1)
    ] == [
        "#9ecae1",
        "#fc9272",
    ]
    assert class0.get_sizes().tolist() == [9.0]
    assert list(ax.get_xticks()) == list(ax.get_yticks()) == []
    assert (ax.get_title(), ax.title.get_fontsize()) == ("member 1", 9.0)
    _, bare = plt.subplots()
    plain = plot_probability_map(
        bare, values, (0, 1, 0, 1), points, vmax=0.5, cmap="viridis"
    )  # points without labels: no dots
    assert (plain.norm.vmax, plain.cmap.name, len(bare.collections)) == (
        0.5,
        "viridis",
        0,
    )
    assert bare.get_title() == ""
    plt.close("all")


def test_speed_table_of_known_timings() -> None:
    def t(seconds: float) -> Timing:
        return Timing("t", seconds, 0.0, 7, "hw", 1)

    row = {
        "models": 8,
        "module loop": t(0.012),
        "loop": t(0.006),
        "vmap": t(0.004),
        "compiled": t(0.0005),
        "compile": 2.5,
    }
    lines = format_speed_table([row]).splitlines()
    assert lines[0] == "Time per training step (median); speed-ups over the module loop"
    assert lines[1].split() == ["module", "functional", "eager", "compiled", "vmap"] + [
        "compiled",
        "compile",
    ]
    assert lines[2].split() == ["models", "loop", "loop", "vmap", "vmap"] + [
        "speed-up",
        "speed-up",
        "time",
    ]
    assert lines[4].split() == "8 12 ms 6 ms 4 ms 500 us 3.0× 24.0× 2.5 s".split()


def test_subset_sizes_from_one_to_all_points() -> None:
    assert sample_subsets(2, 5, 1).shape == (2, 1)
    assert sorted(sample_subsets(1, 5, 5)[0].tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="subset_size"):
        sample_subsets(2, 5, 0)
