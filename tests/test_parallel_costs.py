"""companion.parallel_costs: the bubble formula, replayed schedules and the cost model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from companion.gpt import (
    GPT,
    CharText,
    GPTConfig,
    lm_loss,
    saved_activation_bytes_formula,
)
from companion.harness.notebook import CourseError
from companion.parallel_costs import (
    DeviceAndLink,
    GPTWorkload,
    Layout,
    Plan,
    bubble_fraction,
    layout_costs,
    layout_memory,
    layouts,
    memory_bytes,
    model_state_bytes,
    node_links,
    replay_schedule,
    ring_all_reduce_seconds,
    saved_activation_bytes,
    step_costs,
    timeline_bubble,
)

FAST = DeviceAndLink("ideal", flops=1e12, bandwidth=float("inf"), latency=0.0)


@pytest.mark.parametrize(
    "p, m, v, expected",
    [(1, 8, 1, 0.0), (2, 1, 1, 1 / 2), (4, 8, 1, 3 / 11), (2, 4, 2, 1 / 9)],
)
def test_bubble_fraction(p, m, v, expected) -> None:
    assert bubble_fraction(p, m, v) == pytest.approx(expected)


def test_bubble_fraction_refuses_zero() -> None:
    with pytest.raises(CourseError, match="at least 1, not 2, 0 and 1"):
        bubble_fraction(2, 0)


def test_step_flops_match_the_flop_counter() -> None:
    """PyTorch's own FLOP counter over a real training step, minus the head."""
    text = CharText()
    config = GPTConfig(vocab_size=text.vocab_size, block_size=32, n_layer=2, n_embd=32)
    model = GPT(config)
    x, y = text.batch(3, 32, torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(x), y).backward()
    head = 3 * 2 * config.vocab_size * config.n_embd * x.numel()
    ours = GPTWorkload(n_layer=2, n_embd=32, seq_len=32, batch_size=3)
    assert counter.get_total_flops() - head == ours.step_flops


def test_ring_all_reduce() -> None:
    hw = DeviceAndLink("link", flops=1.0, bandwidth=100.0, latency=0.5)
    assert ring_all_reduce_seconds(400, 1, hw) == 0.0
    assert ring_all_reduce_seconds(400, 4, hw) == pytest.approx(1.5 * 4 + 6 * 0.5)


def test_step_costs_on_an_ideal_link_divide_the_compute() -> None:
    model = GPTWorkload(n_layer=4, n_embd=64, seq_len=64, batch_size=8)
    alone = model.step_flops / FAST.flops
    for layout in ("data", "fsdp", "tensor"):
        costs = step_costs(model, FAST, Plan(layout), 4)
        assert costs["total"] == pytest.approx(alone / 4)
        assert costs["communication"] == costs["bubble"] == 0
    pipe = step_costs(model, FAST, Plan("pipeline", 8), 4)
    assert pipe["compute"] == pytest.approx(alone / 4)
    # 8 micro-batches of work in 11 slots: the bubble is 3 slots.
    assert pipe["bubble"] == pytest.approx(alone / 4 * 3 / 8)
    # Recomputation runs the forward pass again: a third more compute.
    again = step_costs(model, FAST, Plan("fsdp", recompute=True), 4)
    assert again["compute"] == pytest.approx(alone / 4 * 4 / 3)


def test_step_costs_count_the_bytes() -> None:
    model = GPTWorkload(n_layer=2, n_embd=8, seq_len=4, batch_size=2, dtype_bytes=4)
    hw = DeviceAndLink("slow", flops=float("inf"), bandwidth=1000.0, latency=0.01)
    # data: the 12 * 2 * 64 parameters' 4 bytes, all-reduced over 2 devices.
    assert step_costs(model, hw, Plan("data"), 2)["total"] == pytest.approx(
        6144 / 1000 + 2 * 0.01
    )
    # tensor: 4 all-reduces of 2 x 4 x 8 x 4 = 256 bytes per block.
    assert step_costs(model, hw, Plan("tensor"), 2)["total"] == pytest.approx(
        8 * (256 / 1000 + 2 * 0.01)
    )
    # pipeline, 4 micro-batches of 4 sequences: a quarter of the 4 x 4 x 8 x 4
    # bytes of activations across 1 boundary, each way.
    four = GPTWorkload(n_layer=2, n_embd=8, seq_len=4, batch_size=4, dtype_bytes=4)
    assert step_costs(four, hw, Plan("pipeline", 4), 2)[
        "communication"
    ] == pytest.approx(2 * (128 / 1000 + 0.01))
    with pytest.raises(CourseError, match="not 'expert'"):
        Plan("expert")


