"""course_lib.plots.context_parallel and .pipeline: the helpers draw what they are given (read back from the Axes)."""

import numpy as np
import pytest

from course_lib.parallel.context import ring_attention
from course_lib.parallel.pipeline.schedules import build
from course_lib.parallel.pipeline.simulate import simulate
from course_lib.plots import context_parallel as plots_parallel
from course_lib.plots.pipeline import schedule_gantt


def test_chunk_owners_follow_the_library_layouts():
    assert ring_attention.chunk_owners(4, "contiguous") == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ring_attention.chunk_owners(4, "zigzag") == [0, 1, 2, 3, 3, 2, 1, 0], (
        "zigzag gives rank r chunks r and 2N-1-r (course_lib.parallel.context.ring_attention.zigzag_chunks)"
    )


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_causal_work_grid_labels_every_unmasked_pair_with_its_rank(layout):
    world = 3
    ax = plots_parallel.causal_work_grid(ring_attention.chunk_owners(world, layout))
    labels = [int(t.get_text()) for t in ax.texts]
    n = 2 * world
    assert len(labels) == n * (n + 1) // 2, "one label per (query chunk, key chunk) pair on or below the diagonal"
    owners = ring_attention.chunk_owners(world, layout)
    # text i-th written row by row: (0,0), (1,0), (1,1), (2,0), ...
    want = [owners[i] for i in range(n) for _ in range(i + 1)]
    assert labels == want, "each pair is computed by the rank that owns its query chunk"
    image = ax.get_images()[0].get_array()
    assert np.all(image[0, 1:, :3] == 1.0), "pairs above the diagonal (masked) stay blank"
    work = [sum(1.0 if j < i else 0.5 for i in range(n) for j in range(i + 1) if owners[i] == r) for r in range(world)]
    if layout == "zigzag":
        assert len(set(work)) == 1, f"zigzag balances the causal work: {work}"
    else:
        assert work == sorted(work) and work[0] < work[-1], f"contiguous: later ranks do more: {work}"


def test_work_per_rank_draws_one_bar_per_rank_and_layout_and_the_means():
    ax = plots_parallel.work_per_rank({"contiguous": [1, 3, 5, 7], "zigzag": [4, 4, 4, 4]})
    heights = [p.get_height() for p in ax.patches]
    assert heights == [1, 3, 5, 7, 4, 4, 4, 4]
    means = sorted(set(ln.get_ydata()[0] for ln in ax.get_lines()))
    assert means == [4.0], "both layouts do the same total work here, so both dashed means sit at 4"
    with pytest.raises(ValueError, match="one value per rank"):
        plots_parallel.work_per_rank({"a": [1, 2], "b": [1, 2, 3]})


def test_memory_vs_length_is_log_log_and_skips_impossible_points():
    ax = plots_parallel.memory_vs_length([8, 16, 32], {"ring": [1, 2, 4], "ulysses": [1, None, None]}, budget=3)
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines["ring"].get_ydata()) == [1, 2, 4]
    assert list(lines["ulysses"].get_xdata()) == [8], "None marks a degree the method cannot run at: not drawn"
    assert set(lines["budget"].get_ydata()) == {3}
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    with pytest.raises(ValueError, match="3 sequence lengths"):
        plots_parallel.memory_vs_length([8, 16, 32], {"ring": [1, 2]})


def test_schedule_gantt_draws_one_bar_per_action_on_its_rank():
    sim = simulate(build("1f1b", 2, 3), {"F": 1.0, "B": 2.0})
    ax = schedule_gantt(sim.spans, xlabel="time (F = 1)")
    bars = [c.get_paths()[0].get_extents() for c in ax.collections]
    assert len(bars) == 2 * 6, "3 forwards and 3 backwards on each of 2 ranks"
    top = sorted((round(b.x0), round(b.x1)) for b in bars if b.y0 > 0.5)  # rank 0 is the upper row
    assert top[0] == (0, 1) and len(top) == 6, f"rank 0 starts with F0 at t = 0..1: {top}"
    assert [t.get_text() for t in ax.texts].count("0") == 4, "micro-batch 0: F and B on both ranks"
