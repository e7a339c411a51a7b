"""Lab 10's checks can fail: each catches a planted bug in a copy of the reference solution.

tests/test_labs.py proves that the solution scores full marks and the starter only the setup point. Here
each case copies solutions/lab10_capstone/capstone.py, plants one mistake a learner makes when composing
DP × TP × PP or predicting its cost, and requires the check of that task to fail — and a check that
does not depend on that code to pass. Every graded check appears in some case's "must fail" set
(test_every_check_catches_a_planted_bug). Last, the lab's run.py under ``accelerate launch`` at 8 ranks.
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.labs import lab10_capstone as lab10

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "lab10_capstone" / "capstone.py"

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    "dp_innermost_instead_of_tp": (  # a consistent mesh, so training still equals one process: the layout is wrong
        [
            (
                "    t = rank % layout.tp\n    s = rank // layout.tp % layout.pp\n    d = rank // (layout.tp * layout.pp)\n",
                "    d = rank % layout.dp\n    s = rank // layout.dp % layout.pp\n    t = rank // (layout.dp * layout.pp)\n",
            )
        ],
        {lab10.check_coordinates},
        {lab10.check_build, lab10.check_refusals},
    ),
    "batch_check_forgets_the_micro_batches": (
        [("    if global_batch % (layout.dp * layout.m):", "    if global_batch % layout.dp:")],
        {lab10.check_refusals},
        {lab10.check_coordinates},
    ),
    "output_layer_left_dense": (  # full-vocabulary logits handed to the vocab-parallel loss
        [("        stage.output = ColumnParallelLinear.from_dense(stage.output, tp)\n", "        pass\n")],
        {lab10.check_build},
        {lab10.check_coordinates},
    ),
    "every_replica_takes_the_first_rows": (
        [
            (
                "    x, y = tokens[d * rows : (d + 1) * rows], targets[d * rows : (d + 1) * rows]",
                "    x, y = tokens[:rows], targets[:rows]",
            )
        ],
        {lab10.check_training},
        {lab10.check_coordinates},
    ),
    "dp_gradients_summed_not_averaged": (
        [("        flat /= ly.dp\n", "")],
        {lab10.check_training},
        {lab10.check_refusals},
    ),
    "loss_summed_over_micro_batches": (
        [
            (
                "    loss = torch.tensor(sum(result.losses.values()) / ly.m, device=device)",
                "    loss = torch.tensor(sum(result.losses.values()), device=device)",
            )
        ],
        {lab10.check_training},
        {lab10.check_coordinates},
    ),
    "traffic_gives_the_last_stage_a_forward_send": (
        [("    p2p = ly.m * ((not last) + (not first))", "    p2p = ly.m * (1 + (not first))")],
        {lab10.check_traffic},
        {lab10.check_refusals},
    ),
    "cost_model_without_the_bubble": (
        [("        seconds = (ly.m + ly.pp - 1) / ly.m * flops", "        seconds = flops")],
        {lab10.check_pick},
        {lab10.check_coordinates},
    ),
    "pick_takes_a_layout_that_cannot_run": (
        [("            check_layout(layout, cfg, global_batch)\n", "            pass\n")],
        {lab10.check_pick},
        {lab10.check_refusals},
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab10, tmp_path)


def test_every_check_catches_a_planted_bug():
    caught = set().union(*(must_fail for _, must_fail, _ in BUGS.values()))
    graded = {task.check for task in lab10.TASKS if not task.setup}
    missing = sorted(c.__name__ for c in graded - caught)
    assert not missing, f"no planted bug shows that these checks can fail: {missing}"


def test_run_py_trains_like_one_process_under_accelerate_launch(accelerate_launch):
    """The lab's entry point, as its README runs it, at a layout the grader does not train (1×2×4, m=4)."""
    out = accelerate_launch(
        "solutions/lab10_capstone/run.py", "--dp", 1, "--tp", 2, "--pp", 4, "--m", 4, num_processes=8, timeout=300
    ).stdout
    assert "dp=1 tp=2 pp=4 m=4 on 8 ranks, backend gloo" in out, out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(line.endswith("equal within 1e-05: True") for line in steps), steps
    assert "final parameters equal one process's within 1e-06 on every rank: True" in out, out
    assert "every rank's traffic equals traffic(): True" in out, out
    assert "pick on 2-core CPU, gloo: dp=8 tp=1 pp=1 m=1" in out, out
    assert "pick on 2 nodes × 4 GPUs, 1 Gb/s: dp=2 tp=1 pp=4 m=4" in out, out
