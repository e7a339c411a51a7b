"""Lab 04's grader can fail: planted bugs in copies of the reference solution lose their task's points.

tests/labs/test_labs.py proves that the solution scores full marks and the starter only the setup point. Here
each case copies solutions/lab04_tensor_parallel/tensor_parallel.py, plants one mistake a learner makes
with Megatron's f, g and parallel layers, and requires the check of its task to fail — and a check
that does not depend on that code to pass. Most are of the class the whole-world checks never saw: a
tensor-parallel group that is not the world (a collective without ``group=``, a slice offset from the
global rank), graded on 4 ranks split into the groups {0, 1} and {2, 3}.
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.labs import lab04_tensor_parallel as lab04

pytestmark = pytest.mark.slow  # planted bugs: each mistake graded in a copy of the reference solution

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "lab04_tensor_parallel" / "tensor_parallel.py"

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    "f_backward_reduces_over_the_world": (
        [("        dist.all_reduce(grad, group=ctx.group)\n", "        dist.all_reduce(grad)\n")],
        {lab04.check_f_and_g},
        {lab04.check_cross_entropy},
    ),
    "g_forward_reduces_over_the_world": (
        [("        dist.all_reduce(out, group=group)\n", "        dist.all_reduce(out)\n")],
        {lab04.check_f_and_g},
        {lab04.check_cross_entropy},
    ),
    "embedding_offset_from_the_global_rank": (
        [
            (
                "        return cls(weight, dist.get_rank(group) * weight.shape[0], group)\n",
                "        return cls(weight, dist.get_rank() * weight.shape[0], group)\n",
            )
        ],
        {lab04.check_embedding},
        {lab04.check_cross_entropy},
    ),
    "cross_entropy_columns_from_the_global_rank": (
        [("        start = dist.get_rank(group) * per_rank\n", "        start = dist.get_rank() * per_rank\n")],
        {lab04.check_cross_entropy},
        {lab04.check_f_and_g},
    ),
    "cross_entropy_max_over_the_world": (  # the loss does not depend on m, but exp(z - m) underflows
        [
            (
                "        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)\n",
                "        dist.all_reduce(z_max, op=dist.ReduceOp.MAX)\n",
            )
        ],
        {lab04.check_cross_entropy, lab04.check_cross_entropy_collectives},
        {lab04.check_f_and_g},
    ),
    "g_reduces_its_input_in_place": (
        [
            (
                "        out = x.contiguous().clone()\n        dist.all_reduce(out, group=group)\n        return out\n",
                "        dist.all_reduce(x, group=group)\n        return x.view_as(x)\n",
            )
        ],
        {lab04.check_f_and_g},
        {lab04.check_cross_entropy},
    ),
    "cross_entropy_gradient_ignores_the_incoming_gradient": (
        [("        return grad * grad_loss.unsqueeze(-1), None, None\n", "        return grad, None, None\n")],
        {lab04.check_cross_entropy},
        {lab04.check_f_and_g},
    ),
    "column_layer_keeps_the_input_features": (  # slices the columns of linear.weight: the row layer's split
        [
            (
                "        return cls(my_slice(linear.weight, 0, group), group)\n",
                "        return cls(my_slice(linear.weight, 1, group), group)\n",
            )
        ],
        {lab04.check_linears, lab04.check_mlp},
        {lab04.check_cross_entropy},
    ),
    "row_layer_without_g": (  # partial products never summed: also no forward all-reduce
        [("        return g(F.linear(x, self.weight), self.group)\n", "        return F.linear(x, self.weight)\n")],
        {lab04.check_mlp_collectives},
        {lab04.check_cross_entropy},
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab04, tmp_path)


def test_every_check_catches_a_planted_bug():
    caught = set().union(*(must_fail for _, must_fail, _ in BUGS.values()))
    graded = {task.check for task in lab04.TASKS if not task.setup}
    missing = sorted(c.__name__ for c in graded - caught)
    assert not missing, f"no planted bug shows that these checks can fail: {missing}"
