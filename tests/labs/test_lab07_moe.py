"""Lab 07's grader can fail: planted bugs in copies of the reference solution lose their task's points.

tests/labs/test_labs.py proves that the solution scores full marks and the starter nothing. Here each case
copies solutions/lab07_moe/mixture_of_experts.py, plants one mistake a learner makes with a router or
expert parallelism, and requires the check of its task to fail — and the checks that do not depend on
that code to pass. The class the graders once let through: rounding that agrees with ⌈·⌉ on the
capacities the cases happened to have (fractions .0 and .5 only), and the order of first come, first
served.
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.labs import lab07_moe as lab07

pytestmark = pytest.mark.slow  # planted bugs: each mistake graded in a copy of the reference solution

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "lab07_moe" / "mixture_of_experts.py"

CEIL = "return math.ceil(capacity_factor * n_tokens * top_k / n_experts)"

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    # rounding: right on x.0, and round() on x.5 too (half to even: round(7.5) = 8)
    "capacity_rounds_to_nearest": (
        [(CEIL, "return round(capacity_factor * n_tokens * top_k / n_experts)")],
        {lab07.check_router_capacity},
        {lab07.check_router_topk, lab07.check_aux_loss},
    ),
    "capacity_truncates": (
        [(CEIL, "return int(capacity_factor * n_tokens * top_k / n_experts)")],
        {lab07.check_router_capacity},
        {lab07.check_router_topk},
    ),
    "capacity_one_more_than_the_floor": (
        [(CEIL, "return int(capacity_factor * n_tokens * top_k / n_experts) + 1")],
        {lab07.check_router_capacity},
        {lab07.check_router_topk},
    ),
    # first come, first served: every token's first choice served before any second choice (slot-major)
    "capacity_serves_first_choices_first": (
        [
            (
                "onehot = F.one_hot(experts.flatten(), self.n_experts)  # the assignments, in token order",
                "onehot = F.one_hot(experts.t().flatten(), self.n_experts)  # first choices first",
            ),
            ("kept = (position < cap).view_as(experts)", "kept = (position < cap).view(self.top_k, -1).t()"),
        ],
        {lab07.check_router_capacity},
        {lab07.check_router_topk},
    ),
    # classic: one more than the capacity kept
    "capacity_keeps_one_too_many": (
        [("kept = (position < cap).view_as(experts)", "kept = (position <= cap).view_as(experts)")],
        {lab07.check_router_capacity},
        {lab07.check_router_topk},
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab07, tmp_path)
