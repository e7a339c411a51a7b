"""Lab 05's grader can fail: planted bugs in copies of the reference solution lose their task's points.

tests/labs/test_labs.py proves that the solution scores full marks and the starter nothing. Here each case
copies solutions/lab05_pipeline/pipeline_parallel.py, plants one mistake a learner makes with a
pipeline schedule — a warm-up off by one, backwards out of order, a message on the wrong side of its
compute, interleaved chunks in the wrong order — and requires the checks of its task to fail (with
the checks they need passing, so the blame lands on that task) and the other tasks' checks to pass.
A few cases pin the feedback's words: one notation for both actions, no blame on tasks that pass.
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.grade import _run_check
from course_lib.grading.labs import lab05_pipeline as lab05

pytestmark = pytest.mark.slow  # planted bugs: each mistake graded in a copy of the reference solution

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "lab05_pipeline" / "pipeline_parallel.py"

TASK_1 = {lab05.check_1f1b_valid, lab05.check_1f1b_bubble, lab05.check_1f1b_in_flight}
TASK_2_ON_PAPER = {lab05.check_messages_pair_up, lab05.check_messages_adjacent}
TASK_3_ON_PAPER = {lab05.check_interleaved_lists}

SEND_F_AFTER = (
    "        out.append(a)\n        if a.op == F and next_remote:\n            out.append(Action(SEND_F, i, s))\n"
)
RECV_B_BEFORE = (
    "        if a.op == B and next_remote:\n            out.append(Action(RECV_B, i, s))\n        out.append(a)\n"
)

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    # ---- Task 1: the 1F1B order
    "warmup_off_by_one": (
        [("warmup = min(p - rank - 1, m)", "warmup = min(p - rank, m)")],
        {lab05.check_1f1b_in_flight},
        {lab05.check_1f1b_valid, *TASK_2_ON_PAPER, *TASK_3_ON_PAPER},
    ),
    "warmup_p_minus_1_on_every_rank": (
        [("warmup = min(p - rank - 1, m)", "warmup = min(p - 1, m)")],
        {lab05.check_1f1b_bubble, lab05.check_1f1b_in_flight},
        {lab05.check_1f1b_valid, *TASK_2_ON_PAPER, *TASK_3_ON_PAPER},
    ),
    "steady_backward_before_forward": (
        [
            (
                "order += [Action(F, warmup + i, rank), Action(B, i, rank)]",
                "order += [Action(B, i, rank), Action(F, warmup + i, rank)]",
            )
        ],
        TASK_1,
        {*TASK_2_ON_PAPER, *TASK_3_ON_PAPER, lab05.check_interleaved_step},  # Task 3's step: not Task 1's code
    ),
    "cooldown_backwards_reversed": (
        [
            (
                "return order + [Action(B, i, rank) for i in range(m - warmup, m)]",
                "return order + [Action(B, i, rank) for i in reversed(range(m - warmup, m))]",
            )
        ],
        {lab05.check_1f1b_bubble},
        {lab05.check_1f1b_valid, lab05.check_1f1b_in_flight, *TASK_2_ON_PAPER, *TASK_3_ON_PAPER},
    ),
    # ---- Task 2: the messages
    "send_before_its_compute": (
        [
            (
                SEND_F_AFTER,
                "        if a.op == F and next_remote:\n            out.append(Action(SEND_F, i, s))\n        out.append(a)\n",
            )
        ],
        {lab05.check_messages_adjacent, lab05.check_1f1b_step},  # the step: on paper, before any rank starts
        {*TASK_1, *TASK_3_ON_PAPER},
    ),
    "receive_after_its_compute": (
        [
            (
                RECV_B_BEFORE,
                "        out.append(a)\n        if a.op == B and next_remote:\n            out.append(Action(RECV_B, i, s))\n",
            )
        ],
        {lab05.check_messages_adjacent, lab05.check_1f1b_step},
        {*TASK_1, *TASK_3_ON_PAPER},
    ),
    "messages_between_stages_of_one_rank": (
        [
            ("prev_remote = s > 0 and placement[s - 1] != rank", "prev_remote = s > 0"),
            ("next_remote = s < n - 1 and placement[s + 1] != rank", "next_remote = s < n - 1"),
        ],
        {lab05.check_messages_adjacent},
        {*TASK_1, *TASK_3_ON_PAPER},
    ),
    "gradient_sent_to_the_next_stage": (
        [
            (
                "if a.op == B and prev_remote:\n            out.append(Action(SEND_B",
                "if a.op == B and next_remote:\n            out.append(Action(SEND_B",
            )
        ],
        {*TASK_2_ON_PAPER, lab05.check_1f1b_step},
        {*TASK_1, *TASK_3_ON_PAPER},
    ),
    # ---- Task 3: the interleaved order
    "backward_chunks_in_forward_order": (
        [
            (
                "return Action(B, microbatch(k), (v - 1 - (k // p) % v) * p + rank)",
                "return Action(B, microbatch(k), ((k // p) % v) * p + rank)",
            )
        ],
        {lab05.check_interleaved_lists, lab05.check_interleaved_step},
        {*TASK_1, *TASK_2_ON_PAPER},
    ),
    "interleaved_warmup_without_the_2": (
        [
            (
                "warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)",
                "warmup = min((p - rank - 1) + (v - 1) * p, total)",
            )
        ],
        {lab05.check_interleaved_lists},
        {*TASK_1, *TASK_2_ON_PAPER, lab05.check_1f1b_step},  # Task 2's step: not Task 3's code
    ),
    "microbatch_groups_of_v_not_p": (
        [("return (k // (p * v)) * p + k % p", "return (k // (p * v)) * v + k % v")],
        {lab05.check_interleaved_lists},
        {*TASK_1, *TASK_2_ON_PAPER},
    ),
}


def _planted(bug: str, tmp_path: Path):
    text = SOLUTION.read_text()
    for old, new in BUGS[bug][0]:
        text = text.replace(old, new)
    (tmp_path / SOLUTION.name).write_text(text)
    return lab05.adapter(tmp_path)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab05, tmp_path)


def test_a_backward_before_its_forward_names_both_in_one_notation(tmp_path):
    passed, feedback, _ = _run_check(lab05.check_1f1b_valid, _planted("steady_backward_before_forward", tmp_path))
    assert not passed and "B0@s1 comes before the forward F0@s1" in feedback, feedback


def test_wrong_interleaved_chunks_say_what_is_wrong_and_blame_no_other_task(tmp_path):
    impl = _planted("backward_chunks_in_forward_order", tmp_path)
    passed, feedback, _ = _run_check(lab05.check_interleaved_step, impl)
    assert not passed and "the chunk of the k-th forward and backward" in feedback, feedback
    assert "Task 1" not in feedback and "Task 2" not in feedback, feedback


def test_the_1f1b_step_runs_at_three_ranks_too(tmp_path):
    """Backwards of the cool-down in reverse order change the gradients' summation order only where a
    rank's cool-down holds two backwards or more: at p = 3 (rank 0), never at p = 2."""
    assert {p for p, _ in lab05.STEP_CASES[1]} >= {2, 3}
    passed, feedback, _ = _run_check(lab05.check_1f1b_step, _planted("cooldown_backwards_reversed", tmp_path))
    assert not passed and "p=3" in feedback and "gradient" in feedback, feedback
