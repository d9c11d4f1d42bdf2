"""Figures of model parallelism: the splits, pipeline timelines, the cost model.

- ``plot_tensor_parallel_mlp``: Megatron-LM's split of an MLP over two
  devices, the first weight by columns and the second by rows, with f and g;
- ``plot_sequence_parallel``: the layouts one block's half goes through with
  sequence parallelism, and the collectives between them;
- ``plot_pipeline_timeline``: the forward and backward passes each process
  ran in one pipeline step (as ``companion/checks/pipeline.py`` records them,
  or as ``companion.parallel_costs.replay_schedule`` re-times them);
- ``plot_step_costs``: the cost model's step time against the link's bandwidth;
- ``plot_predicted_layouts``: predicted against measured step times and
  memory, one point per layout (``companion/checks/layouts.py``'s runs).

Used in chapters 13 and 17.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from companion.harness.plotting import new_axes
from companion.parallel_costs import DeviceAndLink, GPTWorkload, Plan, step_costs

__all__ = [
    "pass_legend",
    "plot_pipeline_timeline",
    "plot_predicted_layouts",
    "plot_sequence_parallel",
    "plot_step_costs",
    "plot_tensor_parallel_mlp",
]

# I and W: a backward pass split into the input's gradient and the weights'
PASS_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}
LATER_STAGE_COLOURS = {  # a process's second stage
    "F": "#9ecae1",
    "B": "#fdc38d",
    "I": "#f4a3a3",
    "W": "#a1d99b",
}
HELD, NOT_HELD, PARTIAL = "#6baed6", "#f0f0f0", "#fdae6b"
DEVICE_ROWS = ("device 0", "device 1")


# ---- pipeline timelines


def plot_pipeline_timeline(
    timeline: Mapping,
    *,
    title: str = "",
    unit: str = "ms",
    ax: Axes | None = None,
) -> Axes:
    """Draw each process's forward (F) and backward (B, or I and W) passes over a step.

    ``timeline``: ``events``, one list per process of ``[kind, stage,
    micro-batch, start, end]``, and ``makespan``, the step's length. Each
    pass is a bar labelled with its micro-batch, lighter on a process's
    second stage (the interleaved schedule); the white gaps are the bubble.
    ``unit``: ``"ms"`` for seconds shown in milliseconds, ``"passes"`` for a
    replay timed in forward passes. The axis ends at the step's end.
    """
    events: Sequence[Sequence] = timeline["events"]
    processes = len(events)
    if ax is None:
        (ax,) = new_axes(width=7.0, height=0.5 + 0.45 * processes)
    scale = 1e3 if unit == "ms" else 1.0
    for rank, passes in enumerate(events):
        for kind, stage, micro, start, end in passes:
            later = stage >= processes
            ax.barh(
                rank,
                (end - start) * scale,
                left=start * scale,
                height=0.8,
                color=(LATER_STAGE_COLOURS if later else PASS_COLOURS)[kind],
                edgecolor="white",
                linewidth=0.5,
            )
            if (end - start) / timeline["makespan"] > 0.02:  # room for a label
                ax.text(
                    (start + end) / 2 * scale,
                    rank,
                    str(micro),
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="black" if later else "white",
                )
    ax.set_yticks(range(processes), [f"process {r}" for r in range(processes)])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline["makespan"] * scale)
    ax.set_xlabel(
        "time since the step began (ms)"
        if unit == "ms"
        else "time (a forward pass = 1; a backward pass = 2, or 1 + 1 when split)"
    )
    if title:
        ax.set_title(title, fontsize=9)
    return ax


PASS_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "input gradient",
    "W": "weight gradient",
}


def pass_legend(fig: Figure, *, interleaved: bool = False, kinds: str = "FB") -> None:
    """One legend for a figure of timelines, above the panels (it covers no bar):
    the passes of ``kinds``, and with ``interleaved`` their second-stage shades."""
    handles = [Patch(color=PASS_COLOURS[k], label=PASS_NAMES[k]) for k in kinds]
    if interleaved:
        handles += [
            Patch(color=LATER_STAGE_COLOURS[k], label=f"{PASS_NAMES[k]}, second stage")
            for k in kinds
        ]
    fig.legend(
        handles=handles,
        loc="outside upper center",
        ncols=min(4, len(handles)),
        fontsize=8,
        frameon=False,
    )


# ---- the cost model


def plot_step_costs(
    model: GPTWorkload,
    plans: Mapping[str, Plan],
    *,
    flops: float,
    latency: float,
    processes: int,
    bandwidths: Sequence[float],
    marks: Mapping[str, float] = {},
    ax: Axes | None = None,
) -> Axes:
    """The predicted step time of each plan against the link's bandwidth.

    ``plans`` maps a label to a ``Plan`` for ``step_costs`` (dashed where
    it overlaps its traffic); ``marks`` draws a vertical line at named
    bandwidths.
    """
    if ax is None:
        (ax,) = new_axes(width=7.5, height=3.6)
    x = [bw / 1e9 for bw in bandwidths]
    for i, (label, plan) in enumerate(plans.items()):
        seconds = [
            step_costs(
                model, DeviceAndLink("link", flops, bw, latency), plan, processes
            )["total"]
            for bw in bandwidths
        ]
        ax.plot(x, seconds, "--" if plan.overlap else "-", color=f"C{i}", label=label)
    for name, bw in marks.items():
        ax.axvline(bw / 1e9, color="grey", linewidth=0.8, linestyle=":")
        ax.annotate(
            name,
            (bw / 1e9, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color="grey",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="bandwidth per device on the link (GB/s)",
        ylabel="predicted seconds per step",
    )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return ax


# ---- diagrams of the splits


def _matrix(
    ax: Axes,
    x: float,
    y: float,
    width: float,
    height: float,
    *,
    part: tuple[str, int] | None = None,
    colour: str = HELD,
    hatch: str | None = None,
    label: str = "",
) -> None:
    """A matrix as a box with its lower-left corner at (x, y); ``part`` shades
    one half: ("columns", i) or ("rows", i), i = 0 the left or upper half."""
    ax.add_patch(Rectangle((x, y), width, height, facecolor=NOT_HELD, edgecolor="k"))
    if part is None:
        box = (x, y, width, height)
    elif part[0] == "columns":
        box = (x + part[1] * width / 2, y, width / 2, height)
    else:
        box = (x, y + (1 - part[1]) * height / 2, width, height / 2)
    ax.add_patch(
        Rectangle(
            box[:2], *box[2:], facecolor=colour, edgecolor="k", hatch=hatch, lw=0.8
        )
    )
    if label:
        ax.text(x + width / 2, y - 0.12, label, ha="center", va="top", fontsize=7)


def _arrow(ax: Axes, x0: float, x1: float, y: float, label: str = "") -> None:
    ax.add_patch(
        FancyArrowPatch((x0, y), (x1, y), arrowstyle="->", mutation_scale=9, lw=0.8)
    )
    if label:
        ax.text((x0 + x1) / 2, y + 0.08, label, ha="center", va="bottom", fontsize=7)


def _diagram_axes(width: float, height: float) -> tuple[Figure, Axes]:
    fig, ax = plt.subplots(figsize=(width, height))
    fig.set_layout_engine("constrained")
    ax.set_axis_off()
    ax.set_aspect("equal")
    return fig, ax


def plot_tensor_parallel_mlp() -> Figure:
    """Megatron-LM's MLP on two devices: g(GELU(f(X) A_i) B_i).

    Each row is a device: the whole input X; the columns i of A (held: blue);
    the device's slice of the hidden activations; the matching rows of B; a
    partial sum of the output (orange, hatched), which g all-reduces into
    the whole Y on both devices.
    """
    fig, ax = _diagram_axes(8.0, 3.4)
    for i, device in enumerate(DEVICE_ROWS):
        y = 1.9 * (1 - i)
        ax.text(-0.2, y + 0.5, device, ha="right", va="center", fontsize=8)
        _matrix(ax, 0.0, y, 0.5, 1.0, label="X")
        _arrow(ax, 0.6, 1.1, y + 0.5, "f")
        half = ("left", "right")[i]
        _matrix(
            ax,
            1.2,
            y + 0.25,
            2.0,
            0.5,
            part=("columns", i),
            label=f"$A_{i + 1}$: {half} columns of $A$",
        )
        _arrow(ax, 3.3, 3.8, y + 0.5, "GELU")
        _matrix(ax, 3.9, y, 2.0, 1.0, part=("columns", i), label=f"GELU$(X A_{i + 1})$")
        _arrow(ax, 6.0, 6.5, y + 0.5)
        _matrix(
            ax,
            6.6,
            y - 0.25,
            0.5,
            1.5,
            part=("rows", i),
            label=f"$B_{i + 1}$: {('upper', 'lower')[i]} rows",
        )
        _arrow(ax, 7.2, 7.7, y + 0.5)
        _matrix(
            ax,
            7.8,
            y,
            0.5,
            1.0,
            colour=PARTIAL,
            hatch="///",
            label=f"partial $Y_{i + 1}$",
        )
        _arrow(ax, 8.5, 9.3, y + 0.5, "g")
        _matrix(ax, 9.4, y, 0.5, 1.0, label="Y")
    ax.text(
        8.9,
        1.45,
        "all-reduce\n(sum)",
        ha="center",
        va="center",
        fontsize=7,
        color="tab:red",
    )
    ax.set_xlim(-1.2, 10.1)
    ax.set_ylim(-0.8, 3.2)
    return fig


def plot_sequence_parallel() -> Figure:
    """The layouts of the activations (positions down, features across) that
    half a block goes through with sequence parallelism on two devices, and
    the collectives between them (forward; backward swaps all-gather and
    reduce-scatter)."""
    fig, ax = _diagram_axes(8.0, 3.2)
    states = [
        ("Shard(1):\npositions split", "rows", HELD, None),
        ("Replicate", None, HELD, None),
        ("features split\n(by heads)", "columns", HELD, None),
        ("Partial:\nsums pending", None, PARTIAL, "///"),
        ("Shard(1)", "rows", HELD, None),
    ]
    steps = [
        "all-gather",
        "q, k, v or fc\n(by columns)",
        "proj\n(by rows)",
        "reduce-\nscatter",
    ]
    step_x = 1.55
    for i, device in enumerate(DEVICE_ROWS):
        y = 1.8 * (1 - i)
        ax.text(-0.2, y + 0.5, device, ha="right", va="center", fontsize=8)
        for k, (name, part, colour, hatch) in enumerate(states):
            x = k * step_x
            shaded = None if part is None else (part, i)
            _matrix(ax, x, y, 0.6, 1.0, part=shaded, colour=colour, hatch=hatch)
            if i == 1:
                ax.text(x + 0.3, y - 0.12, name, ha="center", va="top", fontsize=7)
            if k < len(steps):
                _arrow(ax, x + 0.7, x + step_x - 0.1, y + 0.5)
    for k, step in enumerate(steps):
        colour = "tab:red" if k in (0, 3) else "black"
        x = k * step_x + 0.3 + step_x / 2
        ax.text(x, 1.4, step, ha="center", va="center", fontsize=7, color=colour)
    ax.text(
        0.3, 3.0, "LayerNorm\n(on its positions)", ha="center", va="center", fontsize=7
    )
    ax.text(-0.2, -0.45, "positions ↓\nfeatures →", ha="right", va="center", fontsize=7)
    ax.text(4 * step_x + 0.3, 3.0, "+ residual", ha="center", va="center", fontsize=7)
    ax.set_xlim(-1.2, 4 * step_x + 0.9)
    ax.set_ylim(-0.7, 3.2)
    return fig


# ---- layouts, predicted and measured


def plot_predicted_layouts(runs: Mapping[str, Mapping]) -> Figure:
    """Two panels, one point per layout of ``checks/layouts.py``'s ``runs``:
    the step's predicted and measured milliseconds, and each process's
    predicted memory against the largest measured peak (MiB), with the line
    where they are equal. Points are numbered in the order of ``runs``."""
    step, memory = new_axes(2, width=4.6, height=4.0)
    pairs = {
        step: [
            (r["predicted"]["step"]["total"] * 1e3, r["seconds"] * 1e3)
            for r in runs.values()
        ],
        memory: [
            (r["predicted"]["memory"]["total"] / 2**20, max(r["peak_bytes"]) / 2**20)
            for r in runs.values()
        ],
    }
    for ax, points in pairs.items():
        xs, ys = zip(*points)
        low, high = 0.8 * min(xs + ys), 1.25 * max(xs + ys)
        ax.plot([low, high], [low, high], color="0.6", lw=1, label="equal")
        ax.scatter(xs, ys, s=18, zorder=3)
        for i, (x, y) in enumerate(points, start=1):
            # A point close to an earlier one (within 10% on both axes) gets its
            # label lower down, so that the two numbers stay apart.
            close = sum(
                abs(x / px - 1) < 0.1 and abs(y / py - 1) < 0.1
                for px, py in points[: i - 1]
            )
            offset = (3, 3 - 9 * close)
            ax.annotate(
                str(i), (x, y), textcoords="offset points", xytext=offset, fontsize=7
            )
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high))
        for axis in (ax.xaxis, ax.yaxis):  # ticks at 1, 2, 3 and 5 of each decade
            axis.set_major_locator(LogLocator(subs=(1, 2, 3, 5)))
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
    step.set(xlabel="predicted step (ms)", ylabel="measured step (ms)")
    memory.set(xlabel="predicted memory (MiB)", ylabel="measured peak (MiB)")
    step.legend(loc="upper left", fontsize=8)
    return step.figure
