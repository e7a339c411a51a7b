"""The capstone harness (course_lib.experiments.lecture10.capstone_run) and its timeline (course_lib.plots.capstone): what
lecture 10 prints and asserts, on a shorter run of the same 2 x 2 x 2 layout.

Tolerances: lecture 10 derives them for 40 steps (loss 2e-5 relative: 256 token losses summed in
another order, 256·u; parameters 6e-5: lr·256·u per step, 40 steps); three steps stay inside them.
"""

from collections import Counter

import pytest

from course_lib.dist.trace import Span
from course_lib.experiments.lecture10.capstone_run import CAPSTONE, composed_vs_one_process
from course_lib.plots.capstone import mesh_timeline, predicted_vs_measured

LOSS_RTOL, PARAM_ATOL = 2e-5, 6e-5


def test_the_composed_run_follows_one_process_and_its_traced_step_has_the_composed_structure():
    run = composed_vs_one_process(CAPSTONE, steps=3, traced_step=1)
    assert run["reporting"] == CAPSTONE.dp * CAPSTONE.tp, "every rank of the last stage reports the loss"
    assert len(run["losses"]) == len(run["reference"]) == 3
    assert run["loss_rel_gap"] <= LOSS_RTOL, f"loss off by {run['loss_rel_gap']:.1e}: look at the micro-batch split"
    assert run["param_gap"] <= PARAM_ATOL, f"a parameter off by {run['param_gap']:.1e}: look at dense_state's joins"
    m, per_stage = CAPSTONE.m, 4 // CAPSTONE.pp
    for rank, (spans, where) in enumerate(zip(run["spans"], run["coords"])):
        assert rank == 4 * where["dp"] + 2 * where["pp"] + where["tp"], "the mesh orders dp, pp, tp (tp innermost)"
        first, last = where["pp"] == 0, where["pp"] == CAPSTONE.pp - 1
        comm = Counter((s.name, s.meta.get("group")) for s in spans if s.kind == "comm")
        assert comm[("all_reduce", "tp")] == m * (4 * per_stage + first + 4 * last), (rank, comm)
        # the pipeline posts each receive as an irecv, batched with its sends (parallel/pipeline/messages.py)
        assert comm[("isend", "pp")] == comm[("irecv", "pp")] == m, (rank, comm)
        assert comm[("all_reduce", "dp")] == 1 + last, (rank, comm)
        backward_end = max(s.end for s in spans if s.name == "B")
        assert next(s for s in spans if s.meta.get("group") == "dp").start >= backward_end, (
            f"rank {rank}: the dp reduction should start after the pipeline's last backward"
        )


def test_mesh_timeline_draws_a_labelled_row_per_rank():
    coords = [{"dp": 0, "pp": 0, "tp": t} for t in range(2)]
    spans = [
        [Span("F", "compute", 0.0, 1.0, {"mb": 0}), Span("all_reduce", "comm", 0.2, 0.3, {"group": "tp"})],
        [Span("B", "compute", 1.0, 3.0, {"mb": 0}), Span("all_reduce", "comm", 3.0, 3.5, {"group": "dp"})],
    ]
    ax = mesh_timeline(spans, coords, unit="s")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["rank 1  (dp 0, pp 0, tp 1)", "rank 0  (dp 0, pp 0, tp 0)"], "rank 0 on top"
    assert len(ax.collections) == 4, "one bar per span"
    assert ax.get_xlim()[1] >= 3.5
    with pytest.raises(ValueError, match="one coordinate dict per rank"):
        mesh_timeline(spans, coords[:1])


def test_predicted_vs_measured_puts_each_layout_at_its_two_times():
    ax = predicted_vs_measured(["a", "b"], [0.01, 0.02], [0.012, 0.018], [True, False])
    points = [tuple(c.get_offsets()[0]) for c in ax.collections[:2]]
    assert points == [(10.0, 12.0), (20.0, 18.0)], "x: predicted, y: measured, in ms"
    assert [t.get_text() for t in ax.texts] == ["a", "b"]
    assert ax.collections[0].get_facecolors().size == 0 or ax.collections[0].get_facecolors()[0][3] == 0, (
        "probes hollow"
    )
    with pytest.raises(ValueError, match="one name, prediction, measurement and flag per layout"):
        predicted_vs_measured(["a"], [0.01, 0.02], [0.012], [True])
