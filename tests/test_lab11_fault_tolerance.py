"""Lab 11's attacks can fail: each catches a planted bug in a copy of the reference solution.

tests/test_labs.py proves that the solution scores full marks and the starter nothing. Here each case
copies solutions/lab11_fault_tolerance/resilient.py, plants one mistake a learner makes when writing a
fault-tolerant loop, and requires the attack that targets it to fail — and a check that does not
depend on that code to pass. Every attack of the grader appears in some case's "must fail" set
(test_every_attack_catches_a_planted_bug).
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.labs import lab11_fault_tolerance as lab11

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "lab11_fault_tolerance" / "resilient.py"

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    "resume_reads_the_data_from_the_start": (
        [("    batches = batches_from(step, rank, world)\n", "    batches = batches_from(0, rank, world)\n")],
        {lab11.check_kill_and_resume, lab11.check_killed_save, lab11.check_resume_on_one_rank},
        {lab11.check_guard, lab11.check_nan_and_spike},
    ),
    "random_state_not_restored": (
        [('    torch.set_rng_state(loop["rng"]["torch"])\n', "")],
        {lab11.check_kill_and_resume},
        {lab11.check_guard, lab11.check_resume_on_one_rank},
    ),
    "optimizer_state_not_restored": (
        [
            (
                'set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])',
                'model.load_state_dict(state["model"])',
            )
        ],
        # (DCP loads into the tensors get_state_dict hands out, which are the optimizer's own: the moments come
        # back even so; what set_state_dict also restores, the param groups, shows in the parameters)
        {lab11.check_kill_and_resume},
        {lab11.check_guard},
    ),
    "scheduler_not_restored": (
        [('    scheduler.load_state_dict(loop["scheduler"])\n', "")],
        {lab11.check_kill_and_resume, lab11.check_resume_on_one_rank},
        {lab11.check_guard},
    ),
    "a_directory_named_step_is_taken_for_a_checkpoint": (  # writes in place and trusts the name
        [
            ('    tmp = root / f".tmp-{final.name}"\n', "    tmp = final  # no temporary directory\n"),
            ("if final.exists():", "if tmp != final and final.exists():"),
            ("            verify_checkpoint(path)\n        except", "            pass\n        except"),
        ],
        {lab11.check_killed_save, lab11.check_commit, lab11.check_damaged_shards},
        {lab11.check_guard, lab11.check_kill_and_resume},
    ),
    "manifest_checks_sizes_only": (
        [('        if sha256_file(file) != want["sha256"]:', "        if False:")],
        {lab11.check_damaged_shards},
        {lab11.check_commit, lab11.check_guard},
    ),
    "guard_lets_nan_through": (
        [("        spike = not math.isfinite(loss) or (\n", "        spike = (\n")],
        {lab11.check_guard, lab11.check_nan_and_spike},
        {lab11.check_commit},
    ),
    "guard_decides_on_its_own_rank_s_loss": (  # rank 0 steps, rank 1 skips: their collectives no longer pair up
        [("        if guard.check(mean.item()):", "        if guard.check(loss.item()):")],
        {lab11.check_nan_and_spike},
        {lab11.check_guard},
    ),
    "deterministic_mode_forgets_torch": (
        [("    torch.manual_seed(seed)  # and every CUDA device's generator\n", "")],
        {lab11.check_deterministic_mode, lab11.check_two_runs},
        {lab11.check_guard},
    ),
    "sum_in_the_collective_s_order": (
        [
            (
                "    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]\n",
                "    dist.all_reduce(tensor)\n    return tensor\n",
            )
        ],
        {lab11.check_deterministic_mode},
        {lab11.check_guard, lab11.check_two_runs},
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab11, tmp_path)


def test_every_attack_catches_a_planted_bug():
    caught = set().union(*(must_fail for _, must_fail, _ in BUGS.values()))
    graded = {task.check for task in lab11.TASKS if not task.setup}
    missing = sorted(c.__name__ for c in graded - caught)
    assert not missing, f"no planted bug shows that these checks can fail: {missing}"
