"""course_lib.plots.comm draws what it is given (read back from the Axes)."""

import numpy as np
import pytest

from course_lib.plots import comm as plots

MEASURED = {8: 40e-6, 1024: 42e-6, 2**20: 400e-6, 2**24: 6e-3}
MODEL = {8: 41e-6, 2**10: 41.3e-6, 2**20: 390e-6, 2**24: 6.1e-3}


def test_collective_fit_draws_model_fitted_and_held_out_points():
    ax = plots.collective_fit(MEASURED, MODEL, held_out={1024, 2**20}, title="p2p")
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    model, fitted, held = ax.get_lines()
    assert list(model.get_xdata()) == sorted(MODEL) and np.allclose(
        model.get_ydata(), [MODEL[s] * 1e6 for s in sorted(MODEL)]
    )
    assert list(fitted.get_xdata()) == [8, 2**24], "fitted points: those not held out"
    assert list(held.get_xdata()) == [1024, 2**20] and held.get_markerfacecolor() == "none", "held out: open circles"
    assert np.allclose(held.get_ydata(), [42.0, 400.0]), "seconds drawn in µs"
    assert ax.get_title() == "p2p"


def test_collective_fits_one_panel_per_collective():
    axs = plots.collective_fits({"p2p": MEASURED, "all_to_all": MEASURED}, {"p2p": MODEL, "all_to_all": MODEL}, ncols=3)
    assert [ax.get_title() for ax in axs] == ["p2p", "all to all"]
    assert not axs[0].figure.axes[2].get_visible(), "the unused third panel is hidden"
    with pytest.raises(ValueError, match="same collectives"):
        plots.collective_fits({"p2p": MEASURED}, {"all_to_all": MODEL})


def test_step_time_bars_groups_parts_by_quantity():
    times = {"H100": {"TP": 0.067, "EP": 0.86}, "H800": {"TP": 0.137, "EP": 0.86}}
    ax = plots.step_time_bars(times, unit="ms")
    heights = [p.get_height() for p in ax.patches]
    assert np.allclose(heights, [67, 860, 137, 860]), "one bar per (part, quantity), in ms"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["TP", "EP"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["H100", "H800"]
    with pytest.raises(ValueError, match="same quantities"):
        plots.step_time_bars({"H100": {"TP": 1.0}, "H800": {"EP": 1.0}})
