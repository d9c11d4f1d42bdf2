"""Train an ensemble of small models at once with ``torch.func`` and ``vmap``.

The pieces, in the order chapter 10 builds them:

- ``MLP``: a two-layer classifier for 2-D points;
- ``SGD`` and ``Adam``: functional optimisers, pure functions of
  ``(params, grads, state)`` that return new parameters and a new state;
- ``make_train_step``: one training step as a pure function of
  ``(params, opt_state, inputs, targets)``, built on ``functional_call`` and
  ``grad_and_value``, ready for ``vmap`` and ``torch.compile``;
- ``init_ensemble``, ``unstack``, ``sample_subsets``: stacked parameters and
  per-model random subsets of the data;
- ``train_loop`` and ``train_vmap``: the same training, one model at a time
  in a Python loop (the reference) or all models in one vectorised call;
- ``predict_grid`` and ``plot_probability_map``: every member's class
  probabilities on a grid of points, and a map of them;
- ``benchmark_ensemble``, ``format_speed_table``, ``speed_verdicts``: time per
  training step for the loop, eager ``vmap`` and compiled ``vmap`` (compile
  time reported apart), as a table and against a target speed-up.

Used in chapter 10.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.nn.functional as F
from matplotlib.axes import Axes
from matplotlib.image import AxesImage
from torch import nn
from torch.func import functional_call, grad_and_value, stack_module_state, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from companion.harness.timing import (
    Benchmark,
    benchmark_interleaved,
    format_ratio,
    format_table,
    format_time,
)
from companion.harness.verdicts import Verdict, check_faster

__all__ = [
    "MLP",
    "SGD",
    "Adam",
    "Optimizer",
    "Params",
    "OptState",
    "TrainStep",
    "make_train_step",
    "init_ensemble",
    "unstack",
    "stack",
    "sample_subsets",
    "train_loop",
    "train_vmap",
    "predict_grid",
    "benchmark_ensemble",
    "format_speed_table",
    "speed_verdicts",
    "plot_probability_map",
]

Params = dict[str, torch.Tensor]
OptState = dict[str, Any]  # a pytree (nested dicts) of tensors
TrainStep = Callable[
    [Params, OptState, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, Params, OptState],
]


class MLP(nn.Module):
    """Two fully connected layers with a ReLU between: 2-D points to class logits."""

    def __init__(
        self, hidden_dim: int = 32, n_classes: int = 2, in_features: int = 2
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


@dataclass(frozen=True)
class SGD:
    """Plain stochastic gradient descent, as a pure function: ``p - lr * g``."""

    lr: float = 0.2

    def init(self, params: Params) -> OptState:
        """Return the (empty) optimiser state: SGD remembers nothing."""
        return {}

    def update(
        self, params: Params, grads: Params, state: OptState
    ) -> tuple[Params, OptState]:
        """Return new parameters and the new state; the inputs are not modified."""
        return {k: p - self.lr * grads[k] for k, p in params.items()}, state


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma and Ba, 2015) as a pure function: ``torch.optim.Adam``'s update."""

    lr: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def init(self, params: Params) -> OptState:
        """Return the step count and the zeroed first and second moments."""
        # The step is a tensor, not a Python int: a compiled step would
        # otherwise specialise on (and recompile for) every new value.
        return {
            "step": torch.zeros((), device=next(iter(params.values())).device),
            "exp_avg": {k: torch.zeros_like(p) for k, p in params.items()},
            "exp_avg_sq": {k: torch.zeros_like(p) for k, p in params.items()},
        }

    def update(
        self, params: Params, grads: Params, state: OptState
    ) -> tuple[Params, OptState]:
        """Return new parameters and the new state; the inputs are not modified."""
        beta1, beta2 = self.betas
        step = state["step"] + 1
        # In float32, 1 - 0.999**1 keeps only ~4 digits: correct in float64
        # as torch.optim.Adam does (it uses Python floats).
        t = step.to(torch.float64)
        bias_correction1 = (1 - beta1**t).to(step.dtype)
        bias_correction2_sqrt = (1 - beta2**t).sqrt().to(step.dtype)
        new_params, exp_avg, exp_avg_sq = {}, {}, {}
        for k, p in params.items():
            g = grads[k]
            exp_avg[k] = torch.lerp(state["exp_avg"][k], g, 1 - beta1)
            exp_avg_sq[k] = beta2 * state["exp_avg_sq"][k] + (1 - beta2) * g * g
            denom = exp_avg_sq[k].sqrt() / bias_correction2_sqrt + self.eps
            new_params[k] = p - (self.lr / bias_correction1) * exp_avg[k] / denom
        return new_params, {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


Optimizer = Union[SGD, Adam]


def make_train_step(model: nn.Module, optimizer: Optimizer) -> TrainStep:
    """Return ``train_step(params, opt_state, inputs, targets)``.

    It returns ``(loss, params, opt_state)``.

    ``model`` only provides the architecture: its own parameters are never
    used or changed. The step is a pure function, so ``vmap`` can map it over
    a leading "model" dim of ``params`` and ``opt_state`` (and, for per-model
    data, of ``inputs`` and ``targets``), and ``torch.compile`` can fuse it.
    """

    def compute_loss(
        params: Params, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        logits = functional_call(model, params, (inputs,))
        return F.cross_entropy(logits, targets)

    def train_step(
        params: Params, opt_state: OptState, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, Params, OptState]:
        grads, loss = grad_and_value(compute_loss)(params, inputs, targets)
        new_params, new_state = optimizer.update(params, grads, opt_state)
        return loss, new_params, new_state

    return train_step


def init_ensemble(
    num_models: int,
    optimizer: Optimizer,
    *,
    hidden_dim: int = 32,
    device: torch.device | str = "cpu",
) -> tuple[nn.Module, Params, OptState]:
    """Return a template model, stacked parameters and stacked optimiser state.

    Each of the ``num_models`` models gets its own random initialisation (from
    the global generator). Every tensor has a leading dim of size
    ``num_models``. The stacked parameters are detached: ``stack_module_state``
    returns leaves that require grad, and the functional step needs no autograd
    history on them. Without detaching, every step would record the new
    parameters' dependence on the old ones, a graph that grows all training
    long (and a compiled step would carry a backward graph it never uses).
    """
    if num_models < 1:
        raise ValueError(f"An ensemble needs at least one model, not {num_models}.")
    models = [MLP(hidden_dim).to(device) for _ in range(num_models)]
    params, _buffers = stack_module_state(models)
    params = {k: v.detach() for k, v in params.items()}
    # A "meta" copy holds the architecture without storage, for functional_call.
    template = copy.deepcopy(models[0]).to("meta")
    return template, params, vmap(optimizer.init)(params)


def unstack(tree: Any, num_models: int) -> list[Any]:
    """Split a pytree whose tensors have a leading model dim into ``num_models`` pytrees."""
    leaves, spec = tree_flatten(tree)
    return [
        tree_unflatten([leaf[i] for leaf in leaves], spec) for i in range(num_models)
    ]


def stack(trees: Sequence[Any]) -> Any:
    """Stack pytrees of the same structure along a new leading model dim (undoes ``unstack``)."""
    return tree_map(lambda *leaves: torch.stack(leaves), *trees)


def sample_subsets(
    num_models: int,
    num_points: int,
    subset_size: int,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Return indices of shape ``(num_models, subset_size)``: a random subset per model.

    Each row holds ``subset_size`` distinct indices into ``range(num_points)``,
    drawn independently for each model.
    """
    if not 0 < subset_size <= num_points:
        raise ValueError(
            f"subset_size must be between 1 and {num_points}, not {subset_size}."
        )
    scores = torch.rand(num_models, num_points, generator=generator)
    return scores.argsort(dim=1)[:, :subset_size]


def _draw_batch(
    points: torch.Tensor,
    labels: torch.Tensor,
    num_models: int,
    subset_size: int | None,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one step's data: all of it (shared), or a stacked random subset per model."""
    if subset_size is None:
        return points, labels
    idx = sample_subsets(num_models, len(points), subset_size, generator=generator)
    idx = idx.to(points.device)
    return points[idx], labels[idx]


def train_vmap(
    step: TrainStep,
    params: Params,
    opt_state: OptState,
    points: torch.Tensor,
    labels: torch.Tensor,
    num_steps: int,
    *,
    subset_size: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, Params, OptState]:
    """Train all models at once with ``vmap(step)``; return the loss history and the state.

    With ``subset_size=None`` every model sees all ``points`` at every step
    (``in_dims=(0, 0, None, None)``). Otherwise each model draws its own random
    subset of that size at each step (``in_dims=(0, 0, 0, 0)``), from a
    generator seeded with ``seed``. The losses have shape ``(num_steps, num_models)``.
    """
    num_models = next(iter(params.values())).shape[0]
    batched_step = vmap(step, in_dims=(0, 0, None, None) if subset_size is None else 0)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(num_steps):
        inputs, targets = _draw_batch(
            points, labels, num_models, subset_size, generator
        )
        loss, params, opt_state = batched_step(params, opt_state, inputs, targets)
        losses.append(loss)
    return torch.stack(losses), params, opt_state


def train_loop(
    step: TrainStep,
    params: Params,
    opt_state: OptState,
    points: torch.Tensor,
    labels: torch.Tensor,
    num_steps: int,
    *,
    subset_size: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, Params, OptState]:
    """The reference for ``train_vmap``: the same training, one model after another.

    Takes and returns the same stacked tensors as ``train_vmap`` and draws the
    same subsets (same ``seed``), but runs ``step`` on each model separately in
    a Python loop.
    """
    num_models = next(iter(params.values())).shape[0]
    models = list(zip(unstack(params, num_models), unstack(opt_state, num_models)))
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(num_steps):
        inputs, targets = _draw_batch(
            points, labels, num_models, subset_size, generator
        )
        step_losses = []
        for i, (p, s) in enumerate(models):
            if subset_size is None:
                loss, p, s = step(p, s, inputs, targets)
            else:
                loss, p, s = step(p, s, inputs[i], targets[i])
            models[i] = (p, s)
            step_losses.append(loss)
        losses.append(torch.stack(step_losses))
    new_params, new_state = zip(*models)
    return torch.stack(losses), stack(new_params), stack(new_state)


@torch.no_grad()
def predict_grid(
    model: nn.Module, params: Params, xs: torch.Tensor, ys: torch.Tensor
) -> torch.Tensor:
    """Return each member's probability of class 1 on the grid ``xs`` x ``ys``.

    The result has shape ``(num_models, len(ys), len(xs))``, ready for
    ``imshow``/``contourf``.
    """
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    grid = torch.stack([grid_x.flatten(), grid_y.flatten()], dim=1)
    logits = vmap(functional_call, in_dims=(None, 0, None))(model, params, (grid,))
    return logits.softmax(dim=-1)[..., 1].reshape(-1, len(ys), len(xs))


def _module_loop(
    num_models: int, optimizer: Optimizer, inputs: torch.Tensor, targets: torch.Tensor
) -> Callable[[], None]:
    """The loop a reader would write first: ``nn.Module``s, each with its ``torch.optim`` optimizer."""
    models = [MLP().to(inputs.device) for _ in range(num_models)]
    if isinstance(optimizer, Adam):
        optimizers = [
            torch.optim.Adam(
                m.parameters(),
                lr=optimizer.lr,
                betas=optimizer.betas,
                eps=optimizer.eps,
            )
            for m in models
        ]
    else:
        optimizers = [torch.optim.SGD(m.parameters(), lr=optimizer.lr) for m in models]
    work = list(zip(models, optimizers, inputs.unbind(), targets.unbind()))

    def loop() -> None:
        for model, opt, x, y in work:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    return loop


def _four_ways(
    step: TrainStep,
    compiled_vmap: Callable[..., Any],
    optimizer: Optimizer,
    params: Params,
    opt_state: OptState,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[dict[str, Callable[[], Any]], float, bool]:
    """Compile the step for n models and return the four ways to time, compile seconds, cache hit.

    The four ways take one step of the n models: module loop, functional
    loop, eager vmap, compiled vmap. The first call of the compiled step
    compiles (and runs once); ``cache hit`` says whether Inductor's on-disk
    cache served that compilation (a first run on a machine compiles slower).
    """
    n = inputs.shape[0]
    per_model = list(
        zip(
            unstack(params, n), unstack(opt_state, n), inputs.unbind(), targets.unbind()
        )
    )

    def loop() -> None:
        for p, s, x, y in per_model:
            step(p, s, x, y)

    args = (params, opt_state, inputs, targets)
    eager_vmap = vmap(step)
    hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
    with Benchmark(quiet=True) as compiling:
        compiled_vmap(*args)
    cache_hit = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] > hits
    ways = {
        f"module loop, {n} models": _module_loop(n, optimizer, inputs, targets),
        f"loop, {n} models": loop,
        f"vmap, {n} models": lambda: eager_vmap(*args),
        f"compiled vmap, {n} models": lambda: compiled_vmap(*args),
    }
    return ways, compiling.elapsed, cache_hit


def benchmark_ensemble(
    model_counts: Sequence[int] = (8, 32, 128),
    *,
    optimizer: Optimizer | None = None,
    num_points: int = 100,
    subset_size: int = 64,
    min_run_time: float = 0.5,
    compile_mode: str | None = None,
    device: torch.device | str = "cpu",
) -> list[dict[str, Any]]:
    """Time one training step of ``n`` models, for each ``n`` in ``model_counts``.

    Four ways to take the same kind of step (per-model random subsets of a
    spiral data set, ``optimizer`` default ``SGD()``): a Python loop over
    ``nn.Module``s with their ``torch.optim`` optimizers (the loop a reader
    writes first), a Python loop over the functional step, eager ``vmap``, and
    ``vmap`` under ``torch.compile(fullgraph=True, dynamic=False)``. The
    compiled step is built once and compiled once per model count (shapes
    are static); the first call, which compiles (and runs once), is timed
    apart as ``compile`` (seconds), and ``cache hit`` says whether
    Inductor's on-disk cache served it. Every count is compiled first; then
    all the entries are timed with ``benchmark_interleaved``, taking turns
    block by block, so a busy spell on a shared machine slows them alike.
    Each row holds ``Timing`` medians (``module loop``, ``loop``, ``vmap``,
    ``compiled``);
    ``format_speed_table`` lays them out and ``speed_verdicts`` checks them.
    Everything runs with the current ``torch.get_num_threads()``.
    """
    if not model_counts or min(model_counts) < 1:
        raise ValueError(
            f"model_counts must be positive numbers of models, not {model_counts}."
        )
    from companion.data import make_spirals

    optimizer = optimizer or SGD()
    generator = torch.Generator().manual_seed(0)
    points, labels = make_spirals(
        num_points, noise_std=0.05, generator=generator, device=device
    )
    step = make_train_step(MLP().to("meta"), optimizer)
    compiled_vmap = torch.compile(
        vmap(step), fullgraph=True, dynamic=False, mode=compile_mode
    )
    ways: dict[str, Callable[[], Any]] = {}
    compiles: dict[int, tuple[float, bool]] = {}
    # One compiled entry per model count: lift Dynamo's limit (8) if needed,
    # or the extra counts would silently fall back to eager code.
    limit = max(torch._dynamo.config.recompile_limit, len(model_counts) + 1)
    with torch._dynamo.config.patch(recompile_limit=limit):
        for n in model_counts:  # compile every count before timing any
            _, params, opt_state = init_ensemble(n, optimizer, device=device)
            idx = sample_subsets(n, num_points, subset_size, generator=generator).to(
                device
            )
            fns, seconds, cache_hit = _four_ways(
                step,
                compiled_vmap,
                optimizer,
                params,
                opt_state,
                points[idx],
                labels[idx],
            )
            ways |= fns
            compiles[n] = (seconds, cache_hit)
        # All 4 x len(model_counts) entries take turns, block by block.
        times = benchmark_interleaved(ways, min_run_time=min_run_time)
    rows = []
    for n in model_counts:
        rows.append(
            {
                "models": n,
                "module loop": times[f"module loop, {n} models"],
                "loop": times[f"loop, {n} models"],
                "vmap": times[f"vmap, {n} models"],
                "compiled": times[f"compiled vmap, {n} models"],
                "compile": compiles[n][0],
                "cache hit": compiles[n][1],
            }
        )
    return rows


def format_speed_table(rows: Sequence[dict[str, Any]]) -> str:
    """Lay out ``benchmark_ensemble``'s rows: step times, speed-ups over the module
    loop, compile time."""
    table = [
        {
            "models": row["models"],
            "module\nloop": row["module loop"],
            "functional\nloop": row["loop"],
            "eager\nvmap": row["vmap"],
            "compiled\nvmap": row["compiled"],
            "vmap\nspeed-up": format_ratio(
                row["module loop"].median / row["vmap"].median, 1
            ),
            "compiled\nspeed-up": format_ratio(
                row["module loop"].median / row["compiled"].median, 1
            ),
            "compile\ntime": format_time(row["compile"]),
        }
        for row in rows
    ]
    return format_table(
        table, title="Time per training step (median); speed-ups over the module loop"
    )


def speed_verdicts(
    rows: Sequence[dict[str, Any]], *, target: float = 5.0, from_models: int = 32
) -> list[Verdict]:
    """For each row of ``from_models`` models or more: did compiled vmap beat the module loop by ``target``?"""
    return [
        check_faster(
            f"{row['models']} models: compiled vmap is faster than the module loop",
            row["compiled"],
            row["module loop"],
            at_least=target,
        )
        for row in rows
        if row["models"] >= from_models
    ]


def plot_probability_map(
    ax: Axes,
    values: torch.Tensor,
    extent: tuple[float, float, float, float],
    points: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    *,
    title: str = "",
    cmap: str = "RdBu_r",
    vmax: float = 1.0,
) -> AxesImage:
    """Draw a map of ``values`` (rows = y) over ``extent`` and, if given, the labelled points."""
    image = ax.imshow(
        values.cpu(),
        origin="lower",
        extent=extent,
        cmap=cmap,
        vmin=0.0,
        vmax=vmax,
        aspect="equal",
    )
    if points is not None and labels is not None:
        points, labels = points.cpu(), labels.cpu()
        for label, color in ((0, "#9ecae1"), (1, "#fc9272")):  # light blue, light red
            mine = points[labels == label]
            ax.scatter(
                mine[:, 0], mine[:, 1], s=9, c=color, edgecolors="black", linewidths=0.5
            )
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=9)
    return image
