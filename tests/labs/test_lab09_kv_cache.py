"""Lab 09's grader can fail: planted bugs in copies of the reference solution lose their task's points.

tests/labs/test_labs.py proves that the solution scores full marks and the starter nothing. Here each case
copies solutions/lab09_kv_cache/paged_cache.py, plants one mistake a learner makes with a paged cache,
and requires the checks of its task to fail — with the checks they need passing, so the blame lands
on that task — and the checks of the other tasks to pass: each task is graded on its own (the grader
runs course_lib's code for the other tasks), so a pool mistake never shows up as Task 3's, nor as a
raw KeyError or NoFreeBlocks in a later row. A few cases also pin the feedback's words: the invariant
it names, the exception type the lab's contract expects.
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.grade import _run_check
from course_lib.grading.labs import lab09_kv_cache as lab09

pytestmark = pytest.mark.slow  # planted bugs: each mistake graded in a copy of the reference solution

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "lab09_kv_cache" / "paged_cache.py"

TASK_1 = {lab09.check_pool, lab09.check_pool_invariants}
TASK_2 = {lab09.check_hash, lab09.check_prefix_sharing}
TASK_3 = {lab09.check_block_table, lab09.check_copy_on_write}
TASK_4 = {lab09.check_paged_read}
CHEAP_3 = {lab09.check_copy_on_write}  # check_block_table decodes with the model: run where Task 3 may leak


def others(*tasks):
    return set().union(*tasks)


BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    # ---- Task 1: the pool
    "evicts_the_most_recently_freed": (
        [("block, _ = self.free.popitem(last=False)", "block, _ = self.free.popitem(last=True)")],
        TASK_1,
        others(TASK_2, TASK_3, TASK_4),
    ),
    "allocate_peeks_without_taking": (
        [("block, _ = self.free.popitem(last=False)", "block = next(iter(self.free))")],
        TASK_1,
        others(TASK_2, CHEAP_3, TASK_4),
    ),
    "hit_leaves_the_block_in_the_free_list": (
        [("del self.free[block]  # back in use: no longer evictable", "pass")],
        TASK_1,
        others(TASK_2, CHEAP_3, TASK_4),
    ),
    "hit_sets_the_count_to_one": (
        [("self.ref_count[block] += 1\n        return block", "self.ref_count[block] = 1\n        return block")],
        {lab09.check_pool_invariants, lab09.check_pool},
        others(TASK_2, CHEAP_3, TASK_4),
    ),
    "release_never_frees": (
        [
            (
                "        self.ref_count[block] -= 1\n        if self.ref_count[block] == 0:\n"
                "            self.free[block] = None\n",
                "        self.ref_count[block] -= 1\n",
            )
        ],
        TASK_1,
        others(TASK_2, CHEAP_3, TASK_4),
    ),
    "eviction_keeps_the_hash": (
        [("            del self.cached[old]\n            self.hash_of[block] = None\n", "")],
        TASK_1,
        others(TASK_2, CHEAP_3, TASK_4),
    ),
    "eviction_keeps_hash_of": (
        [
            (
                "            del self.cached[old]\n            self.hash_of[block] = None\n",
                "            del self.cached[old]\n",
            )
        ],
        {lab09.check_pool_invariants},
        others(TASK_2, CHEAP_3, TASK_4),
    ),
    "double_release_ignored": (
        [
            (
                """raise RuntimeError(f"block {block} released while free: a sequence's blocks were freed twice")""",
                "return",
            )
        ],
        {lab09.check_pool},
        others(TASK_2, CHEAP_3, TASK_4),
    ),
    "double_release_raises_value_error": (
        [
            (
                'raise RuntimeError(f"block {block} released while free',
                'raise ValueError(f"block {block} released while free',
            )
        ],
        {lab09.check_pool},
        others(TASK_2, CHEAP_3, TASK_4),
    ),
    # ---- Task 2: prefix sharing
    "hash_not_chained": (
        [('digest = hashlib.sha256(parent or b"root")', 'digest = hashlib.sha256(b"root")')],
        {lab09.check_hash},
        others(TASK_1, TASK_3, TASK_4),
    ),
    "prefix_reuses_the_last_tokens_block": (
        [("for i in range((len(tokens) - 1) // block_size):", "for i in range(len(tokens) // block_size):")],
        {lab09.check_prefix_sharing},
        others(TASK_1, CHEAP_3, TASK_4),
    ),
    "prefix_lookup_not_chained": (
        [("        hashes.append(key)\n        parent = key\n", "        hashes.append(key)\n")],
        {lab09.check_prefix_sharing},
        others(TASK_1, CHEAP_3, TASK_4),
    ),
    "registered_hashes_not_chained": (
        [
            (
                "parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])",
                "parent = block_hash(None, tokens[i * block_size : (i + 1) * block_size])",
            )
        ],
        {lab09.check_prefix_sharing},
        others(TASK_1, CHEAP_3, TASK_4),
    ),
    "registers_the_block_being_filled": (
        [
            (
                "for i in range(len(hashes), num_computed // block_size):",
                "for i in range(len(hashes), -(-num_computed // block_size)):",
            )
        ],
        {lab09.check_prefix_sharing},
        others(TASK_1, CHEAP_3, TASK_4),
    ),
    # ---- Task 3: block tables
    "slot_forgets_the_block_size": (
        [
            (
                "slots[s] = blocks * block_size + positions[s] % block_size",
                "slots[s] = blocks + positions[s] % block_size",
            )
        ],
        {lab09.check_block_table},
        others(TASK_1, TASK_2, TASK_4),
    ),
    "table_one_block_too_many": (
        [("while len(blocks) * block_size < n_tokens:", "while len(blocks) * block_size <= n_tokens:")],
        {lab09.check_copy_on_write},
        others(TASK_1, TASK_2, TASK_4),
    ),
    "no_copy_on_write": (
        [("if first < len(blocks) and pool.ref_count[blocks[first]] > 1:", "if False:")],
        {lab09.check_copy_on_write},
        others(TASK_1, TASK_2, TASK_4),
    ),
    "copy_without_contents": (
        [("        for x in stores:\n            x[private] = x[shared]\n", "")],
        {lab09.check_copy_on_write},
        others(TASK_1, TASK_2, TASK_4),
    ),
    "copy_the_wrong_way": (
        [("x[private] = x[shared]", "x[shared] = x[private]")],
        {lab09.check_copy_on_write},
        others(TASK_1, TASK_2, TASK_4),
    ),
    "copy_keeps_the_shared_reference": (
        [("        pool.release(shared)\n", "")],
        {lab09.check_copy_on_write},
        others(TASK_1, TASK_2, TASK_4),
    ),
    "copies_blocks_held_alone": (
        [("pool.ref_count[blocks[first]] > 1", "pool.ref_count[blocks[first]] > 0")],
        {lab09.check_copy_on_write},
        others(TASK_1, TASK_2, TASK_4),
    ),
    "copies_the_last_block_not_the_next_tokens": (
        [
            (
                "    if first < len(blocks) and pool.ref_count[blocks[first]] > 1:\n"
                "        shared, private = blocks[first], pool.allocate()",
                "    if blocks and pool.ref_count[blocks[-1]] > 1:\n        shared, private = blocks[-1], pool.allocate()",
            ),
            ("blocks[first] = private", "blocks[-1] = private"),
        ],
        {lab09.check_copy_on_write},
        others(TASK_1, TASK_2, TASK_4),
    ),
    # ---- Task 4: the paged read
    "read_pads_at_the_front": (
        [
            (
                "rows = [list(table) + [0] * (width - len(table)) for table in block_tables]",
                "rows = [[0] * (width - len(table)) + list(table) for table in block_tables]",
            )
        ],
        TASK_4,
        others(TASK_1, TASK_2, TASK_3),
    ),
    "read_reshapes_without_transposing": (
        [
            (
                "return blocks.reshape(b, width * store.shape[1], heads, dim).transpose(1, 2)",
                "return blocks.reshape(b, heads, width * store.shape[1], dim)",
            )
        ],
        TASK_4,
        others(TASK_1, TASK_2, CHEAP_3),
    ),
}

FEEDBACK = {  # bug: (check, words its feedback must hold)
    "double_release_raises_value_error": (lab09.check_pool, "must raise RuntimeError, got ValueError"),
    "double_release_ignored": (lab09.check_pool, "must raise RuntimeError; it returned normally"),
    "release_never_frees": (lab09.check_pool_invariants, "count 0 but is not in the free list"),
    "allocate_peeks_without_taking": (lab09.check_pool_invariants, "in the free list with count 1"),
    "eviction_keeps_hash_of": (lab09.check_pool_invariants, "still carries a hash"),
    "hit_sets_the_count_to_one": (lab09.check_pool_invariants, "count is 1, expected 2"),
    "copy_without_contents": (lab09.check_copy_on_write, "must start with the contents of the shared block"),
    "copy_the_wrong_way": (lab09.check_copy_on_write, "changed the contents of the shared block"),
    "copy_keeps_the_shared_reference": (lab09.check_copy_on_write, "releases its reference to the shared block"),
    "copies_blocks_held_alone": (lab09.check_copy_on_write, "write it in place"),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab09, tmp_path)


@pytest.mark.parametrize("bug", sorted(FEEDBACK))
def test_the_feedback_names_the_broken_rule(bug, tmp_path):
    text = SOLUTION.read_text()
    for old, new in BUGS[bug][0]:
        text = text.replace(old, new)
    (tmp_path / SOLUTION.name).write_text(text)
    check, words = FEEDBACK[bug]
    passed, feedback, _ = _run_check(check, lab09.adapter(tmp_path))
    assert not passed and words in feedback, f"{bug}: {check.__name__} said {feedback!r}"
