"""Lab 03's grader can fail: planted bugs in copies of the reference solution lose their task's points.

tests/labs/test_labs.py proves that the solution scores full marks and the starter nothing. Here each case
copies solutions/lab03_zero/zero.py, plants one mistake a learner makes with ZeRO, and requires the
check of its task to fail — and the checks that do not depend on that code to pass. The classes the
graders once let through: gradient accumulation (two backwards per step), the communication of
ZeRO-1 and ZeRO-2 (an all-reduce where a reduce-scatter or an all-gather belongs: the same numbers,
more bytes), and an odd world size (padding and shard sizes that only work when N divides a unit).
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.labs import lab03_zero as lab03

pytestmark = pytest.mark.slow  # planted bugs: each mistake graded in a copy of the reference solution

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "lab03_zero" / "zero.py"

HOOK_COPY = """        flat = torch.zeros(u.padded, device=u.device)
        for p, view in u.views(flat):
            view.copy_(p.grad)
            p.grad = None
"""

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    # gradient accumulation: the hook's shard replaces what the earlier backward left
    "zero2_hook_overwrites_the_shard": (
        [("u.grad_shard.add_(shard)", "u.grad_shard.copy_(shard)")],
        {lab03.check_stage2_accumulates},
        {lab03.check_stage2_during_backward},
    ),
    "zero2_hook_rebinds_the_shard": (
        [("u.grad_shard.add_(shard)", "u.grad_shard = shard")],
        {lab03.check_stage2_accumulates},
        {lab03.check_stage2_bytes},
    ),
    # communication: the same numbers, but an all-reduce moves twice a reduce-scatter's bytes
    "zero1_all_reduce_then_slice": (
        [
            (
                "dist.reduce_scatter_single(grad, u.grad_full, group=self.group)",
                "dist.all_reduce(u.grad_full, group=self.group)\n"
                "                grad = shard_of(u.grad_full, self.rank, self.n)",
            )
        ],
        {lab03.check_stage1_comm},
        {lab03.check_stage1_three_ranks},  # the values are right: only the bytes are not
    ),
    "zero_all_gather_by_all_reduce": (
        [
            (
                "dist.all_gather_single(u.full, params, group=self.group)",
                "mine = params.clone()\n"
                "                u.full.zero_()\n"
                "                params.copy_(mine)\n"
                "                dist.all_reduce(u.full, group=self.group)",
            )
        ],
        {lab03.check_stage1_comm},
        {lab03.check_stage1_three_ranks},  # x + 0 is x: the values are right, the bytes are not
    ),
    "zero2_all_reduce_in_the_hook": (
        [
            (
                "dist.reduce_scatter_single(shard, flat, group=self.group)",
                "dist.all_reduce(flat, group=self.group)\n        shard = shard_of(flat, self.rank, self.n)",
            )
        ],
        {lab03.check_stage2_during_backward},
        {lab03.check_stage2_accumulates},
    ),
    # an odd world size: code that holds while 2 divides every unit (the course model's are multiples of 4)
    "zero2_hook_forgets_the_padding": (
        [
            (
                HOOK_COPY,
                "        flat = torch.cat([p.grad.flatten() for p in u.params])\n        for p in u.params:\n            p.grad = None\n",
            )
        ],
        {lab03.check_stage2_three_ranks},
        {lab03.check_stage2_accumulates},
    ),
    "zero1_gradient_shard_sized_by_numel": (
        [
            (
                "grad = torch.empty(u.padded // self.n, device=u.device)",
                "grad = torch.empty(u.numel // self.n, device=u.device)",
            )
        ],
        {lab03.check_stage1_three_ranks},
        {lab03.check_stage1_comm, lab03.check_stage2_three_ranks},
    ),
    "zero2_averages_over_two_ranks": (
        [("flat.mul_(1 / self.n)", "flat.mul_(0.5)")],
        {lab03.check_stage2_three_ranks},
        {lab03.check_stage2_accumulates},  # x·0.5 is x·(1/N) at 2 ranks
    ),
    # classic: ZeRO-3 leaves a unit gathered after its backward
    "zero3_keeps_units_gathered_after_backward": (
        [("        if self.stage == 3:\n            self._free(u)\n        # END SOLUTION", "        # END SOLUTION")],
        {lab03.check_stage3_bytes},
        {lab03.check_stage3_comm},
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab03, tmp_path)
