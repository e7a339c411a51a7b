"""The lecture 02 plots draw what they are given: read the drawn bars back and compare."""

import pytest

from course_lib.dist.trace import Span
from course_lib.plots.data_parallel import compute_segments, ddp_timeline, measured_vs_formula, memory_timeline


def _step():
    return [
        Span("forward", "compute", 0.000, 0.010),
        Span("backward", "compute", 0.010, 0.030),
        Span("all_reduce", "comm", 0.015, 0.030, {"bucket": 0, "done": 0.022}),
        Span("ddp.wait", "compute", 0.025, 0.030),
    ]


def test_backward_is_cut_where_ddp_starts_waiting():
    segments = compute_segments(_step())
    assert ("backward", 0.010, 0.025) in segments, "autograd's own work ends where ddp.wait begins"


def test_timeline_draws_one_bar_per_span_and_ends_all_reduce_when_done():
    ax = ddp_timeline([_step(), _step()])
    assert len(ax.collections) == 2 * 4, "forward, backward, wait and one all-reduce for each of 2 ranks"
    extents = [c.get_paths()[0].get_extents() for c in ax.collections]
    spans_ms = sorted((round(e.x0, 3), round(e.x1, 3)) for e in extents)
    assert (15.0, 22.0) in spans_ms, (
        "the all-reduce bar must run from launch (15 ms) to completion (22 ms), not to the wait (30 ms)"
    )


def test_measured_vs_formula_bars_have_the_given_heights():
    ax = measured_vs_formula({"stage 0": 16.0, "stage 3": 4.0}, {"stage 0": 16.0, "stage 3": 4.5})
    heights = [p.get_height() for p in ax.patches]
    assert heights == [16.0, 4.0, 16.0, 4.5]


def test_mismatched_labels_are_explained():
    with pytest.raises(ValueError, match="same labels"):
        measured_vs_formula({"a": 1}, {"b": 1})
    with pytest.raises(ValueError, match="no spans"):
        ddp_timeline([])


def test_memory_timeline_draws_the_curves_in_the_given_unit():
    allocated = ([0.0, 1.0, 2.0], [1000, 3000, 500])
    gathered = ([0.5, 1.5], [2000, 0])
    ax = memory_timeline(allocated, gathered, {"forward": (0.0, 1.0), "backward": (1.0, 2.0)})
    (line,) = ax.get_lines()
    assert list(line.get_ydata()) == [1.0, 3.0, 0.5], "allocated bytes drawn in kB"
    assert len(ax.patches) == 2, "one shaded band per phase"
    assert max(ax.collections[0].get_paths()[0].vertices[:, 1]) == 2.0, "gathered bytes filled up to 2 kB"
    with pytest.raises(ValueError, match="empty allocation curve"):
        memory_timeline(([], []), gathered, {})
