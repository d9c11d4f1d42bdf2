"""What parallel layouts cost: pipeline bubbles, replayed schedules and a step-time model.

Chapter 13 measures tensor, sequence and pipeline parallelism with its
standalone scripts and their checks; this module holds the formulas it sets
beside the measurements (no matplotlib: the checks import it; the figures
are in ``companion.parallel_plots``):

- ``bubble_fraction``, the idle share of a pipeline step with equal stages;
- ``replay_schedule``, which re-times the passes a pipeline ran, in the
  order each process ran them, with chosen durations and free messages, and
  ``timeline_bubble``, the idle share of such a timeline;
- a cost model (``DeviceAndLink``, ``GPTWorkload``, ``step_costs``,
  ``model_state_bytes``) that predicts the seconds of one training step for
  data, fully sharded data, tensor and pipeline parallelism from FLOPs,
  bytes and a link's bandwidth and latency. It ignores kernels' efficiency
  at small sizes and the framework's own overheads, which is where its
  predictions and a measurement part.

Used in chapter 13.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from companion.notebook import CourseError

__all__ = [
    "DeviceAndLink",
    "GPTWorkload",
    "bubble_fraction",
    "model_state_bytes",
    "replay_schedule",
    "ring_all_reduce_seconds",
    "step_costs",
    "timeline_bubble",
]

LAYOUTS = ("data", "fsdp", "tensor", "pipeline")


def bubble_fraction(stages: int, microbatches: int, per_process: int = 1) -> float:
    """Idle share of a pipeline step: (p - 1) / (v m + p - 1).

    ``stages`` is the number of processes p, each running ``per_process``
    stages v (2 for the interleaved schedule), with equal stages and instant
    communication. This is idle time over the step's whole time; Megatron-LM
    quotes idle time over busy time, (p - 1) / (v m).
    """
    if min(stages, microbatches, per_process) < 1:
        raise CourseError(
            "stages, micro-batches and stages per process must be at least 1, not "
            f"{stages}, {microbatches} and {per_process}."
        )
    return (stages - 1) / (per_process * microbatches + stages - 1)


def replay_schedule(
    events: Sequence[Sequence[Sequence]],
    *,
    forward: float = 1.0,
    backward: float = 2.0,
    as_measured: bool = False,
) -> dict:
    """Re-time a pipeline step: the same passes in the same order, free messages.

    ``events`` holds one list per process of ``[kind, stage, micro-batch,
    start, end]`` (kind ``"F"`` or ``"B"``), as ``companion/checks/pipeline.py``
    records them. Each process runs its passes in the order it ran them, each
    as soon as the process is free and its input is ready: the forward pass
    of stage s after stage s - 1's, the backward pass after stage s + 1's.
    A pass takes ``forward`` or ``backward`` (equal stages), or with
    ``as_measured`` its own measured duration. Returns a timeline of the same
    form, ``{"events": ..., "makespan": ...}``.
    """
    orders = [sorted(passes, key=lambda e: e[3]) for passes in events]
    last_stage = max(int(e[1]) for passes in orders for e in passes)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(orders)
    position = [0] * len(orders)
    replayed: list[list[list]] = [[] for _ in orders]
    remaining = sum(len(passes) for passes in orders)
    while remaining:
        progressed = False
        for rank, passes in enumerate(orders):
            while position[rank] < len(passes):
                kind, stage, micro, start, end = passes[position[rank]]
                needs = [("F", stage - 1, micro)] if kind == "F" and stage else []
                if kind == "B":
                    needs.append(("F", stage, micro))
                    if stage < last_stage:
                        needs.append(("B", stage + 1, micro))
                if any(need not in done for need in needs):
                    break
                begin = max([free[rank], *(done[need] for need in needs)])
                length = (
                    (end - start)
                    if as_measured
                    else (forward if kind == "F" else backward)
                )
                done[kind, stage, micro] = free[rank] = begin + length
                replayed[rank].append([kind, stage, micro, begin, begin + length])
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise CourseError(
                "the passes cannot run in the order given: a process waits for a "
                "pass that comes later on another process."
            )
    return {"events": replayed, "makespan": max(free)}


def timeline_bubble(timeline: Mapping) -> float:
    """Idle share of a timeline: 1 - (mean busy seconds per process) / makespan."""
    events = timeline["events"]
    busy = sum(e[4] - e[3] for passes in events for e in passes) / len(events)
    return 1 - busy / timeline["makespan"]


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
    *,
    overlap: bool = False,
) -> dict[str, float]:
    """Predicted seconds of one training step: compute, communication, bubble and total.

    ``layout`` is one of

    - ``"data"``: every device a whole model and 1/N of the batch; one
      all-reduce of the gradients per step;
    - ``"fsdp"``: the same, with parameters, gradients and optimizer state
      sharded (ZeRO-3): an all-gather of the parameters forward, another
      backward, and a reduce-scatter of the gradients, 1.5 all-reduces' worth;
    - ``"tensor"``: every block split across the N devices (Megatron-LM):
      1/N of the FLOPs, and four all-reduces of the B T d activations per
      block and step (two forward, two backward);
    - ``"pipeline"``: N stages of L/N blocks and ``microbatches`` micro-batches
      (at most the batch's sequences): the compute of one stage, stretched by
      the bubble, and one micro-batch's activations and gradients sent across
      every boundary.

    ``overlap``: the data-parallel layouts hide their communication behind
    the compute (the total is the larger of the two), as DDP and FSDP do at
    best. Tensor parallelism's all-reduces sit between the products that
    need them, and the pipeline's messages are counted only where a stage
    waits for them, so ``overlap`` leaves those two unchanged.
    """
    n = processes
    compute = model.step_flops / hw.flops / n
    bubble = communication = 0.0
    gradients = model.parameters * model.dtype_bytes
    if layout == "data":
        communication = ring_all_reduce_seconds(gradients, n, hw)
    elif layout == "fsdp":
        communication = 1.5 * ring_all_reduce_seconds(gradients, n, hw)
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
            f"the cost model knows the layouts {', '.join(LAYOUTS)}, not {layout!r}."
        )
    hidden = overlap and layout in ("data", "fsdp")
    total = max(compute, communication) if hidden else compute + communication
    return {
        "compute": compute,
        "communication": communication,
        "bubble": bubble,
        "total": total + bubble,
    }


def model_state_bytes(
    model: GPTWorkload, layout: str, processes: int, bytes_per_parameter: int = 16
) -> float:
    """Bytes of parameters, gradients and Adam's state per device (activations
    left out): the whole model's for ``"data"``, 1/N of it for the others.

    16 bytes per parameter: bfloat16 weights and gradients (2 + 2), and
    float32 master weights and Adam's two moments (4 + 8).
    """
    if layout not in LAYOUTS:
        raise CourseError(
            f"the cost model knows the layouts {', '.join(LAYOUTS)}, not {layout!r}."
        )
    whole = model.parameters * bytes_per_parameter
    return whole if layout == "data" else whole / processes
