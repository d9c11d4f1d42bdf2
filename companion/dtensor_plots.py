"""Draw what each rank holds of a DTensor: one panel per (placement, rank).

The input is the JSON that ``companion/scripts/dtensor_basics.py`` and its
check ``companion/checks/dtensor_placements.py`` write: for each placement,
every rank's local piece as nested lists. Used in chapter 11.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

__all__ = ["piece_offsets", "plot_placements"]

_SHARD = re.compile(r"^Shard\((\d+)\)$")


def piece_offsets(
    placement: str, pieces: Sequence[Sequence[Sequence[float]]]
) -> list[tuple[int, int]]:
    """Return where each rank's piece starts (row, column) in the global matrix.

    ``Shard(d)`` pieces follow each other in rank order along dim ``d``;
    ``Replicate()`` and ``Partial()`` pieces all cover the whole matrix.

    Raises:
        ValueError: ``placement`` is none of ``Shard(0)``, ``Shard(1)``,
            ``Replicate()``, ``Partial()``.
    """
    match = _SHARD.match(placement)
    if placement in ("Replicate()", "Partial()"):
        return [(0, 0)] * len(pieces)
    if match is None or int(match.group(1)) > 1:
        raise ValueError(
            f"Cannot draw placement {placement!r}: use Shard(0), Shard(1), Replicate() "
            "or Partial()."
        )
    dim, offsets, start = int(match.group(1)), [], 0
    for piece in pieces:
        offsets.append((start, 0) if dim == 0 else (0, start))
        start += len(piece) if dim == 0 else (len(piece[0]) if piece else 0)
    return offsets


def plot_placements(
    layouts: Sequence[Mapping[str, Any]], *, cell: float = 0.21
) -> Figure:
    """One row per layout, one column per rank; each panel shades the rank's piece.

    Args:
        layouts: dicts with ``label``, ``placement``, ``global_shape`` and
            ``locals`` (one nested list per rank), as the script writes them.
        cell: size of one matrix element in inches (0.21: four ranks of 4x8
            matrices fill the book's column at full size, numbers at 7.5 pt).
    """
    n_ranks = len(layouts[0]["locals"])
    rows, cols = (
        max(l["global_shape"][0] for l in layouts),
        max(l["global_shape"][1] for l in layouts),
    )
    fig, axes = plt.subplots(
        len(layouts),
        n_ranks,
        figsize=(n_ranks * (cols + 1) * cell, len(layouts) * (rows + 1.6) * cell),
        squeeze=False,
    )
    colours = plt.get_cmap("tab10")
    for i, layout in enumerate(layouts):
        g_rows, g_cols = layout["global_shape"]
        offsets = piece_offsets(layout["placement"], layout["locals"])
        for rank, (piece, (r0, c0)) in enumerate(zip(layout["locals"], offsets)):
            ax = axes[i][rank]
            held = np.zeros((g_rows, g_cols, 4))
            held[..., :3] = (
                0.93  # light grey: part of the global matrix this rank does not hold
            )
            held[..., 3] = 1.0
            values = np.asarray(piece, dtype=float).reshape(len(piece), -1)
            held[r0 : r0 + values.shape[0], c0 : c0 + values.shape[1]] = colours(
                rank % 10, alpha=0.45
            )
            ax.imshow(held, extent=(0, g_cols, g_rows, 0))
            for (r, c), v in np.ndenumerate(values):
                ax.text(
                    c0 + c + 0.5,
                    r0 + r + 0.5,
                    f"{v:g}",
                    ha="center",
                    va="center",
                    fontsize=7.5,
                )
            ax.set_xticks(range(g_cols + 1), labels=[])
            ax.set_yticks(range(g_rows + 1), labels=[])
            ax.tick_params(length=0)
            ax.grid(color="white", linewidth=1)
            ax.set_title(f"rank {rank}", fontsize=9)
            if rank == 0:
                ax.set_ylabel(
                    layout["label"], fontsize=9, rotation=0, ha="right", va="center"
                )
    fig.set_layout_engine("constrained")
    return fig
