"""course_lib.plots: the helpers draw what they are given (read back from the Axes)."""

import pytest

from course_lib.dist.trace import Span
from course_lib.plots import basics as plots


def test_loss_curves_draws_each_curve_and_the_floor():
    ax = plots.loss_curves({"AdamW": [4.0, 3.0, 2.5], "SGD": ([0, 10, 20], [4.0, 3.6, 3.3])}, floor=1.869)
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines["AdamW"].get_xdata()) == [0, 1, 2] and list(lines["AdamW"].get_ydata()) == [4.0, 3.0, 2.5]
    assert list(lines["SGD"].get_xdata()) == [0, 10, 20], "a (steps, losses) pair keeps its steps"
    floor = [ln for label, ln in lines.items() if label.startswith("entropy floor")]
    assert len(floor) == 1 and set(floor[0].get_ydata()) == {1.869}, "the floor is one horizontal line at its value"
    assert "1.869" in floor[0].get_label(), "the legend gives the floor's value"
    ax = plots.loss_curves({"a": [3.0, 2.0]}, floor=1.869, levels={"bigram floor": 2.673})
    bigram = [ln for ln in ax.get_lines() if ln.get_label().startswith("bigram floor")]
    assert len(bigram) == 1 and set(bigram[0].get_ydata()) == {2.673}


def test_loss_curves_rejects_nothing_and_mismatched_lengths():
    with pytest.raises(ValueError, match="at least one curve"):
        plots.loss_curves({})
    with pytest.raises(ValueError, match="3 steps but 2 losses"):
        plots.loss_curves({"x": ([0, 1, 2], [1.0, 2.0])})


def _spans():
    return [
        [Span("forward", "compute", 10.000, 10.004), Span("all_reduce", "comm", 10.004, 10.006)],
        [("forward", "compute", 10.001, 10.005), ("all_reduce", "comm", 10.005, 10.006, {})],
    ]


def test_timeline_one_bar_per_span_on_its_rank_row():
    ax = plots.timeline(_spans(), unit="ms")
    bars = ax.collections  # one BrokenBarHCollection (PolyCollection) per span
    assert len(bars) == 4, "every span gets exactly one bar"
    boxes = sorted(
        (
            round(b.get_paths()[0].get_extents().x0, 6),
            round(b.get_paths()[0].get_extents().y0, 6),
            round(b.get_paths()[0].get_extents().width, 6),
        )
        for b in bars
    )
    # rank 0 is the top row (centre y = 1), rank 1 below it (y = 0); in each row compute is the upper
    # lane, comm the lower one; times in ms from the earliest start
    assert boxes == [(0.0, 1.0, 4.0), (1.0, 0.0, 4.0), (4.0, 0.6, 2.0), (5.0, -0.4, 1.0)], boxes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 1", "rank 0"]
    assert ax.get_xlim() == pytest.approx((0.0, 6.0))
    colors = {tuple(b.get_facecolor()[0]) for b in bars}
    assert len(colors) == 2, "compute and comm spans get different colours"


def test_timeline_accepts_a_dict_and_names_long_spans():
    ax = plots.timeline({3: _spans()[0]}, color_by="name", label_min_fraction=0.5)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 3"]
    assert [t.get_text() for t in ax.texts] == ["forward"], "only spans wider than the threshold are labelled"


def test_timeline_rejects_bad_spans():
    with pytest.raises(ValueError, match="no spans"):
        plots.timeline([[], []])
    with pytest.raises(ValueError, match="ends before it starts"):
        plots.timeline([[("x", "compute", 2.0, 1.0)]])


def test_number_line_and_bars():
    ax = plots.number_line({"fp4": [0, 0.5, 1, 1.5, 2, 3, 4, 6], "x": [1, 2]})
    segs = ax.collections[0].get_segments()
    assert sorted(s[0][0] for s in segs) == [0.5, 1, 1.5, 2, 3, 4, 6], "zero cannot sit on a log axis"
    ax = plots.bars({"SGD": 0, "Adam": 8, "Lion": 4}, ylabel="bytes")
    assert [p.get_height() for p in ax.patches] == [0, 8, 4]
    assert [t.get_text() for t in ax.texts] == ["0", "8", "4"]


def _traced_rank():
    import torch
    import torch.distributed as dist

    from course_lib.dist import device, trace

    with trace.record() as tl:
        with trace.span("forward"):
            x = torch.ones(1000, device=device()).sum()
        dist.all_reduce(torch.ones(4, device=device()) * x)
    return tl.spans


def test_timeline_draws_spans_recorded_by_launch():
    from course_lib.dist import launch

    spans = launch(_traced_rank, 2, timeout=60)
    ax = plots.timeline(spans)
    assert len(ax.collections) == sum(len(s) for s in spans) >= 4, "each rank's forward and all_reduce spans"
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"compute", "comm"}