def test_gradients_move_in_their_own_dtype() -> None:
    """bfloat16 weights are gathered in 2 bytes, float32 gradients reduced in 4."""
    mixed = GPTWorkload(2, 8, 4, 4, dtype_bytes=2, grad_bytes=4)
    hw = DeviceAndLink("slow", flops=float("inf"), bandwidth=1000.0, latency=0.0)
    P = 12 * 2 * 64
    # DDP all-reduces 4-byte gradients; FSDP gathers 2-byte weights twice and
    # reduce-scatters 4-byte gradients: 2 x 2 + 4 = 8 bytes, (N - 1)/N each.
    assert step_costs(mixed, hw, Plan("data"), 4)["total"] == pytest.approx(
        2 * 3 / 4 * 4 * P / 1000
    )
    assert step_costs(mixed, hw, Plan("fsdp"), 4)["communication"] == pytest.approx(
        3 / 4 * 8 * P / 1000
    )


def test_accumulation_multiplies_fsdps_gathers_and_tps_messages_only() -> None:
    model = GPTWorkload(n_layer=2, n_embd=8, seq_len=4, batch_size=8, dtype_bytes=2)
    hw = DeviceAndLink("slow", flops=1e6, bandwidth=1000.0, latency=0.01)
    one, four = (Plan("fsdp", k) for k in (1, 4))
    assert step_costs(model, hw, four, 2)["communication"] == pytest.approx(
        4 * step_costs(model, hw, one, 2)["communication"]
    )
    for layout in ("data", "tensor"):  # the same bytes; tensor: 4x the messages
        a, b = (step_costs(model, hw, Plan(layout, k), 2) for k in (1, 4))
        latency = 0 if layout == "data" else 3 * 4 * 2 * 2 * 0.01
        assert b["communication"] - a["communication"] == pytest.approx(latency)
    # Recomputing a tensor-parallel block repeats its forward all-reduces.
    a, b = (step_costs(model, hw, Plan("tensor", recompute=r), 2) for r in (0, 1))
    assert b["communication"] == pytest.approx(1.5 * a["communication"])


def test_plans_refuse_more_micro_batches_than_sequences() -> None:
    model = GPTWorkload(n_layer=2, n_embd=8, seq_len=4, batch_size=8)
    assert step_costs(model, FAST, Plan("pipeline", 8), 2)["bubble"] > 0
    with pytest.raises(
        CourseError,
        match=r"^9 micro-batches cannot split a batch of 8 sequences; use at most 8\.$",
    ):
        step_costs(model, FAST, Plan("pipeline", 9), 2)
    with pytest.raises(
        CourseError,
        match=r"^4 micro-batches cannot split a batch of 8 sequences over 4 "
        r"devices; use at most 2\.$",
    ):
        memory_bytes(model, Plan("fsdp", 4), 4)
    with pytest.raises(CourseError, match="at least 1 micro-batch, not 0"):
        Plan("data", 0)
    with pytest.raises(CourseError, match="the fsdp layout has none to split"):
        Plan("fsdp", sequence_parallel=True)


def gpipe_events(p: int, m: int) -> list[list[list]]:
    """GPipe's order on each of p processes, with made-up (staggered) times."""
    return [
        [["F", s, i, s + i, s + i + 1] for i in range(m)]
        + [["B", s, i, 10 * m + i, 10 * m + i + 2] for i in range(m)]
        for s in range(p)
    ]


