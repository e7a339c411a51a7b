"""Lab 02's grader can fail: planted bugs in copies of the reference solution lose their task's points.

tests/labs/test_labs.py proves that the solution scores full marks and the starter only the setup point. Here
each case copies solutions/lab02_ddp/ddp.py, plants one mistake a learner makes with a bucketed DDP,
and requires the check of its task to fail — and a check that does not depend on that code to pass.
Two classes the whole-world checks never saw: a data-parallel group that is not the world (a src,
a group= or a world size taken from the default group), and no_sync as a context manager (an
exception inside the block, nested blocks).
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.labs import lab02_ddp as lab02

pytestmark = pytest.mark.slow  # planted bugs: each mistake graded in a copy of the reference solution

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "lab02_ddp" / "ddp.py"

NO_SYNC = (
    "        previous, self.require_sync = self.require_sync, False\n"
    "        try:\n"
    "            yield\n"
    "        finally:\n"
    "            self.require_sync = previous\n"
)

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    "broadcast_from_global_rank_0": (  # right for the world, not for the group {2, 3}
        [("    src = dist.get_global_rank(group, 0) if group is not None else 0\n", "    src = 0\n")],
        {lab02.check_broadcast},
        {lab02.check_plan_rule},
    ),
    "broadcast_over_the_world": (  # group rank 0's global rank, but every rank of the world joins
        [
            (
                "        dist.broadcast(t.data, src=src, group=group)\n",
                "        dist.broadcast(t.data, src=src)\n",
            )
        ],
        {lab02.check_broadcast},
        {lab02.check_plan_rule},
    ),
    "all_reduce_over_the_world": (
        [
            (
                "nxt.work = dist.all_reduce(nxt.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)",
                "nxt.work = dist.all_reduce(nxt.buffer, op=dist.ReduceOp.SUM, async_op=True)",
            )
        ],
        {lab02.check_gradients},
        {lab02.check_plan_rule},
    ),
    "averages_by_the_world_size": (
        [
            (
                "torch.mul(param.grad, 1.0 / self.world_size, out=bucket.views[i])",
                "torch.mul(param.grad, 1.0 / dist.get_world_size(), out=bucket.views[i])",
            )
        ],
        {lab02.check_gradients},
        {lab02.check_plan_rule},
    ),
    "no_sync_restores_without_finally": (  # an exception inside the block leaves sync off for good
        [
            (
                NO_SYNC,
                "        previous, self.require_sync = self.require_sync, False\n        yield\n        self.require_sync = previous\n",
            )
        ],
        {lab02.check_no_sync_as_context},
        {lab02.check_plan_rule},
    ),
    "no_sync_restores_true_not_the_previous_value": (  # the inner exit of nested blocks turns sync back on
        [
            (
                NO_SYNC,
                "        self.require_sync = False\n        try:\n            yield\n        finally:\n            self.require_sync = True\n",
            )
        ],
        {lab02.check_no_sync_as_context},
        {lab02.check_plan_rule},
    ),
    "no_sync_swallows_the_exception": (  # restores the state, and the caller never hears of the error
        [
            (
                NO_SYNC,
                "        previous, self.require_sync = self.require_sync, False\n"
                "        try:\n"
                "            yield\n"
                "        except Exception:\n"
                "            pass\n"
                "        self.require_sync = previous\n",
            )
        ],
        {lab02.check_no_sync_as_context},
        {lab02.check_plan_rule},
    ),
    "waits_inside_the_hook": (  # correct gradients, no overlap
        [
            (
                "async_op=True)\n            self._next_bucket += 1\n",
                "async_op=True)\n            nxt.work.wait()\n            self._next_bucket += 1\n",
            )
        ],
        {lab02.check_overlap},
        {lab02.check_plan_rule},
    ),
    "buckets_in_registration_order": (  # the first layer's gradients are the last to arrive
        [("    for i in reversed(range(len(nbytes))):\n", "    for i in range(len(nbytes)):\n")],
        {lab02.check_plan_rule, lab02.check_bucket_order},
        {lab02.check_no_sync_as_context},
    ),
    "no_sync_forgets_to_switch_sync_off": (
        [
            (
                NO_SYNC,
                NO_SYNC.replace(
                    "previous, self.require_sync = self.require_sync, False", "previous = self.require_sync"
                ),
            )
        ],
        {lab02.check_no_sync},
        {lab02.check_plan_rule},
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab02, tmp_path)


def test_every_check_catches_a_planted_bug():
    caught = set().union(*(must_fail for _, must_fail, _ in BUGS.values()))
    graded = {task.check for task in lab02.TASKS if not task.setup}
    missing = sorted(c.__name__ for c in graded - caught)
    assert not missing, f"no planted bug shows that these checks can fail: {missing}"
