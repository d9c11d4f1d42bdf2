"""Static figures: training curves and small helpers. Nothing live-updates.

A figure is drawn once, after the numbers exist, so that the rendered book,
nbval and a reader's notebook all show the same picture. Used in every chapter
that trains a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

__all__ = ["plot_history", "new_axes"]


def new_axes(ncols: int = 1, *, width: float = 4.5, height: float = 3.2) -> list[Axes]:
    """Return ``ncols`` side-by-side axes of a new figure."""
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    fig.set_layout_engine("constrained")
    return list(axes[0])


def plot_history(
    history: Mapping[str, Sequence[float]],
    *,
    x: Sequence[float] | None = None,
    xlabel: str = "epoch",
    ylabel: str = "",
    title: str = "",
    logy: bool = False,
    ax: Axes | None = None,
) -> Axes:
    """Plot one line per entry of ``history`` (``{"train loss": [...], ...}``).

    Args:
        history: curve name to values; curves may differ in length.
        x: x positions shared by all curves (default: 1, 2, 3, ...).
        logy: use a logarithmic y axis (for losses that fall by decades).
        ax: draw into these axes instead of a new figure.
    """
    if ax is None:
        (ax,) = new_axes()
    for name, values in history.items():
        xs = list(x)[: len(values)] if x is not None else range(1, len(values) + 1)
        ax.plot(xs, list(values), label=name, marker="o" if len(values) <= 20 else None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(history) > 1:
        ax.legend()
    return ax
