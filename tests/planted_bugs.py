"""The planted-bug harness the lab tests share: copy a lab's reference solution, plant one mistake, grade.

A grader that passed everything would still give the solution full marks and the starter nothing;
planting a learner's typical mistake and requiring the check of its task to fail — and the checks that
do not depend on that code to pass — shows each check can fail, and only where it should.

A failure must also read well: the checks the failing task needs (``Task.needs``) must pass, so the
grader blames the task with the bug and not one before it, and the feedback must be a verdict or a
line of the learner's file, never a bare exception from the grader's own code.
"""

from pathlib import Path

from course_lib.grading.grade import _run_check


def fails(check, impl) -> bool:
    """Whether ``check`` fails on ``impl`` with feedback a learner can act on (raises if the feedback is a bare crash)."""
    passed, feedback, details = _run_check(check, impl)
    if passed:
        return False
    assert feedback and "not in your files" not in feedback, (
        f"{_name(check)} failed with a crash of the grader's own code, not a verdict: {feedback}\n{details}"
    )
    return True


def grade_planted_bug(bug: str, bugs: dict, solution: Path, grader, tmp_path: Path) -> None:
    """Plant ``bugs[bug]`` (replacements, checks that must fail, checks that must pass) in a copy of
    ``solution`` and grade the copy with ``grader`` (its ``adapter(lab_dir)`` and ``TASKS``)."""
    replacements, must_fail, must_pass = bugs[bug]
    text = solution.read_text()
    for old, new in replacements:
        assert text.count(old) == 1, f"{bug}: the solution no longer says {old!r}: update the planted bug"
        text = text.replace(old, new)
    (tmp_path / solution.name).write_text(text)
    impl = grader.adapter(tmp_path)
    needs = {t.check: t.needs for t in grader.TASKS}
    for check in sorted(must_fail, key=_name):
        assert fails(check, impl), f"{bug}: {_name(check)} must fail on this mistake, and passed"
    # The failing checks' prerequisites pass, so the grader blames this task (each run once, with must_pass)
    prerequisites = {need for check in must_fail for need in needs.get(check, ())} - set(must_fail)
    for check in sorted(set(must_pass) | prerequisites, key=_name):
        check(impl)  # another task's check: raises (and fails the test) if the bug leaked into it


def _name(check) -> str:
    return getattr(check, "__name__", None) or str(check)