def one_f_one_b_events(p: int, m: int) -> list[list[list]]:
    """1F1B's order (warm-up of p - s forward passes, then B and F in turn)."""
    events = []
    for s in range(p):
        order = [("F", i) for i in range(min(m, p - s))]
        f, b = len(order), 0
        while b < m:
            order.append(("B", b))
            b += 1
            if f < m:
                order.append(("F", f))
                f += 1
        events.append(
            [[k, s, i, 3.0 * n, 3.0 * n + 1] for n, (k, i) in enumerate(order)]
        )
    return events


@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (4, 8), (4, 4)])
def test_replayed_with_equal_stages_the_schedules_meet_the_formula(p, m) -> None:
    for events in (gpipe_events(p, m), one_f_one_b_events(p, m)):
        replay = replay_schedule(events)
        assert timeline_bubble(replay) == pytest.approx(
            bubble_fraction(p, m), abs=1e-12
        )
        assert replay["makespan"] == pytest.approx(3 * (m + p - 1))


def test_the_replay_follows_the_dependencies() -> None:
    events = gpipe_events(2, 2)
    replay = replay_schedule(events, forward=1.0, backward=2.0)
    starts = {(e[0], e[1], e[2]): e[3] for passes in replay["events"] for e in passes}
    # F of stage 1 after stage 0's; B of stage 0 after stage 1's.
    assert starts["F", 1, 0] == 1.0 and starts["F", 1, 1] == 2.0
    assert starts["B", 1, 0] == 3.0 and starts["B", 0, 0] == 5.0
    assert replay["makespan"] == 9.0
    measured = replay_schedule(events, as_measured=True)  # passes as long as recorded
    lengths = sorted(e[4] - e[3] for passes in measured["events"] for e in passes)
    assert lengths == [1] * 4 + [2] * 4


def test_the_replay_splits_a_backward_pass_into_input_and_weight() -> None:
    """Two stages, one micro-batch: the input pass of stage 0 waits for stage 1's,
    a weight pass for its own input pass, and nothing waits for a weight pass."""
    events = [
        [["F", 0, 0, 0, 1], ["I", 0, 0, 4, 5], ["W", 0, 0, 5, 6]],
        [["F", 1, 0, 1, 2], ["I", 1, 0, 2, 3], ["W", 1, 0, 3, 4]],
    ]
    replay = replay_schedule(events, forward=1.0, input_grad=2.0, weight_grad=3.0)
    ends = {(e[0], e[1]): e[4] for passes in replay["events"] for e in passes}
    assert ends["F", 1] == 2.0 and ends["I", 1] == 4.0 and ends["W", 1] == 7.0
    # stage 0's input pass needs only stage 1's input pass, not its weight pass
    assert ends["I", 0] == 6.0 and ends["W", 0] == 9.0
    assert replay["makespan"] == 9.0


def test_lengths_per_stage_override_the_kinds() -> None:
    """Stage 0's input pass takes nothing and its weight pass the whole
    backward (torch's first stage), the others' the lengths of their kind."""
    events = [
        [["F", 0, 0, 0, 1], ["I", 0, 0, 4, 5], ["W", 0, 0, 5, 6]],
        [["F", 1, 0, 1, 2], ["I", 1, 0, 2, 3], ["W", 1, 0, 3, 4]],
    ]
    lengths = {("I", 0): 0.0, ("W", 0): 2.0}
    replay = replay_schedule(events, lengths=lengths)
    ends = {(e[0], e[1]): e[4] for passes in replay["events"] for e in passes}
    assert ends["I", 1] == 3.0 and ends["W", 1] == 4.0
    assert ends["I", 0] == 3.0 and ends["W", 0] == 5.0
    assert replay["makespan"] == 5.0


def test_an_impossible_order_is_one_sentence() -> None:
    events = [[["B", 0, 0, 0, 1], ["F", 0, 0, 1, 2]], [["F", 1, 0, 0, 1]]]
    with pytest.raises(CourseError, match="cannot run in the order given"):
        replay_schedule(events)


