"""course_lib.plots.moe: the helpers draw what they are given (read back from the Axes)."""

import pytest

from course_lib.plots import moe as plots_moe


def test_expert_load_splits_each_bar_at_the_capacity():
    ax = plots_moe.expert_load([5, 1, 3, 0], capacity=3)
    heights = [round(p.get_height()) for p in ax.patches]
    bottoms = [round(p.get_y()) for p in ax.patches]
    assert heights == [3, 1, 3, 0, 2, 0, 0, 0], "first the kept part min(load, capacity), then the dropped rest"
    assert bottoms[4:] == [3, 1, 3, 0], "the dropped part sits on top of the kept part"
    assert ax.lines[0].get_ydata()[0] == 3, "a dashed line marks the capacity"


def test_expert_load_without_capacity_keeps_everything():
    ax = plots_moe.expert_load([2, 4])
    assert [round(p.get_height()) for p in ax.patches] == [2, 4, 0, 0] and not ax.lines


def test_balance_over_training_draws_one_line_per_method():
    ax = plots_moe.balance_over_training({"none": [3.0, 3.5], "bias": [3.0, 1.5]})
    lines = [line for line in ax.lines if line.get_label() in ("none", "bias")]
    assert [list(line.get_ydata()) for line in lines] == [[3.0, 3.5], [3.0, 1.5]]
    with pytest.raises(ValueError, match="no curves"):
        plots_moe.balance_over_training({})
