"""The grading engine: each task in its own process with its own timeout, feedback that teaches."""

import time

import torch
import torch.distributed as dist

from course_lib.dist import device, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Result, Task, report, run_task


def _passes(impl):
    assert impl.roles() == ["answer"], "the check receives the adapter it was given"


def _hangs(impl):
    while True:
        time.sleep(0.05)


def _rank_waits_forever():
    if dist.get_rank() == 1:
        dist.recv(torch.zeros(1, device=device()), src=0)  # rank 0 never sends


def _a_rank_hangs(impl):
    launch(_rank_waits_forever, 2, timeout=6)  # long enough for rank 0 to start and return on a loaded machine


def _wrong(impl):
    assert 1 + 1 == 3, "look at the sum: 1 + 1 should be 3 here\nsecond line is not shown"


def _todo(impl):
    raise NotImplementedError("Task 2: the ring")


def _crashes(impl):
    {}["missing"]


def test_a_hanging_submission_loses_its_points_and_grading_goes_on(tmp_path):
    lab = Adapter.of_file(tmp_path / "somewhere.py", ["answer"])
    tasks = [
        Task("hangs", 3, _hangs, timeout=2),
        Task("a rank hangs", 2, _a_rank_hangs, timeout=30),
        Task("fine", 1, _passes),
    ]
    start = time.monotonic()
    results = [run_task(t, lab) for t in tasks]
    assert time.monotonic() - start < 25, "each task's timeout must bound it"
    assert [r.passed for r in results] == [False, False, True], "the task after the hanging ones must still run"
    assert "timed out after 2 s" in results[0].feedback
    assert "ranks [1]" in results[1].feedback and "timed out" in results[1].feedback, results[1].feedback
    assert [r.earned for r in results] == [0, 0, 1]


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
