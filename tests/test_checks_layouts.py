"""companion/checks/layouts.py and compare_layouts: which layouts, and how they are judged."""

from __future__ import annotations

import pytest

from companion import launch
from companion.checks.layouts import layouts_for
from companion.harness.launch import LaunchError
from companion.parallel_costs import Layout, compare_layouts


def test_the_chapter_runs_twelve_layouts_and_the_sweep_more() -> None:
    chapter, full = layouts_for(4), layouts_for(4, full=True)
    assert len(chapter) == 12 and set(chapter) < set(full)
    assert all(str(layout) == name for name, layout in full.items())
    assert all(layout.devices == 4 for layout in full.values())
    # Recomputation wraps the blocks: never with tensor parallelism's plans.
    assert not any(x.recompute and x.tensor > 1 for x in full.values())
    assert "data 2 x shard 2" in chapter and "shard 2 x tensor 2" in chapter
    two = layouts_for(2)  # no 2-D mesh on 2 processes
    assert len(two) == 10 and all(
        sum(getattr(x, d) > 1 for d in ("data", "shard", "tensor", "pipeline")) == 1
        for x in two.values()
    )


def run(layout: Layout, predicted: float, measured: float, memory=1.0, peak=1.0):
    return {
        "layout": {"microbatches": layout.microbatches, "recompute": layout.recompute},
        "predicted": {"step": {"total": predicted}, "memory": {"total": memory}},
        "seconds": measured,
        "peak_bytes": [peak / 2, peak],
    }


def test_compare_layouts_ranks_picks_and_breaks_ties_by_the_simpler_layout() -> None:
    runs = {
        "data 4, k = 2": run(Layout(data=4, microbatches=2), 1.0, 1.3),
        "data 4": run(Layout(data=4), 1.0, 1.1),
        "shard 4": run(Layout(shard=4), 2.0, 3.0, memory=2.0, peak=3.0),
        "tensor 4": run(Layout(tensor=4), 3.0, 2.0),
        "pipeline 4, m = 4": run(Layout(pipeline=4, microbatches=4), 4.0, 4.0),
    }
    verdict = compare_layouts(runs, best=2)
    assert verdict["predicted_best"] == ["data 4, k = 2", "data 4"]
    assert verdict["pick"] == "data 4"  # fewer micro-batches among the tied
    assert verdict["measured_best"] == ["data 4", "data 4, k = 2"]
    assert verdict["best_among"]
    # Ranks 1.5, 1.5, 3, 4, 5 against 2, 1, 4, 3, 5.
    assert verdict["spearman"] == pytest.approx(0.872, abs=1e-3)
    assert verdict["time_ratio"]["shard 4"] == pytest.approx(1.5)
    assert verdict["memory_ratio"]["shard 4"] == pytest.approx(1.5)
    assert verdict["shortlist"] == ["data 4", "data 4, k = 2"]
    assert verdict["shortlist_over_fastest"] == 1.0
    runs["data 4"]["seconds"] = 9.0  # now the pick is the slowest
    verdict = compare_layouts(runs, best=2)
    assert not verdict["best_among"] and verdict["shortlist_over_fastest"] == 1.0
    runs["data 4, k = 2"]["seconds"] = 8.0  # and the whole shortlist slow
    verdict = compare_layouts(runs, best=2)
    assert verdict["shortlist_over_fastest"] == pytest.approx(8.0 / 2.0)


@pytest.mark.slow
def test_two_processes_run_the_layouts_they_are_given(capsys) -> None:
    small = ["--steps", "1", "--n-layer", "2", "--n-embd", "64", "--batch-size", "8"]
    out = launch(
        "checks/layouts.py", ["--layouts", "data 2; pipeline 2, m = 4", *small], nproc=2
    )
    assert list(out["runs"]) == ["data 2", "pipeline 2, m = 4"]
    for run in out["runs"].values():
        assert abs(run["first_loss"] - out["plain_first_loss"]) <= 1e-5
        assert abs(run["last_loss"] - out["plain_last_loss"]) <= 1e-5
        assert run["seconds"] > 0 and len(run["peak_bytes"]) == 2
    assert out["plain_last_loss"] != out["plain_first_loss"]  # it trained
    assert set(out["links"]) == {"2"}  # one group size: all the processes
    with pytest.raises(LaunchError):
        launch("checks/layouts.py", ["--layouts", "tensor 4", *small], nproc=2)
    assert "no layout 'tensor 4' on 2 processes" in capsys.readouterr().out
