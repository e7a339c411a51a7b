"""Lab 11's checks can fail: each catches a planted bug in a copy of the reference solution.

tests/labs/test_labs.py proves that the solution scores full marks and the starter nothing. Here each case
copies solutions/lab11_fault_tolerance/resilient.py, plants one mistake a learner makes when writing a
fault-tolerant loop, and requires the check of its task to fail (with the checks it needs passing, so
the blame lands on that task) — and a check that does not depend on that code to pass. Every check of
the grader appears in some case's "must fail" set (test_every_check_catches_a_planted_bug). Besides the
attacks' classic targets, the cases cover what no attack on the loop observes: state the loop never
exercises (Python's and NumPy's generators, the schedule on a skipped step, the guard at exactly its
history length) and the durability order of the commit (fsyncs and renames). Some cases also pin the
feedback's words (FEEDBACK), and the contract of ``summary`` is tested on its own at the end.
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.grade import _run_check
from course_lib.grading.labs import _lab11_loop as loop
from course_lib.grading.labs import lab11_fault_tolerance as lab11

pytestmark = pytest.mark.slow  # planted bugs: each mistake graded in a copy of the reference solution

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "lab11_fault_tolerance" / "resilient.py"
MANIFEST_WRITE = """        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())}
        partial = tmp / (MANIFEST + ".partial")
        with open(partial, "w") as f:
            json.dump({"step": step, "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(partial, tmp / MANIFEST)
        fsync_dir(tmp)
"""
RESAVE = """        if final.exists():  # this step saved before (a run resumed from an older checkpoint)
            old = root / f".tmp-old-{final.name}"
            os.rename(final, old)  # aside first, so that one of the two is always committed
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
"""

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    # ---- Task 1: the commit
    "a_directory_named_step_is_taken_for_a_checkpoint": (  # writes in place and trusts the name
        [
            ('    tmp = root / f".tmp-{final.name}"\n', "    tmp = final  # no temporary directory\n"),
            ("if final.exists():", "if tmp != final and final.exists():"),
            ("            verify_checkpoint(path)\n        except", "            pass\n        except"),
        ],
        {lab11.check_killed_save, lab11.check_commit},
        {lab11.check_guard},
    ),
    "manifest_checks_sizes_only": (
        [('        if sha256_file(file) != want["sha256"]:', "        if False:")],
        {lab11.check_damaged_shards},
        {lab11.check_guard},
    ),
    "restarted_save_trips_on_the_dead_save_s_leftovers": (  # tmp.mkdir() where the killed save left its folder
        [
            (
                "        shutil.rmtree(tmp, ignore_errors=True)  # the remains of an earlier save of this step that died\n",
                "",
            )
        ],
        {lab11.check_killed_save},
        {lab11.check_guard},
    ),
    "saving_a_step_again_renames_onto_it": (  # os.rename onto the existing (damaged) step_00000006
        [(RESAVE, "        os.rename(tmp, final)\n")],
        {lab11.check_damaged_shards, lab11.check_resume_past_damage},
        {lab11.check_guard},
    ),
    "manifest_written_after_the_rename": (  # durability order: a crash after the rename leaves no manifest
        [
            (MANIFEST_WRITE, ""),
            ("        fsync_dir(root)\n", "        fsync_dir(root)\n" + MANIFEST_WRITE.replace("tmp", "final")),
        ],
        {lab11.check_durable_commit},
        {lab11.check_commit},
    ),
    "manifest_not_fsynced": (
        [("            f.flush()\n            os.fsync(f.fileno())\n", "")],
        {lab11.check_durable_commit},
        {lab11.check_guard},
    ),
    "root_not_fsynced_after_the_rename": (
        [("        fsync_dir(root)\n", "")],
        {lab11.check_durable_commit},
        {lab11.check_guard},
    ),
    # ---- Task 2: capture and restore
    "torch_random_state_not_restored": (
        [('    torch.set_rng_state(loop["rng"]["torch"])\n', "")],
        {lab11.check_restore},
        {lab11.check_guard},
    ),
    "python_random_state_not_restored": (  # the lab's loop never draws from it: no attack on train sees this
        [('    random.setstate(loop["rng"]["python"])\n', "")],
        {lab11.check_restore},
        {lab11.check_guard},
    ),
    "numpy_random_state_not_restored": (  # nor this one
        [('    np.random.set_state(loop["rng"]["numpy"])\n', "")],
        {lab11.check_restore_on_one_rank},
        {lab11.check_guard},
    ),
    "optimizer_state_not_restored": (  # DCP fills AdamW's moments in place: what is lost is its param_groups
        [
            (
                'set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])',
                'model.load_state_dict(state["model"])',
            )
        ],
        {lab11.check_restore},
        {lab11.check_guard},
    ),
    "scheduler_not_restored": (
        [('    scheduler.load_state_dict(loop["scheduler"])\n', "")],
        {lab11.check_restore_on_one_rank},
        {lab11.check_guard},
    ),
    "restore_trusts_the_checkpoint": (
        [("    verify_checkpoint(path)\n    state = capture(", "    state = capture(")],
        {lab11.check_restore},
        {lab11.check_guard},
    ),
    # ---- Task 3: the guard
    "guard_lets_nan_through": (
        [("        spike = not math.isfinite(loss) or (\n", "        spike = (\n")],
        {lab11.check_guard},
        {lab11.check_commit},
    ),
    "guard_judges_one_loss_late": (  # at exactly min_history losses it does not judge yet
        [("len(self.history) >= self.min_history and", "len(self.history) > self.min_history and")],
        {lab11.check_guard},
        set(),
    ),
    "guard_skips_a_loss_at_the_threshold": (
        [("loss > self.factor * statistics.median", "loss >= self.factor * statistics.median")],
        {lab11.check_guard},
        set(),
    ),
    # ---- Task 4: deterministic mode
    "deterministic_mode_forgets_torch": (
        [("    torch.manual_seed(seed)  # and every CUDA device's generator\n", "")],
        {lab11.check_deterministic_mode},
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
        {lab11.check_guard},
    ),
    # ---- Task 5: the loop
    "resume_reads_the_data_from_the_start": (
        [("    batches = batches_from(step, rank, world)\n", "    batches = batches_from(0, rank, world)\n")],
        {lab11.check_kill_and_resume, lab11.check_resume_on_one_rank},
        {lab11.check_guard},
    ),
    "guard_decides_on_its_own_rank_s_loss": (  # rank 0 steps, rank 1 skips: their collectives no longer pair up
        [("        if guard.check(mean.item()):", "        if guard.check(loss.item()):")],
        {lab11.check_nan_and_spike},
        {lab11.check_guard},
    ),
    "schedule_advances_on_a_skipped_step": (
        [
            (
                "            scheduler.step()\n            optimizer_steps += 1\n",
                "            optimizer_steps += 1\n        scheduler.step()  # every step\n",
            )
        ],
        {lab11.check_nan_and_spike},
        {lab11.check_guard},
    ),
    "losses_keyed_by_the_step_before": (
        [
            (
                "        step += 1\n        losses[step] = mean.item()\n",
                "        losses[step] = mean.item()\n        step += 1\n",
            )
        ],
        {lab11.check_two_runs},
        {lab11.check_guard},
    ),
}
FEEDBACK = {  # bug: (check, words its feedback must hold)
    "torch_random_state_not_restored": (lab11.check_restore, "torch's random state differs"),
    "saving_a_step_again_renames_onto_it": (lab11.check_damaged_shards, "move the old one aside"),
    "manifest_written_after_the_rename": (lab11.check_durable_commit, "before MANIFEST.json was in it"),
    "guard_decides_on_its_own_rank_s_loss": (lab11.check_nan_and_spike, "the ranks called different collectives"),
    "schedule_advances_on_a_skipped_step": (lab11.check_nan_and_spike, "must not advance the schedule"),
    "losses_keyed_by_the_step_before": (lab11.check_two_runs, "your losses are keyed {0..7}; expected {1..8}"),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab11, tmp_path)
    if bug in FEEDBACK:
        check, words = FEEDBACK[bug]
        passed, feedback, _ = _run_check(check, lab11.adapter(tmp_path))
        assert not passed and words in feedback, f"{bug}: {check.__name__}'s feedback lacks {words!r}: {feedback}"


def test_every_check_catches_a_planted_bug():
    caught = set().union(*(must_fail for _, must_fail, _ in BUGS.values()))
    graded = {task.check for task in lab11.TASKS if not task.setup}
    missing = sorted(c.__name__ for c in graded - caught)
    assert not missing, f"no planted bug shows that these checks can fail: {missing}"


def test_an_unwritten_loop_is_not_blamed_on_collectives(tmp_path):
    """A train that raises NotImplementedError fails the NaN attack as not implemented, not with the
    hint meant for ranks that called different collectives."""
    text = SOLUTION.read_text()
    start = text.index("    if resume:\n        path = latest_checkpoint(root)")
    end = text.index("    return summary(model, optimizer, scheduler")
    (tmp_path / SOLUTION.name).write_text(
        text[:start] + '    raise NotImplementedError("Task 5: the loop")\n' + text[end:]
    )
    passed, feedback, _ = _run_check(lab11.check_nan_and_spike, lab11.adapter(tmp_path))
    assert not passed and "not implemented yet" in feedback and "collectives" not in feedback, feedback


def test_summary_contract_says_what_is_expected():
    """losses keyed 0..n-1, resumed_from an int, a full path: what the feedback says (no run needed)."""
    with pytest.raises(AssertionError, match=r"your losses are keyed \{0\.\.11\}; expected \{1\.\.12\}"):
        loop._check_contract({"losses": dict.fromkeys(range(12), 1.0), "resumed_from": None}, 12, resumed=False)
    with pytest.raises(AssertionError, match="a str such as 'step_00000006'"):
        loop.resumed_step({"resumed_from": 6})
    assert loop.resumed_step({"resumed_from": "/runs/ckpt/step_00000006"}) == 6  # a full path: its name counts
    assert loop.resumed_step({"resumed_from": Path("step_00000003")}) == 3
    assert loop.resumed_step({"resumed_from": None}) == 0
    resumed = {"losses": {s: 1.0 for s in range(7, 13)}, "resumed_from": "step_00000006"}
    loop._check_contract(resumed, 12, resumed=True)  # a resumed run logs the steps it did
