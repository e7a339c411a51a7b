"""The grading engine: each task in its own process with its own timeout, feedback that teaches."""

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_lib.dist import device, launch
from course_lib.grading import grade
from course_lib.grading.adapter import Adapter
from course_lib.grading.expect import raises
from course_lib.grading.grade import (
    Result,
    Task,
    _run_check,
    blame_prerequisites,
    report,
    run_task,
    run_tasks,
    select,
)

ROOT = Path(__file__).resolve().parents[2]


def _passes(impl):
    assert impl.roles() == ["answer"], "the check receives the adapter it was given"


def _hangs(impl):
    while True:
        time.sleep(0.05)


def _rank_waits_forever():
    if dist.get_rank() == 1:
        dist.recv(torch.zeros(1, device=device()), src=0)  # rank 0 never sends


def _a_rank_hangs(impl):
    # Long enough for rank 0 to start and return on a loaded machine: the clock includes starting this
    # worker's fork server and unpickling the function (importing this test module, pytest with it),
    # which took more than 6 s once beside another worker's launches ("ranks [0, 1] timed out").
    launch(_rank_waits_forever, 2, timeout=15)


def _wrong(impl):
    assert 1 + 1 == 3, "look at the sum: 1 + 1 should be 3 here\nsecond line is not shown"


def _todo(impl):
    raise NotImplementedError("Task 2: the ring")


def _crashes(impl):
    {}["missing"]


@pytest.mark.launch_heavy  # fault injection: a check hangs or ends its worker
def test_a_hanging_submission_loses_its_points_and_grading_goes_on(tmp_path):
    lab = Adapter.of_file(tmp_path / "somewhere.py", ["answer"])
    tasks = [
        Task("hangs", 3, _hangs, timeout=2),
        Task("a rank hangs", 2, _a_rank_hangs, timeout=45),
        Task("fine", 1, _passes),
    ]
    start = time.monotonic()
    results = [run_task(t, lab) for t in tasks]
    assert time.monotonic() - start < 40, "each task's timeout must bound it"
    assert [r.passed for r in results] == [False, False, True], "the task after the hanging ones must still run"
    assert "timed out after 2 s" in results[0].feedback
    assert "ranks [1]" in results[1].feedback and "timed out" in results[1].feedback, results[1].feedback
    assert [r.earned for r in results] == [0, 0, 1]


def _kills_its_process(impl):
    os._exit(3)  # a submission that ends the interpreter: no exception, no traceback


@pytest.mark.launch_heavy  # fault injection: a check hangs or ends its worker
def test_one_worker_survives_a_hang_and_is_replaced_after_a_crash(tmp_path):
    """The checks of one grading share a worker (course_lib/grading/runner.py): a check that runs out of
    time is stopped by its timer and the worker goes on; a check that ends the worker's process costs
    its task, and the checks after it run in a new worker."""
    lab = Adapter.of_file(tmp_path / "somewhere.py", ["answer"])
    tasks = [
        Task("hangs", 3, _hangs, timeout=2),
        Task("fine after the hang", 1, _passes),
        Task("kills the worker", 2, _kills_its_process),
        Task("fine after the crash", 1, _passes),
    ]
    results = run_tasks(tasks, lab)
    assert [r.task.name for r in results] == [t.name for t in tasks]
    assert [r.passed for r in results] == [False, True, False, True], [(r.task.name, r.feedback) for r in results]
    assert "timed out after 2 s" in results[0].feedback, results[0].feedback
    assert "exited with code 3" in results[2].feedback, results[2].feedback


def test_feedback_is_one_line_that_says_what_to_look_at(tmp_path):
    got = {
        t.name: run_task(t, Adapter.of_file(tmp_path / "x.py", []))
        for t in (Task("wrong", 1, _wrong), Task("todo", 1, _todo), Task("crash", 1, _crashes))
    }
    assert got["wrong"].feedback == "look at the sum: 1 + 1 should be 3 here"
    assert got["todo"].feedback == "not implemented yet: Task 2: the ring"
    assert got["crash"].feedback.startswith("raised KeyError"), got["crash"].feedback


