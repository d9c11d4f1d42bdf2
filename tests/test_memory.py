"""Training memory: state bytes and saved activations, counted and predicted."""

from __future__ import annotations

import functools

import matplotlib
import pytest
import torch
from torch import nn

from companion import CourseError
from companion.gpt import GPT, GPTConfig, lm_loss, saved_activation_bytes_formula
from companion.memory import (
    Checkpointed,
    LiveTensors,
    MemoryTimeline,
    SavedTensors,
    SnapshotTimeline,
    cuda_memory,
    memory_timeline,
    plot_snapshot,
    record_snapshot,
    shard_rows,
    snapshot_timeline,
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


def test_a_graph_that_saves_its_own_output_is_released_when_dropped() -> None:
    """tanh saves its output, whose grad_fn is tanh's node: holding that output
    itself would close a cycle that a weight-only backward pass (as a
    zero-bubble pipeline's W) never breaks, and the bytes would stay live."""
    layer = nn.Linear(16, 16, bias=False)
    x = torch.randn(8, 16, requires_grad=True)
    with SavedTensors(layer.parameters()) as saved:
        h = layer(x)
        y = torch.tanh(h)
        # "I": through tanh to the linear layer's output, the graph kept;
        # "W": from there to the weight alone, which never runs tanh's node.
        (dh,) = torch.autograd.grad(y.sum(), h, retain_graph=True)
        torch.autograd.grad(h, layer.weight, grad_outputs=dh)
        del h, y, dh
        assert saved.live == 0  # the graph went with its outputs
    assert saved.peak == 8 * 16 * 4 * 2  # x and tanh's output


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


def test_saved_bytes_are_split_by_dtype() -> None:
    x = torch.randn(100, requires_grad=True)
    with SavedTensors() as saved:
        y = x.exp()  # keeps its float32 output
        y.to(torch.bfloat16).exp()  # keeps its bfloat16 output
    assert saved.by_dtype == {torch.float32: 400, torch.bfloat16: 200}
    assert sum(saved.by_dtype.values()) == saved.nbytes


def test_live_tensors_follow_what_operations_allocate_until_it_dies() -> None:
    before = torch.ones(1000)  # exists already: not counted unless tracked
    with LiveTensors() as tensors:
        a = torch.ones(100)  # 400 bytes
        b = before * 2  # 4000 bytes
        view = b[:10]  # a view: no new storage
        del a
        c = torch.ones(50)  # 200 bytes
        assert tensors.live == 4000 + 200
        del b  # the view keeps the storage alive, all of it
        assert tensors.live == 4200
        del view
        assert tensors.live == 200
    assert tensors.peak == 400 + 4000  # before a died
    with LiveTensors(track=[before, c]) as tracked:
        assert tracked.live == 4000 + 200
        before.add_(1)  # in place: nothing new
        assert tracked.live == tracked.peak == 4200
    del c
    assert tracked.live == 4000  # followed until it dies, even after the block


def test_live_tensors_see_a_storage_resized_to_nothing_and_back() -> None:
    """FSDP2 frees a gathered parameter with ``resize_(0)`` and gathers it again."""
    original = torch.UntypedStorage.resize_
    gathered = torch.ones(256)  # 1 KiB
    storage = gathered.untyped_storage()
    with LiveTensors(track=[gathered]) as tensors:
        storage.resize_(0)  # freed after forward
        assert tensors.live == 0
        storage.resize_(1024)  # gathered again for backward
        assert tensors.live == tensors.peak == 1024
    other = torch.ones(8)
    other.untyped_storage().resize_(0)
    with LiveTensors() as tensors:
        other.untyped_storage().resize_(32)  # from nothing: allocated inside
        assert tensors.live == 32
    assert torch.UntypedStorage.resize_ is original  # restored after the block
    storage.resize_(0)
    assert storage.nbytes() == 0


def test_live_tensors_count_what_selective_checkpointing_keeps() -> None:
    """The saved-tensor hooks do not see the outputs a policy saves; this does."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        save = op is torch.ops.aten.mm.default
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 64, bias=False), nn.GELU())
    x = torch.randn(8, 16, requires_grad=True)
    contexts = functools.partial(create_selective_checkpoint_contexts, policy)
    with LiveTensors() as tensors:
        y = checkpoint(mlp, x, use_reentrant=False, context_fn=contexts)
    # The matmul's output (kept by the policy) and the GELU's (the result).
    assert tensors.live == 2 * 8 * 64 * 4
    y.sum().backward()
    assert mlp[0].weight.grad is not None


def test_the_timeline_finds_its_peak_and_the_phase_it_falls_in() -> None:
    timeline = MemoryTimeline(
        times=[0.0, 1.0, 2.0, 3.0, 4.0],
        bytes={"activations": [0, 5, 9, 2, 0], "gradients": [0, 0, 3, 4, 4]},
        phases={"forward": (0.0, 1.5), "backward": (1.5, 3.5), "step": (3.5, 4.0)},
    )
    assert timeline.peak() == 12
    assert timeline.peak_phase() == "backward"
    assert timeline.at_peak("activations") == 9 and timeline.at_peak() == 12


def synthetic_snapshot() -> tuple[dict, dict[str, int]]:
    """A snapshot as torch.cuda.memory._snapshot() returns it, for one step.

    One 2 MiB segment existed before recording, with 1 KiB allocated (the
    parameters); forward allocates 4 KiB and a new 20 MiB segment, backward
    frees 3 KiB and allocates 2 KiB, the step frees 1 KiB. At the end the
    live block asked for 3 KiB and holds 3 KiB + 512 (the allocator rounds);
    a cached block remembers what its last tensor asked for.
    """
    mib, kib = 2**20, 2**10
    trace = [
        {"action": "segment_alloc", "addr": 9, "size": 20 * mib},
        {"action": "alloc", "addr": 1, "size": 4 * kib},
        {"action": "snapshot", "addr": 0, "size": 0},
        {"action": "free_requested", "addr": 1, "size": 3 * kib},
        {"action": "free_completed", "addr": 1, "size": 3 * kib},
        {"action": "alloc", "addr": 2, "size": 2 * kib},
        {"action": "free_completed", "addr": 3, "size": 1 * kib},
    ]

    def block(size: int, asked: int, state: str = "active_allocated") -> dict:
        return {"size": size, "requested_size": asked, "state": state}

    live, cached = block(3 * kib + 512, 3 * kib), block(kib, 1000, "inactive")
    segments = [
        {
            "device": 0,
            "total_size": 2 * mib,
            "allocated_size": 3 * kib + 512,
            "blocks": [live, cached, block(2 * mib - 4 * kib - 512, 0, "inactive")],
        },
        {
            "device": 0,
            "total_size": 20 * mib,
            "allocated_size": 0,
            "blocks": [block(20 * mib, 0, "inactive")],
        },
        {
            "device": 1,
            "total_size": 2 * mib,
            "allocated_size": 2 * mib,
            "blocks": [block(2 * mib, 2 * mib)],
        },
    ]
    snapshot = {"segments": segments, "device_traces": [trace, []]}
    return snapshot, {"forward": 3, "backward": 6, "optimizer step": 7}


def test_a_snapshot_becomes_allocated_and_reserved_bytes_per_event() -> None:
    snapshot, marks = synthetic_snapshot()
    timeline = snapshot_timeline(snapshot, marks)
    kib, mib = 2**10, 2**20
    assert timeline.allocated[:5] == [kib, kib, 5 * kib, 5 * kib, 5 * kib]
    assert timeline.allocated[5:] == [2 * kib, 4 * kib, 3 * kib]
    assert timeline.reserved == [2 * mib] + [22 * mib] * 7
    assert timeline.phases == {
        "forward": (0, 3),
        "backward": (3, 6),
        "optimizer step": (6, 7),
    }
    assert timeline.peak() == 5 * kib and timeline.peak_phase() == "forward"
    assert timeline.at_end_of("backward") == 4 * kib
    assert timeline.at_end_of("optimizer step") == 3 * kib  # what the live block asked


def test_expandable_segments_grow_the_reserved_bytes_by_mapping() -> None:
    """With expandable_segments, a segment grows by segment_map, shrinks by
    segment_unmap, and no segment_alloc appears."""
    mib = 2**20
    trace = [
        {"action": "segment_map", "addr": 0, "size": 20 * mib},
        {"action": "alloc", "addr": 0, "size": 4 * mib},
        {"action": "free_completed", "addr": 0, "size": 4 * mib},
        {"action": "segment_unmap", "addr": 0, "size": 18 * mib},
    ]
    segments = [{"device": 0, "total_size": 2 * mib, "blocks": []}]
    snapshot = {"segments": segments, "device_traces": [trace]}
    timeline = snapshot_timeline(snapshot, {"step": 4})
    assert timeline.reserved == [0, 20 * mib, 20 * mib, 20 * mib, 2 * mib]
    assert timeline.allocated == [0, 0, 4 * mib, 0, 0]


def test_recording_a_snapshot_counts_the_events_of_each_phase(
    monkeypatch, tmp_path
) -> None:
    """The CUDA calls, replaced: each phase appends events to a fake trace."""
    snapshot, _ = synthetic_snapshot()
    full = snapshot["device_traces"][0]
    trace: list[dict] = []
    calls, settings, dumped = [], [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def record(enabled="all", **kwargs) -> None:
        calls.append(enabled)
        settings.append(kwargs)

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(
        torch.cuda.memory,
        "_snapshot",
        lambda device=None: {**snapshot, "device_traces": [list(trace), []]},
    )
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dumped.append)
    phases = {
        "forward": lambda: trace.extend(full[:3]),
        "backward": lambda: trace.extend(full[3:6]),
        "optimizer step": lambda: trace.extend(full[6:]),
    }
    timeline = record_snapshot(phases, "cuda:0")
    assert calls == ["all", None]  # recording switched on, then off
    assert settings[0]["context"] == "all" and settings[0]["stacks"] == "python"
    assert timeline == snapshot_timeline(*synthetic_snapshot())
    assert dumped == []  # no path, no file
    trace.clear()
    record_snapshot(phases, "cuda:0", path=tmp_path / "step.pickle")
    assert dumped == [str(tmp_path / "step.pickle")]  # for pytorch.org/memory_viz
    calls.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        record_snapshot(
            {"forward": lambda: (_ for _ in ()).throw(RuntimeError("out of memory"))},
            "cuda:0",
        )
    assert calls == ["all", None]  # off again, even after an error


def test_the_snapshot_figure_draws_both_lines_the_phases_and_the_peak() -> None:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = snapshot_timeline(*synthetic_snapshot())
    ax = plot_snapshot(timeline)
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["reserved", "allocated", "peak"]
    assert [t.get_text() for t in ax.texts] == ["forward", "backward", "optimizer step"]
    star = ax.get_lines()[2]
    assert list(star.get_xdata()) == [2] and list(star.get_ydata()) == [5 / 1024]
    plt.close(ax.figure)


def test_cuda_memory_reads_the_allocators_statistics(monkeypatch) -> None:
    stats = {"memory_allocated": 3, "memory_reserved": 8, "max_memory_allocated": 5}
    for name, value in stats.items():
        monkeypatch.setattr(torch.cuda, name, lambda device=None, v=value: v)
    assert cuda_memory("cuda:0") == {"allocated": 3, "reserved": 8, "peak": 5}


def test_a_snapshot_timeline_is_a_plain_record() -> None:
    timeline = SnapshotTimeline([0, 4, 1], [8, 8, 8], {"forward": (0, 2)})
    assert timeline.peak() == 4 and timeline.peak_phase() == "forward"
