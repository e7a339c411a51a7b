"""Lab 06's grader can fail: planted bugs in copies of the reference solution lose their task's points.

tests/labs/test_labs.py proves that the solution scores full marks and the starter nothing. Here each case
copies solutions/lab06_sequence_parallel/sequence_parallel.py, plants one mistake a learner makes with
ring attention, and requires the check of its task to fail — and the checks that do not depend on that
code to pass. The class the graders once let through: a ring without the overlap it exists for (the
next K/V block waited for before the block in hand is computed, or sent with blocking calls), whose
numbers and bytes are all right.
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.labs import lab06_sequence_parallel as lab06

pytestmark = pytest.mark.slow  # planted bugs: each mistake graded in a copy of the reference solution

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "lab06_sequence_parallel" / "sequence_parallel.py"

FORWARD_EXCHANGE = """        if step < n - 1:  # the next block travels while this one is computed on
            nk, nv = torch.empty_like(k), torch.empty_like(v)
            works = exchange([(k.contiguous(), right), (v.contiguous(), right)], [(nk, left), (nv, left)], group)
"""
BACKWARD_EXCHANGE = """        if step < n - 1:
            nk, nv = torch.empty_like(k), torch.empty_like(v)
            works = exchange([(k.contiguous(), right), (v.contiguous(), right)], [(nk, left), (nv, left)], group)
"""
WAIT = """            for w in works:
                w.wait()
"""
FORWARD_WAIT = """merge_partials(out[..., rows, :], lse[..., rows], o, block_lse)
        if step < n - 1:
            for w in works:
                w.wait()
"""
BACKWARD_WAIT = """            dk, dv = rk, rv
        if step < n - 1:
            for w in works:
                w.wait()
"""

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    # overlap: the numbers and the bytes are right, the transfer is not hidden behind the compute
    "forward_waits_before_computing": (
        [
            (FORWARD_EXCHANGE, FORWARD_EXCHANGE + WAIT),
            (
                FORWARD_WAIT,
                "merge_partials(out[..., rows, :], lse[..., rows], o, block_lse)\n        if step < n - 1:\n",
            ),
        ],
        {lab06.check_ring_forward_overlap},
        {lab06.check_ring_forward, lab06.check_ring_forward_bytes, lab06.check_ring_backward_overlap},
    ),
    "forward_isend_then_blocking_recv": (
        [
            (
                "            works = exchange([(k.contiguous(), right), (v.contiguous(), right)], [(nk, left), (nv, left)], group)\n"
                "        if src == rank:\n"
                "            rows, keys, causal = slice(0, length), slice(0, length), True\n"
                "        elif src < rank:\n"
                "            rows, keys, causal = slice(0, length), slice(0, c), False\n"
                "        else:\n"
                "            rows, keys, causal = slice(c, length), slice(0, length), False\n"
                "        o, block_lse",
                "            works = [dist.isend(k.contiguous(), right), dist.isend(v.contiguous(), right)]\n"
                "            dist.recv(nk, left)\n"
                "            dist.recv(nv, left)\n"
                "        if src == rank:\n"
                "            rows, keys, causal = slice(0, length), slice(0, length), True\n"
                "        elif src < rank:\n"
                "            rows, keys, causal = slice(0, length), slice(0, c), False\n"
                "        else:\n"
                "            rows, keys, causal = slice(c, length), slice(0, length), False\n"
                "        o, block_lse",
            )
        ],
        {lab06.check_ring_forward_overlap},
        {lab06.check_ring_forward_bytes},
    ),
    "backward_waits_for_kv_before_computing": (
        [
            (BACKWARD_EXCHANGE, BACKWARD_EXCHANGE + WAIT),
            (BACKWARD_WAIT, "            dk, dv = rk, rv\n        if step < n - 1:\n"),
        ],
        {lab06.check_ring_backward_overlap},
        {lab06.check_ring_backward, lab06.check_ring_forward_overlap},
    ),
    # classic: the late chunk's rows against an earlier rank's block
    "later_block_meets_the_early_rows": (
        [
            (
                "            rows, keys, causal = slice(c, length), slice(0, length), False\n        o, block_lse",
                "            rows, keys, causal = slice(0, c), slice(0, length), False\n        o, block_lse",
            )
        ],
        {lab06.check_ring_forward},
        {lab06.check_merge, lab06.check_ring_forward_overlap},
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab06, tmp_path)
