"""Lab 09's grader can fail: planted bugs in copies of the reference solution lose their task's points.

tests/test_labs.py proves that the solution scores full marks and the starter nothing. Here each case
copies solutions/lab09_kv_cache/paged_cache.py, plants one mistake a learner makes with a paged cache,
and requires the check of its task to fail — and the checks that do not depend on that code to pass.
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.labs import lab09_kv_cache as lab09

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "lab09_kv_cache" / "paged_cache.py"

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    "evicts_the_most_recently_freed": (
        [("block, _ = self.free.popitem(last=False)", "block, _ = self.free.popitem(last=True)")],
        {lab09.check_pool},
        {lab09.check_hash, lab09.check_paged_read},
    ),
    "hit_leaves_the_block_in_the_free_list": (
        [("del self.free[block]  # back in use: no longer evictable", "pass")],
        {lab09.check_pool, lab09.check_random_stream},
        {lab09.check_hash, lab09.check_paged_read},
    ),
    "hash_not_chained": (
        [('digest = hashlib.sha256(parent or b"root")', 'digest = hashlib.sha256(b"root")')],
        {lab09.check_hash},
        {lab09.check_pool, lab09.check_block_table, lab09.check_paged_read},
    ),
    "no_copy_on_write": (
        [
            (
                "        bs, first = self.block_size, seq.num_computed // self.block_size\n"
                "        if first < len(seq.blocks) and self.pool.ref_count[seq.blocks[first]] > 1:",
                "        bs, first = self.block_size, seq.num_computed // self.block_size\n        if False:",
            )
        ],
        {lab09.check_block_table, lab09.check_random_stream},
        {lab09.check_pool, lab09.check_prefix_sharing, lab09.check_paged_read},
    ),
    "slot_forgets_the_block_size": (
        [
            (
                "slots[s] = blocks * block_size + positions[s] % block_size",
                "slots[s] = blocks + positions[s] % block_size",
            )
        ],
        {lab09.check_block_table},
        {lab09.check_pool, lab09.check_paged_read},
    ),
    "read_pads_at_the_front": (
        [
            (
                "rows = [list(table) + [0] * (width - len(table)) for table in block_tables]",
                "rows = [[0] * (width - len(table)) + list(table) for table in block_tables]",
            )
        ],
        {lab09.check_paged_read},
        {lab09.check_pool, lab09.check_hash},
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab09, tmp_path)