def test_fsdp_sends_one_and_a_half_all_reduces_and_overlap_hides_them() -> None:
    model = GPTWorkload(n_layer=2, n_embd=8, seq_len=4, batch_size=4, dtype_bytes=4)
    hw = DeviceAndLink("slow", flops=1e6, bandwidth=1000.0, latency=0.01)
    data = step_costs(model, hw, Plan("data"), 4)
    fsdp = step_costs(model, hw, Plan("fsdp"), 4)
    # The bytes of 1.5 all-reduces; the latency of a call per unit (2 blocks
    # and the rest): 5 all-gathers and 3 reduce-scatters of 3 ring steps each.
    latency = 3 * hw.latency
    assert fsdp["communication"] - 8 * latency == pytest.approx(
        1.5 * (data["communication"] - 2 * latency)
    )
    hidden = step_costs(model, hw, Plan("fsdp", overlap=True), 4)
    assert hidden["total"] == pytest.approx(max(fsdp["compute"], fsdp["communication"]))
    # Tensor parallelism's all-reduces cannot hide: overlap changes nothing.
    assert step_costs(model, hw, Plan("tensor", overlap=True), 4) == step_costs(
        model, hw, Plan("tensor"), 4
    )


def test_model_state_bytes() -> None:
    model = GPTWorkload(n_layer=2, n_embd=8, seq_len=4, batch_size=2)
    assert model_state_bytes(model, "data", 4) == 16 * 1536  # float32: 4 + 4 + 8
    # bfloat16 weights, float32 gradients and master weights: 2 + 4 + 4 + 8
    mixed = dataclasses.replace(model, dtype_bytes=2)
    assert model_state_bytes(mixed, "data", 4) == 18 * 1536
    assert model_state_bytes(mixed, "fsdp", 4) == 4 * 1536
    for layout in ("fsdp", "tensor", "pipeline"):
        assert model_state_bytes(model, layout, 4) == 4 * 1536
    with pytest.raises(CourseError, match="not 'expert'"):
        model_state_bytes(model, "expert", 4)


def test_activations_follow_chapter_12s_formula_with_fused_attention() -> None:
    """One device of data parallelism keeps what the course's GPT saves for its
    share of the batch, in its blocks (companion.gpt's formula, sdpa=True)."""
    config = GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=16, sdpa=True)
    model = GPTWorkload(3, 32, 16, batch_size=8, dtype_bytes=2, n_head=4)
    blocks = saved_activation_bytes_formula(config, 2, 16, dtype_bytes=2)["blocks"]
    assert saved_activation_bytes(model, Plan("data"), 4) == blocks  # 8 / 4 sequences
    assert saved_activation_bytes(model, Plan("fsdp", 2), 4) == blocks / 2


def test_activations_of_each_layout() -> None:
    d, h, n, T, B, L = 64, 4, 2, 8, 4, 4
    model = GPTWorkload(L, d, T, B, dtype_bytes=1, n_head=h)
    positions = B * T
    tensor = saved_activation_bytes(model, Plan("tensor"), n)
    assert tensor == positions * L * (4 * d + 4 + (12 * d + h) / n)
    sp = saved_activation_bytes(model, Plan("tensor", sequence_parallel=True), n)
    assert sp == positions * L * (2 * d + (14 * d + 4 + h) / n)
    # 1F1B's first stage: min(m, p) micro-batches of B/m sequences, L/p blocks.
    pipe = saved_activation_bytes(model, Plan("pipeline", 4), n)
    assert pipe == 2 * (positions / 4) * (L / 2) * (16 * d + 4 + h)
    # Recomputation: each block's input, and one block whole.
    again = saved_activation_bytes(model, Plan("data", recompute=True), n)
    assert again == positions / n * (L * d + 16 * d + 4 + h)
    both = saved_activation_bytes(
        model, Plan("tensor", sequence_parallel=True, recompute=True), n
    )
    assert both == positions * (L * d / n + 2 * d + (14 * d + 4 + h) / n)