def test_report_table_shows_points_and_total(capsys):
    task = Task("Task 1: x", 2, _passes)
    report([Result(task, True), Result(Task("setup", 1, _passes, setup=True), False, "missing file")], "lab")
    out = capsys.readouterr().out
    assert "Task 1: x" in out and "2/2" in out and "0/1" in out and "missing file" in out and "2/3" in out


# ------------------------------------------------------------------ feedback a learner can act on

LEARNER = """
def index_of_first(blocks):
    return blocks[0]  # line 3: an empty list raises IndexError here


def checked(x):
    assert x > 0, "x must be positive"
    return x
"""


def _learner_file_raises(impl):
    impl["index_of_first"]([])


def _learner_assert(impl):
    impl["checked"](-1)


def _grader_verdict_with_brackets(impl):
    raise AssertionError("want [b, h, n, d], got (3, 12, 2, 3)")


def _gloo_error(impl):
    raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234")


def _fine(impl):
    pass


def _first_task(impl):
    raise AssertionError("the first task is wrong")


def _second_task(impl):
    raise AssertionError("the second task's own message, which would mislead")


def _needs_passing_prerequisite(impl):
    raise AssertionError("the third task's own mistake")


def test_brackets_in_feedback_survive_the_table(capsys):
    """rich reads '[...]' as markup: unescaped, '[b, h, n, d]' vanished and gloo's '[/…/pair.cc:537]' raised MarkupError."""
    tasks = [Task("Task 1: [shape]", 1, _grader_verdict_with_brackets), Task("Task 2: gloo", 1, _gloo_error)]
    results = [Result(tasks[0], False, "want [b, h, n, d], got (3, 12, 2, 3)")]
    results.append(
        Result(tasks[1], False, "rank 1 raised RuntimeError: [/x/gloo/pair.cc:537] Read error [127.0.0.1]:1")
    )
    report(results, "lab [x]")
    out = capsys.readouterr().out
    assert "want [b, h, n, d], got (3, 12, 2, 3)" in out and "Task 1: [shape]" in out, out
    assert "[/x/gloo/pair.cc:537]" in out and "0/2" in out, "the table and the score must print, brackets intact"


def test_an_exception_in_the_learners_code_names_its_line(tmp_path):
    (tmp_path / "lab.py").write_text(LEARNER)
    impl = Adapter.of_file(tmp_path / "lab.py", ["index_of_first", "checked"])
    passed, feedback, details = _run_check(_learner_file_raises, impl)
    assert not passed and feedback.startswith("raised IndexError: list index out of range"), feedback
    assert "at lab.py:3 in index_of_first (return blocks[0]" in feedback, feedback
    assert "Traceback" in details, "--traceback prints the whole story"


def test_the_learners_own_assert_is_not_the_graders_verdict(tmp_path):
    (tmp_path / "lab.py").write_text(LEARNER)
    impl = Adapter.of_file(tmp_path / "lab.py", ["index_of_first", "checked"])
    _, feedback, _ = _run_check(_learner_assert, impl)
    assert feedback.startswith("your own assert failed at lab.py:7 in checked"), feedback
    assert feedback.endswith(": x must be positive"), feedback
    _, verdict, _ = _run_check(_grader_verdict_with_brackets, impl)
    assert verdict == "want [b, h, n, d], got (3, 12, 2, 3)", "the grader's verdict is shown as it is"


def test_an_exception_in_a_rank_names_the_rank_and_the_learners_line(tmp_path):
    (tmp_path / "lab.py").write_text(LEARNER)
    impl = Adapter.of_file(tmp_path / "lab.py", ["index_of_first", "checked"])
    result = run_task(Task("Task 1: ranks", 1, _learner_raises_in_ranks, timeout=60), impl)
    assert not result.passed and result.feedback.startswith("rank 1 raised IndexError"), result.feedback
    assert "at lab.py:3 in index_of_first" in result.feedback, result.feedback


def _index_on_rank_1(path):
    from course_lib.grading.adapter import load

    if dist.get_rank() == 1:
        load(path).index_of_first([])


def _learner_raises_in_ranks(impl):
    launch(_index_on_rank_1, 2, impl.sources[0][1], timeout=30)


