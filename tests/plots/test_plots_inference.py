"""Lecture 06's plots draw what they are given and refuse what they cannot draw."""

import pytest

from course_lib.plots import inference as plots


def test_decode_speed_draws_one_line_per_cache():
    ax = plots.decode_speed([16, 64], {None: [100.0, 30.0], "paged": [200.0, 180.0]})
    assert [line.get_label() for line in ax.get_lines()] == ["no cache", "paged cache"]
    assert list(ax.get_lines()[1].get_ydata()) == [200.0, 180.0]
    with pytest.raises(ValueError, match="2 contexts"):
        plots.decode_speed([16, 64], {None: [1.0]})


def test_slots_over_time_draws_allocated_and_used():
    ax = plots.slots_over_time({"paged": ([16, 32], [10, 20])})
    assert [line.get_label() for line in ax.get_lines()] == ["paged: allocated", "paged: used"]
    with pytest.raises(ValueError, match="allocated per step"):
        plots.slots_over_time({})