def test_memory_adds_state_and_activations() -> None:
    model = GPTWorkload(32, 4096, 4096, 32, dtype_bytes=2, n_head=32)
    fsdp = memory_bytes(model, Plan("fsdp"), 8)
    assert fsdp["state"] == 16 * model.parameters / 8
    # 4 sequences of 4096 per GPU: about 69 GB of activations, 81.6 GB in all.
    assert fsdp["activations"] / 1e9 == pytest.approx(68.76, abs=0.01)
    assert fsdp["total"] == fsdp["state"] + fsdp["activations"]
    assert fsdp["total"] / 1e9 == pytest.approx(81.64, abs=0.01)


def test_the_checks_can_import_the_formulas_without_matplotlib() -> None:
    """The pipeline check imports this module in every process: no matplotlib."""
    code = "import companion.parallel_costs, sys; print('matplotlib' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr


def test_a_plan_is_the_layout_of_one_degree() -> None:
    model = GPTWorkload(n_layer=4, n_embd=64, seq_len=32, batch_size=8)
    hw = DeviceAndLink("link", flops=1e9, bandwidth=1e8, latency=1e-5)
    for kind, degree in (("data", "data"), ("fsdp", "shard"), ("tensor", "tensor")):
        plan = Plan(kind, 2, recompute=True)
        assert plan.on(4) == Layout(**{degree: 4}, microbatches=2, recompute=True)
        assert step_costs(model, hw, plan, 4) == layout_costs(model, hw, plan.on(4))
        assert memory_bytes(model, plan, 4) == layout_memory(model, plan.on(4))


def test_hsdp_is_fsdp_within_a_replica_and_an_all_reduce_of_the_shard_across() -> None:
    model = GPTWorkload(n_layer=4, n_embd=64, seq_len=32, batch_size=8)
    near = DeviceAndLink("node", flops=1e9, bandwidth=1e9, latency=1e-6)
    far = DeviceAndLink("cluster", flops=1e9, bandwidth=1e7, latency=1e-4)
    hsdp = Layout(data=2, shard=4)
    costs = layout_costs(model, near, hsdp, links={"data": far})
    fsdp = layout_costs(model, near, Layout(shard=4))["communication"]
    shard = model.parameters * model.grad_bytes / 4
    units = model.n_layer + 1  # an all-reduce per unit, on a ring of 2
    across = 2 * (shard / 2 / far.bandwidth + units * far.latency)
    assert costs["communication"] == pytest.approx(fsdp + across)
    assert costs["compute"] == pytest.approx(model.step_flops / near.flops / 8)
    assert layout_memory(model, hsdp)["state"] == model.parameters * 16 / 4
    # Each replica's devices hold an eighth of the batch, as 8 data replicas do.
    assert (
        layout_memory(model, hsdp)["activations"]
        == (layout_memory(model, Layout(data=8))["activations"])
    )


def test_tensor_within_data_parallel_sends_each_replicas_micro_batch() -> None:
    """Tensor parallelism over 2 inside 2 replicas: its all-reduces carry a
    quarter of the batch's activations when k = 2, in every block; the
    replicas all-reduce the half of the gradients each device keeps."""
    model = GPTWorkload(n_layer=4, n_embd=64, seq_len=32, batch_size=8)
    hw = DeviceAndLink("link", flops=1e9, bandwidth=1e8, latency=0.0)
    costs = layout_costs(model, hw, Layout(data=2, tensor=2, microbatches=2))
    part = model.activation_bytes / 4
    tensor = 2 * 4 * model.n_layer * ring_all_reduce_seconds(part, 2, hw)
    data = ring_all_reduce_seconds(model.parameters * model.grad_bytes / 2, 2, hw)
    assert costs["communication"] == pytest.approx(tensor + data)


def test_layouts_lists_every_split_once() -> None:
    found = layouts(4, microbatches=(1, 2), recompute=(False, True))
    assert len(found) == 10 * 4 == len(set(found))  # 10 ways to split 4 over 4
    assert all(layout.devices == 4 for layout in found)
    assert Layout(shard=2, tensor=2, microbatches=2, recompute=True) in found
    assert str(Layout(shard=2, tensor=2, microbatches=2, recompute=True)) == (
        "shard 2 x tensor 2, k = 2, recompute"
    )
    assert str(Layout(pipeline=4, microbatches=8)) == "pipeline 4, m = 8"
    with pytest.raises(CourseError, match="at least 1, not 0, 1, 1, 1 and 1"):
        Layout(data=0)


