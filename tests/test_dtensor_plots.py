"""companion.dtensor_plots: offsets of each rank's piece, and the figure's panels."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from companion.dtensor_plots import piece_offsets, plot_placements  # noqa: E402

ROWS = [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]  # Shard(0) of a 2x4 matrix over 2 ranks
COLS = [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]  # Shard(1) of the same matrix
LAYOUTS = [
    {"label": p, "placement": p, "global_shape": [2, 4], "locals": pieces}
    for p, pieces in (("Shard(0)", ROWS), ("Shard(1)", COLS))
]


def test_offsets_follow_rank_order() -> None:
    assert piece_offsets("Shard(0)", ROWS) == [(0, 0), (1, 0)]
    assert piece_offsets("Shard(1)", COLS) == [(0, 0), (0, 2)]
    assert piece_offsets("Replicate()", ROWS) == [(0, 0), (0, 0)]


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="Cannot draw"):
        piece_offsets("Shard(2)", ROWS)


def test_one_panel_per_layout_and_rank() -> None:
    fig = plot_placements(LAYOUTS)
    assert len(fig.axes) == 4
    texts = [t.get_text() for t in fig.axes[1].texts]  # Shard(0), rank 1
    assert texts == ["4", "5", "6", "7"]
    plt.close(fig)


def test_offsets_add_up_over_many_ranks_and_skip_empty_pieces() -> None:
    rows = [[[0, 1]], [[2, 3], [4, 5]], [], [[6, 7]]]  # uneven, rank 2 holds nothing
    assert piece_offsets("Shard(0)", rows) == [(0, 0), (1, 0), (3, 0), (3, 0)]
    cols = [[[0, 1]], [], [[2]], [[3]]]
    assert piece_offsets("Shard(1)", cols) == [(0, 0), (0, 2), (0, 2), (0, 3)]
    assert piece_offsets("Partial()", rows) == [(0, 0)] * 4
    with pytest.raises(
        ValueError,
        match=r"^Cannot draw placement 'partial\(\)': use Shard\(0\), Shard\(1\), "
        r"Replicate\(\) or Partial\(\)\.$",
    ):
        piece_offsets("partial()", rows)


def test_each_panel_shades_its_piece_and_writes_its_numbers_in_place() -> None:
    fig = plot_placements(LAYOUTS)
    grey = [0.93, 0.93, 0.93, 1.0]
    for ax, shaded in zip(fig.axes, [(0, slice(None)), (1, slice(None))]):
        image = ax.get_images()[0]
        held = np.asarray(image.get_array())
        assert held.shape == (2, 4, 4) and image.get_extent() == [0, 4, 2, 0]
        mask = np.zeros((2, 4), bool)
        mask[shaded] = True
        assert (held[~mask] == grey).all() and (held[mask][:, 3] == 0.45).all()
    rank1 = fig.axes[3]  # Shard(1), rank 1 holds columns 2 and 3
    held = np.asarray(rank1.get_images()[0].get_array())
    assert (held[:, :2] == grey).all() and (held[:, 2:, 3] == 0.45).all()
    assert [(t.get_text(), t.get_position()) for t in rank1.texts] == [
        ("2", (2.5, 0.5)),
        ("3", (3.5, 0.5)),
        ("6", (2.5, 1.5)),
        ("7", (3.5, 1.5)),
    ]
    labels = [(ax.get_title(), ax.get_ylabel()) for ax in fig.axes]
    assert labels == [
        ("rank 0", "Shard(0)"),
        ("rank 1", ""),
        ("rank 0", "Shard(1)"),
        ("rank 1", ""),
    ]
    plt.close(fig)
