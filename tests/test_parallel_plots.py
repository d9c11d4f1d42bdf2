"""companion.parallel_plots: the diagrams, the pipeline timelines, the cost figure."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from companion.parallel_costs import GPTWorkload, Plan
from companion.parallel_plots import (
    pass_legend,
    plot_pipeline_timeline,
    plot_sequence_parallel,
    plot_step_costs,
    plot_tensor_parallel_mlp,
)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_the_timeline_draws_every_pass_and_ends_at_the_makespan() -> None:
    timeline = {
        "makespan": 0.4,
        "events": [
            [["F", 0, 0, 0.0, 0.1], ["B", 0, 0, 0.3, 0.4]],
            [["F", 1, 0, 0.1, 0.2], ["B", 1, 0, 0.2, 0.3]],
        ],
    }
    ax = plot_pipeline_timeline(timeline, title="GPipe, m = 1")
    bars = [p for p in ax.patches if p.get_width() > 0]
    assert sorted((round(b.get_x()), round(b.get_width())) for b in bars) == [
        (0, 100),
        (100, 100),
        (200, 100),
        (300, 100),
    ]
    assert ax.get_xlim() == (0, 400) and ax.get_title() == "GPipe, m = 1"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["process 0", "process 1"]
    assert ax.get_legend() is None  # the legend goes above the panels


def test_a_replay_is_drawn_in_passes_and_second_stages_lighter() -> None:
    timeline = {
        "makespan": 6.0,
        "events": [[["F", 0, 0, 0.0, 1.0], ["F", 2, 0, 2.0, 3.0]], [["F", 1, 0, 1, 2]]],
    }
    ax = plot_pipeline_timeline(timeline, unit="passes")
    colours = {round(p.get_x()): p.get_facecolor() for p in ax.patches}
    assert colours[0] != colours[2]  # stage 2 lives on process 0 as its second stage
    assert ax.get_xlim() == (0, 6.0) and "forward pass = 1" in ax.get_xlabel()
    pass_legend(ax.figure, interleaved=True)
    labels = [t.get_text() for t in ax.figure.legends[0].get_texts()]
    assert labels == [
        "forward",
        "backward",
        "forward, second stage",
        "backward, second stage",
    ]


def test_the_diagrams_name_their_parts() -> None:
    mlp = texts(plot_tensor_parallel_mlp())
    for part in ("f", "g", "device 0", "device 1", "$A_1$: left columns of $A$"):
        assert part in mlp, part
    assert "$B_2$: lower rows" in mlp
    sp = " ".join(texts(plot_sequence_parallel()))
    for part in ("all-gather", "reduce-\nscatter", "Replicate", "Partial", "Shard(1)"):
        assert part in sp, part


def test_the_cost_figure_draws_one_line_per_plan() -> None:
    model = GPTWorkload(n_layer=2, n_embd=64, seq_len=64, batch_size=8)
    plans = {"data": Plan("data"), "FSDP, overlapped": Plan("fsdp", overlap=True)}
    ax = plot_step_costs(
        model,
        plans,
        flops=1e12,
        latency=1e-5,
        processes=4,
        bandwidths=[1e9, 1e10, 1e11],
        marks={"a link": 1e10},
    )
    lines = [line for line in ax.get_lines() if line.get_label() in plans]
    assert [line.get_label() for line in lines] == list(plans)
    assert lines[1].get_linestyle() == "--"
    assert list(lines[0].get_xdata()) == [1.0, 10.0, 100.0]
    assert ax.get_xscale() == "log" and "a link" in [t.get_text() for t in ax.texts]


def test_layout_labels_of_close_points_do_not_overlap() -> None:
    """Two layouts with the same prediction and nearly the same measurement
    (chapter 17's 8 and 11 in memory) get labels one above the other."""
    import matplotlib.pyplot as plt

    from companion.parallel_plots import plot_predicted_layouts

    def run(step: float, memory: float, peak: float) -> dict:
        predicted = {"step": {"total": step}, "memory": {"total": memory * 2**20}}
        return {
            "predicted": predicted,
            "seconds": 2 * step,
            "peak_bytes": [peak * 2**20],
        }

    runs = {
        "a": run(0.01, 15.0, 16.15),
        "b": run(0.02, 15.0, 16.11),
        "c": run(0.03, 8, 9),
    }
    fig = plot_predicted_layouts(runs)
    memory = fig.axes[1]
    offsets = {t.get_text(): t.xyann for t in memory.texts}
    assert offsets["1"] != offsets["2"] and offsets["1"] == offsets["3"]
    plt.close(fig)
