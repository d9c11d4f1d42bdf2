"""companion.harness.plotting: static curves with the right data, labels and scales."""

import matplotlib

matplotlib.use("Agg")

from companion.harness.plotting import new_axes, plot_history


def test_one_line_per_curve_with_default_x():
    ax = plot_history(
        {"train loss": [3.0, 2.0, 1.0], "test loss": [3.5, 2.5]},
        ylabel="loss",
        title="t",
    )
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["train loss", "test loss"]
    assert list(lines[0].get_xdata()) == [1, 2, 3]
    assert list(lines[1].get_ydata()) == [3.5, 2.5]
    assert ax.get_ylabel() == "loss" and ax.get_title() == "t"
    assert ax.get_legend() is not None


def test_shared_x_log_scale_and_given_axes():
    (ax,) = new_axes()
    out = plot_history(
        {"loss": [1.0, 0.1, 0.01]}, x=[10, 20, 30], logy=True, ax=ax, xlabel="step"
    )
    assert out is ax
    assert list(ax.get_lines()[0].get_xdata()) == [10, 20, 30]
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "step"
    assert ax.get_legend() is None  # a single curve needs no legend


def test_new_axes_side_by_side():
    axes = new_axes(3)
    assert len(axes) == 3 and len({id(a.figure) for a in axes}) == 1


def test_new_axes_size_and_layout():
    axes = new_axes(2, width=3.0, height=2.0)
    figure = axes[0].figure
    assert list(figure.get_size_inches()) == [6.0, 2.0]  # width per column
    assert figure.get_layout_engine().__class__.__name__ == "ConstrainedLayoutEngine"
    assert axes[0].get_subplotspec().get_gridspec().get_geometry() == (1, 2)
    (one,) = new_axes()
    assert list(one.figure.get_size_inches()) == [4.5, 3.2]


def test_plot_history_defaults_and_markers():
    ax = plot_history({"short": [1.0] * 20, "long": [1.0] * 21})
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("epoch", "", "")
    assert ax.get_yscale() == "linear"
    short, long = ax.get_lines()
    assert (short.get_marker(), long.get_marker()) == ("o", "None")  # dots up to 20
    assert ax.xaxis.get_gridlines()[0].get_alpha() == 0.3
