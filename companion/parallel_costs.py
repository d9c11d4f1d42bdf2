"""What parallel layouts cost: pipeline bubbles, replayed schedules and a step-time model.

Chapter 13 measures tensor, sequence and pipeline parallelism with its
standalone scripts and their checks; this module holds the formulas it sets
beside the measurements (no matplotlib: the checks import it; the figures
are in ``companion.parallel_plots``):

- ``bubble_fraction``, the idle share of a pipeline step with equal stages;
- ``replay_schedule``, which re-times the passes a pipeline ran, in the
  order each process ran them, with chosen durations and free messages, and
  ``timeline_bubble``, the idle share of such a timeline;
- a cost model (``DeviceAndLink``, ``GPTWorkload``, ``Plan``,
  ``step_costs``, ``memory_bytes``) that predicts, for data, fully sharded
  data, tensor and pipeline parallelism, the seconds of one training step
  from FLOPs, bytes and a link's bandwidth and latency, and the bytes each
  device holds: the model state and the activations saved for backward
  (chapter 12's formula), with gradient accumulation, recomputation and
  sequence parallelism as a plan chooses them. ``Layout``,
  ``layout_costs`` and ``layout_memory`` are the same model for layouts
  that combine them (data x shard x tensor x pipeline degrees, HSDP
  among them, each on its own link), which ``layouts`` lists; a ``Plan``
  is the layout of one kind over all devices. It ignores kernels'
  efficiency at small sizes, the framework's own overheads and the memory
  its formulas leave out (temporaries, gathered parameters, the logits),
  which is where its predictions and a measurement part.

Used in chapters 13 and 17.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from companion.harness.notebook import CourseError

__all__ = [
    "DeviceAndLink",
    "GPTWorkload",
    "Layout",
    "Plan",
    "bubble_fraction",
    "compare_layouts",
    "layout_costs",
    "layout_memory",
    "layouts",
    "memory_bytes",
    "node_links",
    "model_state_bytes",
    "replay_schedule",
    "ring_all_reduce_seconds",
    "ring_half_seconds",
    "saved_activation_bytes",
    "step_costs",
    "timeline_bubble",
]

LAYOUTS = ("data", "fsdp", "tensor", "pipeline")
DEGREES = ("data", "shard", "tensor", "pipeline")  # a Layout's


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
    input_grad: float = 1.0,
    weight_grad: float = 1.0,
    as_measured: bool = False,
    lengths: Mapping[tuple[str, int], float] | None = None,
) -> dict:
    """Re-time a pipeline step: the same passes in the same order, free messages.

    ``events`` holds one list per process of ``[kind, stage, micro-batch,
    start, end]``, as ``companion/checks/pipeline.py`` records them: kind
    ``"F"`` (forward), ``"B"`` (a whole backward pass), or, where the
    schedule splits it, ``"I"`` (the input's gradient) and ``"W"`` (the
    weights'). Each process runs its passes in the order it ran them, each as
    soon as the process is free and its input is ready: the forward pass of
    stage s after stage s - 1's, a backward or input pass after stage s + 1's
    and its own forward pass, a weight pass after its own input pass. A pass
    takes ``forward``, ``backward``, ``input_grad`` or ``weight_grad`` (equal
    stages), or with ``as_measured`` its own measured duration, or where
    ``lengths`` has its (kind, stage) that length (a median per stage, say).
    Returns a timeline of the same form, ``{"events": ..., "makespan": ...}``.
    """
    length_of = {"F": forward, "B": backward, "I": input_grad, "W": weight_grad}
    orders = [sorted(passes, key=lambda e: e[3]) for passes in events]
    last_stage = max(int(e[1]) for passes in orders for e in passes)
    done: dict[tuple[str, int, int], float] = {}  # "B" marks an input pass too
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
                if kind in ("B", "I"):
                    needs.append(("F", stage, micro))
                    if stage < last_stage:
                        needs.append(("B", stage + 1, micro))
                if kind == "W":
                    needs.append(("B", stage, micro))
                if any(need not in done for need in needs):
                    break
                begin = max([free[rank], *(done[need] for need in needs)])
                length = (end - start) if as_measured else length_of[kind]
                if lengths and (kind, stage) in lengths:
                    length = lengths[kind, stage]
                key = "B" if kind == "I" else kind
                done[key, stage, micro] = free[rank] = begin + length
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
    """A GPT-style model and the batch it trains on.

    ``dtype_bytes`` is the size of a parameter as the passes use it and of an
    activation (2 in bfloat16 mixed precision); ``grad_bytes`` the size of a
    gradient as data parallelism reduces it (4: float32, as FSDP2's
    ``reduce_dtype=torch.float32`` and Megatron-LM's float32 gradients do).
    ``n_head`` matters only for the attention's saved activations: fused
    attention's log-sum-exp, one per head and position, or without
    ``fused_attention`` the softmax's T x T output per head (the course
    GPT's written-out attention).
    """

    n_layer: int
    n_embd: int
    seq_len: int
    batch_size: int
    dtype_bytes: int = 4
    n_head: int = 1
    grad_bytes: int = 4
    fused_attention: bool = True

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


@dataclass(frozen=True)
class Plan:
    """One way to split a training step over N devices, as the cost model sees it.

    ``layout`` is one of ``"data"``, ``"fsdp"``, ``"tensor"`` and
    ``"pipeline"`` (see ``step_costs``). ``microbatches``: the pipeline's
    micro-batches, or for the other layouts gradient accumulation, the step's
    batch in that many parts one after the other; each part holds at least
    one sequence per device that splits the batch. ``recompute``: activation
    checkpointing of every block (each keeps only its input, and the
    backward pass runs its forward again). ``sequence_parallel``: with
    ``"tensor"``, the LayerNorms' region split along the sequence.
    ``overlap``: data parallelism and FSDP hide their traffic behind the
    compute, at best.
    """

    layout: str
    microbatches: int = 1
    recompute: bool = False
    sequence_parallel: bool = False
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise CourseError(
                f"the cost model knows the layouts {', '.join(LAYOUTS)}, not "
                f"{self.layout!r}."
            )
        if self.microbatches < 1:
            raise CourseError(
                f"a plan needs at least 1 micro-batch, not {self.microbatches}."
            )
        if self.sequence_parallel and self.layout != "tensor":
            raise CourseError(
                "sequence parallelism splits tensor parallelism's LayerNorms; "
                f"the {self.layout} layout has none to split."
            )

    def on(self, processes: int) -> Layout:
        """This plan as a ``Layout`` of ``processes`` devices, all in one degree."""
        degree = {"fsdp": "shard"}.get(self.layout, self.layout)
        return Layout(
            **{degree: processes},
            microbatches=self.microbatches,
            recompute=self.recompute,
            sequence_parallel=self.sequence_parallel,
            overlap=self.overlap,
        )


@dataclass(frozen=True)
class Layout:
    """Devices as a mesh of four degrees, N their product. On the devices they
    lie in torchtitan's order, outermost first: pipeline, data (its
    "replicate"), shard, tensor (``node_links``).

    ``data`` replicas all-reduce their gradients once per step; each replica
    is sharded ``shard`` ways (FSDP, ZeRO-3: with ``data`` > 1 that is HSDP)
    and holds 1 / ``data`` of the batch, each of its ``data * shard``
    groups of ``tensor * pipeline`` devices a different part; ``tensor``
    devices split every block's products (Megatron-LM); ``pipeline`` stages
    hold L / ``pipeline`` blocks each. ``microbatches``, ``recompute``,
    ``sequence_parallel`` and ``overlap`` are a ``Plan``'s.
    """

    data: int = 1
    shard: int = 1
    tensor: int = 1
    pipeline: int = 1
    microbatches: int = 1
    recompute: bool = False
    sequence_parallel: bool = False
    overlap: bool = False

    def __post_init__(self) -> None:
        degrees = [getattr(self, d) for d in DEGREES]
        if min(degrees) < 1 or self.microbatches < 1:
            raise CourseError(
                "a layout's degrees and micro-batches must be at least 1, not "
                f"{', '.join(map(str, degrees))} and {self.microbatches}."
            )
        if self.sequence_parallel and self.tensor == 1:
            raise CourseError(
                "sequence parallelism splits tensor parallelism's LayerNorms; a "
                "layout without tensor parallelism has none to split."
            )

    @property
    def devices(self) -> int:
        """N, the product of the degrees."""
        return self.data * self.shard * self.tensor * self.pipeline

    @property
    def batch_split(self) -> int:
        """Groups of devices that hold different sequences of the batch."""
        return self.data * self.shard

    def __str__(self) -> str:
        """E.g. "shard 2 x tensor 2, k = 2, recompute" (m for a pipeline)."""
        parts = [f"{d} {getattr(self, d)}" for d in DEGREES if getattr(self, d) > 1]
        name = " x ".join(parts) or "one device"
        if self.microbatches > 1:
            name += f", {'m' if self.pipeline > 1 else 'k'} = {self.microbatches}"
        if self.sequence_parallel:
            name += ", SP"
        return name + (", recompute" if self.recompute else "")


def layouts(
    processes: int,
    microbatches: Sequence[int] = (1,),
    recompute: Sequence[bool] = (False,),
    degrees: Sequence[str] = DEGREES,
) -> list[Layout]:
    """Every layout of ``processes`` devices over ``degrees`` (their products
    equal to it), with each of ``microbatches`` and ``recompute``: the list
    a search starts from, before ``layout_memory`` removes what does not fit."""
    found = []
    sizes = [d for d in range(1, processes + 1) if processes % d == 0]
    for split in itertools.product(sizes, repeat=len(degrees)):
        if math.prod(split) != processes:
            continue
        for k, again in itertools.product(microbatches, recompute):
            found.append(
                Layout(**dict(zip(degrees, split)), microbatches=k, recompute=again)
            )
    return found


def node_links(
    layout: Layout, per_node: int, inside: DeviceAndLink, across: DeviceAndLink
) -> dict[str, DeviceAndLink]:
    """The link of each degree's collectives when the devices fill nodes of
    ``per_node`` in the mesh's order (tensor innermost, then shard, data and
    pipeline): a degree's groups stay ``inside`` a node when they and the
    degrees within them span at most ``per_node`` devices. A collective
    group that crosses nodes with g of its devices in each node leaves every
    node through g network links at once (one per device, as nccl's rings
    use them): ``across``'s bandwidth times g, at most ``inside``'s. A
    pipeline's messages go from one device to its peer, over one link."""
    links, inner = {}, 1
    for degree in ("tensor", "shard", "data", "pipeline"):  # inner to outer
        span = inner * getattr(layout, degree)
        if span <= per_node:
            links[degree] = inside
        else:
            per_node_members = 1 if degree == "pipeline" else max(1, per_node // inner)
            bandwidth = min(inside.bandwidth, per_node_members * across.bandwidth)
            links[degree] = replace(across, bandwidth=bandwidth)
        inner = span
    return links


def ring_all_reduce_seconds(
    nbytes: float, processes: int, hw: DeviceAndLink, calls: float = 1
) -> float:
    """A ring all-reduce: each device sends 2 (N - 1) / N of the bytes in 2 (N - 1)
    messages (``nbytes`` in ``calls`` collectives: as many times the latency)."""
    return 2 * ring_half_seconds(nbytes, processes, hw, calls)


def ring_half_seconds(
    nbytes: float, processes: int, hw: DeviceAndLink, calls: float = 1
) -> float:
    """A ring all-gather or reduce-scatter of ``nbytes`` (the whole, gathered
    tensor): each device sends (N - 1) / N of them in N - 1 messages per call."""
    if processes == 1:
        return 0.0
    steps = processes - 1
    return steps / processes * nbytes / hw.bandwidth + calls * steps * hw.latency


def _sequences_per_part(model: GPTWorkload, layout: Layout) -> float:
    """Sequences in one micro-batch on one device; at least one, or refused."""
    split = layout.batch_split
    per_part = model.batch_size / (split * layout.microbatches)
    if per_part < 1:
        over = f" over {split} devices" if split > 1 else ""
        raise CourseError(
            f"{layout.microbatches} micro-batches cannot split a batch of "
            f"{model.batch_size} sequences{over}; use at most "
            f"{model.batch_size // split}."
        )
    return per_part


def step_costs(
    model: GPTWorkload, hw: DeviceAndLink, plan: Plan, processes: int
) -> dict[str, float]:
    """Predicted seconds of one training step: compute, communication, bubble and total.

    ``plan.layout`` is one of

    - ``"data"``: every device a whole model and 1/N of the batch; one
      all-reduce of the gradients per step (``no_sync`` until the last
      micro-batch);
    - ``"fsdp"``: the same, with parameters, gradients and optimizer state
      sharded (ZeRO-3): per micro-batch an all-gather of the parameters
      forward, another backward, and a reduce-scatter of the gradients (each
      micro-batch's, so that they stay sharded: FSDP2's default);
    - ``"tensor"``: every block split across the N devices (Megatron-LM):
      1/N of the FLOPs, and four all-reduces of the B T d activations per
      block and step (two forward, two backward; with sequence parallelism an
      all-gather and a reduce-scatter in place of each, the same bytes);
    - ``"pipeline"``: N stages of L/N blocks and ``plan.microbatches``
      micro-batches (at most the batch's sequences): the compute of one stage,
      stretched by the bubble, and one micro-batch's activations and gradients
      sent across every boundary.

    Parameters move in ``model.dtype_bytes``, gradients in ``model.grad_bytes``.
    ``plan.recompute`` adds a forward pass to the compute (4/3 of it), and to
    tensor parallelism the forward pass's all-reduces (6 per block, not 4).
    ``plan.overlap``: the data-parallel layouts hide their communication behind
    the compute (the total is the larger of the two), as DDP and FSDP do at
    best. Tensor parallelism's all-reduces sit between the products that need
    them, and the pipeline's messages are counted only where a stage waits for
    them, so ``overlap`` leaves those two unchanged.
    """
    return layout_costs(model, hw, plan.on(processes))


def layout_costs(
    model: GPTWorkload,
    hw: DeviceAndLink,
    layout: Layout,
    links: Mapping[str, DeviceAndLink] | None = None,
) -> dict[str, float]:
    """``step_costs`` for a layout that combines degrees, each degree's
    collectives on ``links[degree]`` (default: ``hw``, whose FLOP rate every
    device has).

    Per device: 1/N of the step's FLOPs. Per micro-batch, within its shard
    group, FSDP's two all-gathers of this device's blocks' parameters (those
    its tensor and pipeline degrees leave it) and a reduce-scatter of their
    gradients, in a call per unit (each of its L / ``pipeline`` blocks, and
    the rest, gathered once: 2 L / p + 1 all-gathers and L / p + 1
    reduce-scatters, each paying the latency); once per step, across the
    replicas, an all-reduce of the gradients it keeps (a shard's, with
    ``shard`` > 1, in a call per unit: HSDP, with FSDP2's
    ``set_requires_all_reduce(False)`` until the last micro-batch). Tensor
    parallelism's all-reduces carry one micro-batch of this device's
    sequences, in its L / ``pipeline`` blocks; a pipeline sends the same
    activations across its boundaries. ``overlap`` hides only the first two
    kinds of traffic behind the compute.
    """
    link = {d: (links or {}).get(d, hw) for d in DEGREES}
    n, k = layout.devices, layout.microbatches
    _sequences_per_part(model, layout)
    compute = model.step_flops / hw.flops / n * (4 / 3 if layout.recompute else 1)
    held = model.parameters / (layout.tensor * layout.pipeline)
    weights, gradients = held * model.dtype_bytes, held * model.grad_bytes
    hideable = exposed = bubble = 0.0
    # FSDP2 as the course applies it: a unit per block and one for the rest,
    # whose parameters stay gathered from forward to backward: per
    # micro-batch 2 L / p + 1 all-gathers and L / p + 1 reduce-scatters.
    # Under a pipeline, as torchtitan and torch's PipelineStage run it, each
    # unit stays gathered through the step's micro-batches and reduce-scatters
    # after the last: one all-gather and one reduce-scatter per unit and step.
    blocks = model.n_layer / layout.pipeline
    units = blocks + 1
    if layout.shard > 1:
        s, shard = layout.shard, link["shard"]
        if layout.pipeline > 1:
            hideable += ring_half_seconds(weights, s, shard, calls=units)
            hideable += ring_half_seconds(gradients, s, shard, calls=units)
        else:
            hideable += k * (
                2 * ring_half_seconds(weights, s, shard, calls=(2 * blocks + 1) / 2)
                + ring_half_seconds(gradients, s, shard, calls=units)
            )
    if layout.data > 1:
        kept, calls = gradients / layout.shard, units if layout.shard > 1 else 1
        hideable += ring_all_reduce_seconds(kept, layout.data, link["data"], calls)
    part = model.activation_bytes / (layout.batch_split * k)  # a micro-batch's
    if layout.tensor > 1:
        per_block = 6 if layout.recompute else 4
        exposed += (
            k
            * per_block
            * blocks
            * ring_all_reduce_seconds(part, layout.tensor, link["tensor"])
        )
    if layout.pipeline > 1:
        fraction = bubble_fraction(layout.pipeline, k)
        bubble = compute * fraction / (1 - fraction)
        # On the critical path: one micro-batch's activations cross the p - 1
        # boundaries forward, and their gradients backward; the other
        # transfers overlap with other stages' computation.
        pipe = link["pipeline"]
        message = part / pipe.bandwidth + pipe.latency
        exposed += 2 * (layout.pipeline - 1) * message
    busy = max(compute, hideable) if layout.overlap else compute + hideable
    return {
        "compute": compute,
        "communication": hideable + exposed,
        "bubble": bubble,
        "total": busy + exposed + bubble,
    }


def model_state_bytes(model: GPTWorkload, layout: str, processes: int) -> float:
    """Bytes of parameters, gradients and Adam's state per device (activations
    left out): the whole model's for ``"data"``, 1/N of it for the others.

    Data parallelism keeps the weights in ``model.dtype_bytes``, the gradients
    it all-reduces in ``model.grad_bytes``, and Adam's two float32 moments
    (8), plus float32 master weights (4) when the weights are narrower:
    2 + 4 + 12 = 18 bytes per parameter in bfloat16 mixed precision with
    float32 gradients (as Megatron-LM keeps them), 16 in float32; tensor and
    pipeline parallelism keep the same bytes of 1/N of the parameters. FSDP2's
    shards hold 16 (float32 weights, gradients and moments) of 1/N of them.
    """
    if layout not in LAYOUTS:
        raise CourseError(
            f"the cost model knows the layouts {', '.join(LAYOUTS)}, not {layout!r}."
        )
    return _state_bytes(model, Plan(layout).on(processes))


def _state_bytes(model: GPTWorkload, layout: Layout) -> float:
    """``model_state_bytes`` of a layout: its blocks' share, 16 bytes per
    parameter in FSDP's shards, else data parallelism's bytes per parameter
    (of the slice its tensor and pipeline degrees leave it). FSDP under a
    pipeline keeps its stage's parameters gathered and their gradients whole
    through the step (``layout_costs``): those bytes too."""
    split = layout.shard * layout.tensor * layout.pipeline
    if layout.shard > 1:
        sharded = model.parameters * 16 / split
        if layout.pipeline == 1:
            return sharded
        held = model.parameters / (layout.tensor * layout.pipeline)
        return sharded + held * (model.dtype_bytes + model.grad_bytes)
    master = 4 if model.dtype_bytes < 4 else 0
    per_parameter = model.dtype_bytes + model.grad_bytes + master + 8
    return model.parameters * per_parameter / split


def saved_activation_bytes(model: GPTWorkload, plan: Plan, processes: int) -> float:
    """Bytes of activations one device keeps for backward at its peak
    (``layout_memory``'s ``"activations"`` for the plan on ``processes``)."""
    return _activation_bytes(model, plan.on(processes))


def _activation_bytes(model: GPTWorkload, layout: Layout) -> float:
    """Chapter 12's count, per position and block: 16 d + 4 + h elements of
    ``model.dtype_bytes`` with fused attention (h T without it, and below); under tensor parallelism
    over t devices 4 d + 4 + (12 d + h)/t, with sequence parallelism
    2 d + (14 d + 4 + h)/t (chapter 13's formulas, as DTensor keeps them). A
    device holds one micro-batch of its share of the batch (1 / (data x
    shard) of it) in its L / pipeline blocks; a pipeline's first stage, the
    fullest under 1F1B, holds min(m, pipeline) micro-batches. With
    ``recompute`` each block keeps only its input (d per position, d/t with
    sequence parallelism), plus one block's full activations while the
    backward pass recomputes it.
    """
    t, d = layout.tensor, model.n_embd
    h = model.n_head * (1 if model.fused_attention else model.seq_len)
    positions = _sequences_per_part(model, layout) * model.seq_len
    blocks = model.n_layer / layout.pipeline
    in_flight = min(layout.microbatches, layout.pipeline)
    if t == 1:
        whole, kept = 16 * d + 4 + h, d
    elif layout.sequence_parallel:
        whole, kept = 2 * d + (14 * d + 4 + h) / t, d / t
    else:
        whole, kept = 4 * d + 4 + (12 * d + h) / t, d
    per_position = in_flight * blocks * (kept if layout.recompute else whole)
    if layout.recompute:
        per_position += whole  # the block being recomputed, one micro-batch
    return per_position * positions * model.dtype_bytes


def memory_bytes(model: GPTWorkload, plan: Plan, processes: int) -> dict[str, float]:
    """``layout_memory`` of the plan on ``processes`` devices."""
    return layout_memory(model, plan.on(processes))


def layout_memory(model: GPTWorkload, layout: Layout) -> dict[str, float]:
    """Bytes per device: ``"state"`` (``model_state_bytes``' rule), ``"activations"``
    (saved for backward, at the peak) and their ``"total"``. Left out:
    temporaries, the gradients in flight, the parameters FSDP gathers, the
    logits and the allocator's cache, which real runs add on top."""
    state = _state_bytes(model, layout)
    activations = _activation_bytes(model, layout)
    return {"state": state, "activations": activations, "total": state + activations}


def compare_layouts(runs: Mapping[str, Mapping], best: int = 3) -> dict:
    """Predicted against measured for ``checks/layouts.py``'s runs.

    Returns Spearman's rank correlation of the predicted and the measured step
    times and its p-value (``"spearman"``, ``"p_value"``); the layouts
    predicted fastest (``"predicted_best"``: all of them, when several tie),
    the one the model picks (``"pick"``: of those tied, the one with the
    fewest micro-batches, whose number the model does not charge for, then
    without recomputation) and the ``best`` measured fastest
    (``"measured_best"``),
    and whether the pick is among them (``"best_among"``); the model's
    ``best`` fastest (``"shortlist"``, ties broken as for the pick) and the
    fastest of those measured, over the fastest of all measured
    (``"shortlist_over_fastest"``: what running the shortlist loses); for each layout,
    the measured step over the predicted one (``"time_ratio"``) and the
    largest measured peak of live bytes over the predicted memory
    (``"memory_ratio"``).
    """
    from scipy.stats import spearmanr  # the checks import this module without it

    names = list(runs)
    predicted = {n: runs[n]["predicted"]["step"]["total"] for n in names}
    measured = {n: runs[n]["seconds"] for n in names}
    fastest = min(predicted.values())
    predicted_best = [n for n in names if predicted[n] <= fastest * (1 + 1e-9)]
    pick = min(
        predicted_best,
        key=lambda n: (
            runs[n]["layout"]["microbatches"],
            runs[n]["layout"]["recompute"],
        ),
    )
    measured_best = sorted(names, key=measured.get)[:best]
    simplest = {  # the model's order, ties broken by fewer micro-batches
        n: (predicted[n], runs[n]["layout"]["microbatches"]) for n in names
    }
    shortlist = sorted(names, key=simplest.get)[:best]
    rho, p_value = spearmanr(list(predicted.values()), list(measured.values()))
    return {
        "spearman": float(rho),
        "p_value": float(p_value),
        "predicted_best": predicted_best,
        "pick": pick,
        "measured_best": measured_best,
        "best_among": pick in measured_best,
        "shortlist": shortlist,
        "shortlist_over_fastest": min(measured[n] for n in shortlist)
        / min(measured.values()),
        "time_ratio": {n: measured[n] / predicted[n] for n in names},
        "memory_ratio": {
            n: max(runs[n]["peak_bytes"]) / runs[n]["predicted"]["memory"]["total"]
            for n in names
        },
    }
