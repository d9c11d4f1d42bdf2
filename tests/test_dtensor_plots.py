"""companion.dtensor_plots: offsets of each rank's piece, and the figure's panels."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from companion.dtensor_plots import piece_offsets, plot_placements  # noqa: E402

ROWS = [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]  # Shard(0) of a 2x4 matrix over 2 ranks
COLS = [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]  # Shard(1) of the same matrix


def test_offsets_follow_rank_order() -> None:
    assert piece_offsets("Shard(0)", ROWS) == [(0, 0), (1, 0)]
    assert piece_offsets("Shard(1)", COLS) == [(0, 0), (0, 2)]
    assert piece_offsets("Replicate()", ROWS) == [(0, 0), (0, 0)]


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="Cannot draw"):
        piece_offsets("Shard(2)", ROWS)


def test_one_panel_per_layout_and_rank() -> None:
    layouts = [
        {
            "label": "Shard(0)",
            "placement": "Shard(0)",
            "global_shape": [2, 4],
            "locals": ROWS,
        },
        {
            "label": "Shard(1)",
            "placement": "Shard(1)",
            "global_shape": [2, 4],
            "locals": COLS,
        },
    ]
    fig = plot_placements(layouts)
    assert len(fig.axes) == 4
    texts = [t.get_text() for t in fig.axes[1].texts]  # Shard(0), rank 1
    assert texts == ["4", "5", "6", "7"]
    plt.close(fig)