def test_node_links_keep_the_inner_degrees_inside_a_node() -> None:
    inside, across = (DeviceAndLink(n, 1.0, 1.0, 0.0) for n in ("in", "out"))
    links = node_links(Layout(data=2, shard=4, tensor=2), 8, inside, across)
    assert {d: link.name for d, link in links.items()} == {
        "tensor": "in",
        "shard": "in",
        "data": "out",
        "pipeline": "out",
    }
    links = node_links(Layout(shard=8, tensor=2), 8, inside, across)
    assert (links["tensor"].name, links["shard"].name) == ("in", "out")


def test_a_group_across_nodes_leaves_each_node_through_all_its_devices() -> None:
    inside = DeviceAndLink("in", 1.0, bandwidth=300.0, latency=0.0)
    across = DeviceAndLink("out", 1.0, bandwidth=25.0, latency=1.0)
    # FSDP over 64 on nodes of 8: 8 devices of a group in each node.
    assert node_links(Layout(shard=64), 8, inside, across)["shard"].bandwidth == 200.0
    # Inside tensor parallelism over 2: 4 devices of each shard group per node.
    links = node_links(Layout(shard=32, tensor=2), 8, inside, across)
    assert links["shard"].bandwidth == 100.0 and links["shard"].latency == 1.0
    # HSDP across 8 nodes: one device of each replica group per node.
    assert node_links(Layout(data=8, shard=8), 8, inside, across)["data"] == across


def test_fsdp_under_a_pipeline_gathers_and_reduces_once_per_step() -> None:
    """The units stay gathered through the micro-batches (torchtitan's
    reshard_after_forward=False) and reduce-scatter after the last."""
    model = GPTWorkload(n_layer=4, n_embd=64, seq_len=32, batch_size=16)
    hw = DeviceAndLink("link", flops=1e9, bandwidth=1e8, latency=1e-4)
    costs = {
        m: layout_costs(model, hw, Layout(shard=2, pipeline=2, microbatches=m))
        for m in (2, 8)
    }
    held = model.parameters * 4 / 2  # a stage's blocks, float32
    units = 2 + 1  # a stage's 2 blocks and the rest
    shard = 2 * (held / 2 / hw.bandwidth + units * hw.latency)  # gather, reduce
    for m, c in costs.items():
        messages = 2 * (model.activation_bytes / (2 * m) / hw.bandwidth + hw.latency)
        assert c["communication"] == pytest.approx(shard + messages)


def test_sequence_parallelism_needs_tensor_parallelism() -> None:
    with pytest.raises(CourseError, match="has none to split"):
        Layout(data=2, sequence_parallel=True)


def test_state_of_split_blocks_without_fsdp_is_data_parallel_bytes() -> None:
    """In bfloat16 with float32 gradients: 18 bytes per parameter of the slice
    for tensor or pipeline parallelism, 16 for FSDP's float32 shards, and
    under a pipeline FSDP's gathered weights and whole gradients besides."""
    model = GPTWorkload(n_layer=4, n_embd=64, seq_len=32, batch_size=8, dtype_bytes=2)
    p = model.parameters
    assert layout_memory(model, Layout(tensor=4))["state"] == p * 18 / 4
    assert layout_memory(model, Layout(pipeline=2, data=2))["state"] == p * 18 / 2
    assert layout_memory(model, Layout(shard=4))["state"] == p * 16 / 4
    fsdp_pipe = Layout(shard=2, pipeline=2, microbatches=2)
    assert layout_memory(model, fsdp_pipe)["state"] == p * 16 / 4 + p / 2 * (2 + 4)


def test_a_pipeline_sends_across_nodes_over_one_card() -> None:
    inside = DeviceAndLink("in", 1.0, bandwidth=300.0, latency=0.0)
    across = DeviceAndLink("out", 1.0, bandwidth=25.0, latency=1.0)
    links = node_links(Layout(shard=2, pipeline=32), 8, inside, across)
    assert links["pipeline"].bandwidth == 25.0 and links["shard"] == inside
