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
        f"{getattr(check, '__name__', check)} failed with a crash of the grader's own code, not a verdict: "
        f"{feedback}\n{details}"
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
    for check in sorted(must_fail, key=lambda c: getattr(c, "__name__", str(c))):
        assert fails(check, impl), f"{bug}: {getattr(check, '__name__', check)} must fail on this mistake, and passed"
        for need in needs.get(check, ()):  # the prerequisites pass: the grader blames this task
            need(impl)
    for check in sorted(must_pass, key=lambda c: getattr(c, "__name__", str(c))):
        check(impl)  # another task's check: raises (and fails the test) if the bug leaked into it
