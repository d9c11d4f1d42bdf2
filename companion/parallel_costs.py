"""What parallel layouts cost: pipeline bubbles and timelines, and a step-time model.

Chapter 13 measures tensor, sequence and pipeline parallelism with its
standalone scripts and their checks; this module holds the formulas and the
figure the chapter sets beside the measurements:

- ``bubble_fraction``, the idle share of a pipeline step with equal stages,
  and ``plot_pipeline_timeline``, which draws the forward and backward
  passes each process ran, as ``companion/checks/pipeline.py`` recorded them;
- a cost model (``DeviceAndLink``, ``GPTWorkload``, ``step_costs``) that
  predicts the seconds of one training step for data, tensor and pipeline
  parallelism from FLOPs, bytes and a link's bandwidth and latency. It
  ignores overlap, kernels' efficiency at small sizes and the framework's own
  overheads, which is where its predictions and a measurement part.

Used in chapter 13.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.patches import Patch

from companion.notebook import CourseError
from companion.plotting import new_axes

__all__ = [
    "DeviceAndLink",
    "GPTWorkload",
    "bubble_fraction",
    "plot_pipeline_timeline",
    "ring_all_reduce_seconds",
    "step_costs",
]

PASS_COLOURS = {"F": "tab:blue", "B": "tab:orange"}


def bubble_fraction(stages: int, microbatches: int, per_process: int = 1) -> float:
    """Idle share of a pipeline step: (p - 1) / (v m + p - 1).

    ``stages`` is the number of processes p, each running ``per_process``
    stages v (2 for the interleaved schedule), with equal stages and instant
    communication.
    """
    if min(stages, microbatches, per_process) < 1:
        raise CourseError(
            "stages, micro-batches and stages per process must be at least 1, not "
            f"{stages}, {microbatches} and {per_process}."
        )
    return (stages - 1) / (per_process * microbatches + stages - 1)


def plot_pipeline_timeline(
    timeline: Mapping, *, title: str = "", ax: Axes | None = None
) -> Axes:
    """Draw each process's forward (F) and backward (B) passes over one step.

    ``timeline`` is a step as ``companion/checks/pipeline.py`` records it:
    ``events``, one list per process of ``[kind, stage, micro-batch, start,
    end]`` in seconds, and ``makespan``, the step's length. Each pass is a
    bar labelled with its micro-batch; the white gaps are the bubble.
    """
    events: Sequence[Sequence] = timeline["events"]
    if ax is None:
        (ax,) = new_axes(width=7.0, height=0.5 + 0.45 * len(events))
    scale = 1e3  # milliseconds
    for rank, passes in enumerate(events):
        for kind, _stage, micro, start, end in passes:
            ax.barh(
                rank,
                (end - start) * scale,
                left=start * scale,
                height=0.8,
                color=PASS_COLOURS[kind],
                edgecolor="white",
                linewidth=0.5,
            )
            if (end - start) / timeline["makespan"] > 0.025:  # room for a label
                ax.text(
                    (start + end) / 2 * scale,
                    rank,
                    str(micro),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    ax.set_yticks(range(len(events)), [f"process {r}" for r in range(len(events))])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline["makespan"] * scale)
    ax.set_xlabel("time since the step began (ms)")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(
        handles=[
            Patch(color=PASS_COLOURS["F"], label="forward"),
            Patch(color=PASS_COLOURS["B"], label="backward"),
        ],
        loc="lower right",
        fontsize=7,
    )
    return ax


@dataclass(frozen=True)
class DeviceAndLink:
    """A device and the link between devices, as the cost model sees them."""

    name: str
    flops: float  # sustained FLOP/s of one device on this model's products
    bandwidth: float  # bytes/s one device sends on its link
    latency: float  # seconds per message


@dataclass(frozen=True)
class GPTWorkload:
    """A GPT-style model and the batch it trains on."""

    n_layer: int
    n_embd: int
    seq_len: int
    batch_size: int
    dtype_bytes: int = 4

    @property
    def parameters(self) -> int:
        """The blocks' parameters, 12 d^2 per block (embeddings left out)."""
        return 12 * self.n_layer * self.n_embd**2

    @property
    def step_flops(self) -> float:
        """Forward and backward: 3 x (2 FLOPs per parameter and token, plus attention's
        2 T d products per token and layer, 2 FLOPs each)."""
        tokens = self.batch_size * self.seq_len
        forward = 2 * self.parameters * tokens
        forward += 4 * self.n_layer * self.seq_len * self.n_embd * tokens
        return 3 * forward

    @property
    def activation_bytes(self) -> int:
        """One layer's output for the whole batch: B T d values."""
        return self.batch_size * self.seq_len * self.n_embd * self.dtype_bytes


def ring_all_reduce_seconds(nbytes: float, processes: int, hw: DeviceAndLink) -> float:
    """A ring all-reduce: each device sends 2 (N - 1) / N of the bytes in 2 (N - 1) messages."""
    if processes == 1:
        return 0.0
    steps = 2 * (processes - 1)
    return steps / processes * nbytes / hw.bandwidth + steps * hw.latency


def step_costs(
    model: GPTWorkload,
    hw: DeviceAndLink,
    layout: str,
    processes: int,
    microbatches: int = 1,
) -> dict[str, float]:
    """Predicted seconds of one training step: compute, communication, bubble and total.

    ``layout`` is one of

    - ``"data"``: every device a whole model and 1/N of the batch; one
      all-reduce of the gradients per step;
    - ``"tensor"``: every block split across the N devices (Megatron-LM):
      1/N of the FLOPs, and four all-reduces of the B T d activations per
      block and step (two forward, two backward);
    - ``"pipeline"``: N stages of L/N blocks and ``microbatches`` micro-batches
      (at most the batch's sequences):
      the compute of one stage, stretched by the bubble, and one
      micro-batch's activations and gradients sent across every boundary.
    """
    n = processes
    compute = model.step_flops / hw.flops / n
    bubble = communication = 0.0
    if layout == "data":
        communication = ring_all_reduce_seconds(
            model.parameters * model.dtype_bytes, n, hw
        )
    elif layout == "tensor":
        communication = (
            4 * model.n_layer * ring_all_reduce_seconds(model.activation_bytes, n, hw)
        )
    elif layout == "pipeline":
        if microbatches > model.batch_size:
            raise CourseError(
                f"{microbatches} micro-batches cannot split a batch of "
                f"{model.batch_size} sequences; use at most {model.batch_size}."
            )
        fraction = bubble_fraction(n, microbatches)
        bubble = compute * fraction / (1 - fraction)
        # On the critical path: one micro-batch's activations cross the p - 1
        # boundaries forward, and their gradients backward; the other
        # transfers overlap with other stages' computation.
        message = model.activation_bytes / microbatches / hw.bandwidth + hw.latency
        communication = 2 * (n - 1) * message
    else:
        raise CourseError(
            f"the cost model knows the layouts data, tensor and pipeline, not {layout!r}."
        )
    return {
        "compute": compute,
        "communication": communication,
        "bubble": bubble,
        "total": compute + communication + bubble,
    }
