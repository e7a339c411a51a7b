"""course_lib.plots.stability: the helpers draw what they are given (read back from the Axes)."""

import math

import pytest

from course_lib.plots import stability as plots_stability


def _data(line):
    return [float(v) for v in line.get_ydata()]


def test_remedy_panels_put_each_remedy_over_the_baseline():
    runs = {"baseline": [8.0, 4.0, 11.0, 2.5], "clip": [8.0, 3.0, 2.0, 1.3], "init": [4.1, 2.0, 1.4, 1.2]}
    panels = plots_stability.remedy_panels(runs, floor=1.2)
    assert [ax.get_title() for ax in panels] == ["clip", "init"], "one panel per remedy, in order"
    for ax, name in zip(panels, ["clip", "init"], strict=True):
        by_label = {line.get_label(): line for line in ax.lines}
        assert _data(by_label["baseline"]) == runs["baseline"], "the baseline is drawn behind every remedy"
        assert _data(by_label[name]) == runs[name]
        assert ax.get_yscale() == "log"
    with pytest.raises(ValueError, match="no 'baseline'"):
        plots_stability.remedy_panels({"clip": [1.0]})


def test_a_diverged_run_ends_in_a_cross_at_its_last_finite_loss():
    runs = {"baseline": [3.0, 9.0, math.nan], "clip": [3.0, 2.0, 1.5]}
    (ax,) = plots_stability.remedy_panels(runs)
    base = next(line for line in ax.lines if line.get_label() == "baseline")
    assert _data(base) == [3.0, 9.0], "drawn up to the last finite loss"
    crosses = [line for line in ax.lines if line.get_marker() == "x"]
    assert len(crosses) == 1 and _data(crosses[0]) == [9.0]


def test_step_curves_draw_every_curve_and_the_level():
    ax = plots_stability.step_curves({"c=0": [4.0, 6.0], "c=1e-2": [4.0, 0.5]}, "log Z", level=1.0, logy=False)
    assert [_data(line) for line in ax.lines[:2]] == [[4.0, 6.0], [4.0, 0.5]]
    assert _data(ax.lines[2]) == [1.0, 1.0], "a horizontal line at the level"
    with pytest.raises(ValueError, match="at least one"):
        plots_stability.step_curves({}, "x")


def test_order_spread_plots_each_sum_minus_the_exact_one():
    ax = plots_stability.order_spread(
        {"float32": [1.0 + 2e-6, 1.0 - 1e-6], "float64": [1.0, 1.0]}, exact=1.0, bound=5e-6
    )
    offsets = [c.get_offsets() for c in ax.collections if c.get_label() in ("float32", "float64")]
    assert offsets[0][:, 0].tolist() == pytest.approx([2e-6, -1e-6]) and offsets[1][:, 0].tolist() == [0.0, 0.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["float32", "float64"]


def test_lineage_matrix_outlines_the_pairs_above_the_threshold():
    z = [[0.0, 9.0, 1.0], [8.0, 0.0, -1.0], [0.5, 2.0, 0.0]]
    ax = plots_stability.lineage_matrix(z, ["a", "a'", "b"], threshold=4.0)
    outlined = sorted((round(p.get_x() + 0.5), round(p.get_y() + 0.5)) for p in ax.patches)
    assert outlined == [(0, 1), (1, 0)], "only the two relatives' cells (column, row) are outlined"
    with pytest.raises(ValueError, match="square"):
        plots_stability.lineage_matrix([[1.0, 2.0]], ["a"])