def test_a_check_that_needs_a_failing_task_names_it_not_itself(tmp_path):
    impl = Adapter.of_file(tmp_path / "x.py", [])
    first, second = Task("Task 1: the pool", 2, _first_task), Task("Task 2: the hash", 1, _second_task)
    third = Task("Task 3: tables", 1, _needs_passing_prerequisite, needs=(_fine,))
    second.needs = (_first_task,)
    tasks = [Task("Task 0: fine", 1, _fine), first, second, third]
    results = [Result(t, *_run_check(t.check, impl)) for t in tasks]
    blame_prerequisites(results, tasks, impl, run=lambda t, i: Result(t, *_run_check(t.check, i)))
    feedback = {r.task.name: r.feedback for r in results}
    assert feedback["Task 2: the hash"].startswith("needs Task 1 first: 'Task 1: the pool' fails"), feedback
    assert feedback["Task 3: tables"] == "the third task's own mistake", "a passing prerequisite leaves the blame here"
    only_second = [Result(second, *_run_check(second.check, impl))]
    blame_prerequisites(only_second, tasks, impl, run=lambda t, i: Result(t, *_run_check(t.check, i)))
    assert "needs Task 1 first" in only_second[0].feedback, "--task grades the prerequisite it was not asked for"


def test_task_numbers_and_selection():
    rows = [
        Task("setup", 1, _passes, setup=True),
        Task("Task 1: a", 1, _passes),
        Task("Tasks 3+4: b", 1, _passes),
        Task("Tasks 1-3: c", 1, _passes),
        Task("Task 2 (extra credit): d", 1, _passes),
    ]
    assert [r.numbers for r in rows] == [set(), {1}, {3, 4}, {1, 2, 3}, {2}]
    assert [t.name for t in select(rows, 3)] == ["Tasks 3+4: b", "Tasks 1-3: c"]
    with pytest.raises(SystemExit, match="no Task 7: choose --task from 1, 2, 3, 4"):
        select(rows, 7)


def test_the_expected_exception_type_is_said():
    def release_twice():
        raise ValueError("block 3 is free")

    with pytest.raises(
        AssertionError, match="releasing twice must raise RuntimeError, got ValueError: block 3 is free"
    ):
        raises(RuntimeError, release_twice, what="releasing twice")
    with pytest.raises(AssertionError, match="must raise RuntimeError; it returned normally"):
        raises(RuntimeError, lambda: None, what="releasing twice")
    with pytest.raises(NotImplementedError):  # a stub is "not implemented yet", never a RuntimeError that passes
        raises(RuntimeError, _todo, None, what="releasing twice")
    assert isinstance(raises(KeyError, _crashes, None, what="a lookup"), KeyError)


@pytest.mark.slow
def test_grade_help_and_task_option_from_the_shell():
    out = subprocess.run([str(ROOT / "course"), "grade", "-h"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--task N" in out.stdout and "--dir DIR" in out.stdout, out.stdout + out.stderr
    with pytest.raises(SystemExit, match="no Task 9"):
        grade.grade("lab01", solutions=True, task=9)


def test_a_wrong_task_1_is_named_by_task_3_rows_end_to_end(tmp_path):
    """Lab 01's all-reduce is the learner's reduce-scatter then all-gather: a mistake in Task 1 must make
    ``--task 3`` name Task 1, not send the learner hunting in a correct all-reduce."""
    solution = ROOT / "solutions" / "lab01_collectives" / "collectives.py"
    text = solution.read_text()
    old = "        into += buffer\n"
    assert text.count(old) == 1, "the reduce-scatter of lab 01's solution changed: update this planted bug"
    (tmp_path / "collectives.py").write_text(text.replace(old, "        into.copy_(buffer)  # planted: no sum\n"))
    results = grade.grade("lab01", lab_dir=tmp_path, task=3)
    assert [r.passed for r in results] == [False, True], [(r.task.name, r.feedback) for r in results]
    assert results[0].feedback.startswith("needs Task 1 first: 'Task 1: reduce-scatter equals torch.distributed'"), (
        results[0].feedback
    )
