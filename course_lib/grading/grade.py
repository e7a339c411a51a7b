"""Grade a lab: run its graded tasks against the learner's code and print a table of points.

    ./course grade lab01                 # grades labs/lab01_collectives (your work)
    ./course grade lab01 --task 2        # only the rows of Task 2 (and what they need, if they fail)
    ./course grade lab01 --traceback     # after the table, the whole traceback of each failure
    ./course grade lab01 --solutions     # grades solutions/lab01_collectives (the reference)
    ./course grade lab01 --dir PATH      # grades a copy of the lab folder somewhere else

The grader contract. A grader is a module ``course_lib/grading/labs/labNN_<name>.py`` (found by its
prefix) that defines three things:

* ``ROLES`` — a tuple of role names: the functions and classes of the learner's module that the
  checks call (lab 03: ``("ZeroAdamW", "padded_size", "shard_of", "adamw_")``), each named as the
  learner's file names it.
* ``adapter(lab_dir) -> Adapter`` — builds the :class:`~course_lib.grading.adapter.Adapter` that maps
  each role to a callable, here ``Adapter.of_file(lab_dir / "zero.py", ROLES)``: the learner's file.
  A check never imports what it checks; it calls ``impl["ZeroAdamW"](...)``. So the same check also
  tests course_lib's own implementation: tests/grading/test_lab_checks.py hands the checks an
  ``Adapter.of_library(role="course_lib.module:attribute", ...)``, with tests/lab_shims.py where the
  lab's interface and the library's differ.
* ``TASKS`` — a list of :class:`Task` ``(name, points, check, timeout, setup, needs)``: the rows of the
  table. ``check(impl)`` raises ``AssertionError("what to look at")`` on failure, and its message
  becomes the learner's feedback line; ``timeout`` bounds it (seconds); ``setup`` rows are earned by
  an untouched starter (it imports, the files are in place); ``needs`` lists the checks of other
  tasks this one relies on. A name starting ``Task N:`` (or ``Tasks 3+4``, ``Tasks 1-3``) says which
  tasks the row grades, for ``--task``.

The checks run in a worker process apart from the grader, each under its own timeout
(:mod:`course_lib.grading.runner`), so a submission that hangs or crashes loses that task's points and
grading goes on. Exit code 0 only on full marks.

Feedback says where: an exception raised in the learner's code names the innermost line of the
learner's files it passed through; an ``assert`` the learner wrote is reported as theirs, not as the
grader's verdict; a check that relies on another task's code (``Task.needs``) that fails names that
task instead of blaming its own.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from course_lib.dist import LaunchTimeout, RankError
from course_lib.grading import labs
from course_lib.grading.adapter import Adapter
from course_lib.grading.runner import run_checks

ROOT = Path(__file__).resolve().parents[2]
NUMBERS = re.compile(r"^Tasks? ([0-9]+)(?:([-+])([0-9]+))?\b")
FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')


@dataclass
class Task:
    """One row of a lab's table. ``needs``: checks of *other* tasks this check relies on; when this
    check fails and one of them fails too, the feedback names that task as the one to fix first."""

    name: str
    points: int
    check: Callable[[Adapter], None]
    timeout: float = 60.0
    setup: bool = False  # points an untouched starter also earns (it imports, files are in place)
    needs: tuple[Callable[[Adapter], None], ...] = ()

    @property
    def numbers(self) -> set[int]:
        """The task numbers the row grades: 'Task 3: …' -> {3}, 'Tasks 3+4: …' -> {3, 4}, 'Tasks 1-3' -> {1, 2, 3}."""
        m = NUMBERS.match(self.name)
        if not m:
            return set()
        first = int(m[1])
        if m[2] == "-":
            return set(range(first, int(m[3]) + 1))
        return {first, int(m[3])} if m[2] == "+" else {first}


@dataclass
class Result:
    task: Task
    passed: bool
    feedback: str = ""
    details: str = field(default="", repr=False)  # the whole traceback, for --traceback

    @property
    def earned(self) -> int:
        return self.task.points if self.passed else 0


# ------------------------------------------------------------------------------------- where it failed


def _frames(text: str) -> list[tuple[str, int, str, str]]:
    """(file, line, function, code) of each frame of the last traceback in ``text``, outermost first."""
    last = text.rsplit("Traceback (most recent call last):", 1)[-1].splitlines()
    frames = []
    for i, line in enumerate(last):
        m = FRAME.match(line)
        if m:
            code = last[i + 1].strip() if i + 1 < len(last) and not FRAME.match(last[i + 1]) else ""
            frames.append((m[1], int(m[2]), m[3], code))
    return frames


def _exception(text: str) -> tuple[str, str]:
    """(type name, first line of the message) of the exception ``text``'s last traceback ends with."""
    last = text.rsplit("Traceback (most recent call last):", 1)[-1].splitlines()
    frame_lines = [i for i, line in enumerate(last) if FRAME.match(line)]
    after = last[frame_lines[-1] + 1 :] if frame_lines else last
    for line in after:
        if line and not line[0].isspace():  # code and carets are indented; the exception line is not
            kind, _, message = line.partition(":")
            return kind.strip().rsplit(".", 1)[-1], message.strip()
    return "an error", ""


def _learner_dirs(impl: Adapter) -> set[Path]:
    """The folders of the learner's files: a frame in one of them is the learner's code."""
    return {Path(module).resolve().parent for _, module, _ in impl.sources if module.endswith(".py")}


def _learner_frame(text: str, impl: Adapter) -> tuple[str, int, str, str] | None:
    """The innermost frame of ``text``'s traceback that lies in the learner's files, if any."""
    dirs = _learner_dirs(impl)
    for frame in reversed(_frames(text)):
        if Path(frame[0]).resolve().parent in dirs:
            return frame
    return None


def _at(frame: tuple[str, int, str, str]) -> str:
    file, line, function, code = frame
    return f"{Path(file).name}:{line} in {function}" + (f" ({code})" if code else "")


def _explain(text: str, impl: Adapter) -> str:
    """One line of feedback from a traceback's text: the grader's verdict, a stub, or where it raised."""
    kind, message = _exception(text)
    learner = _learner_frame(text, impl)
    frames = _frames(text)
    raised_by_learner = learner is not None and frames and frames[-1][:2] == learner[:2]
    if kind == "NotImplementedError":
        return f"not implemented yet: {message}"
    if kind == "AssertionError" and not raised_by_learner:
        return message or "an assertion failed"
    if kind == "AssertionError":
        return f"your own assert failed at {_at(learner)}" + (f": {message}" if message else "")
    where = f" at {_at(learner)}" if learner else ""
    hint = "" if learner else " (not in your files: run with --traceback to see where)"
    return f"raised {kind}" + (f": {message}" if message else "") + where + hint


def _run_check(check: Callable[[Adapter], None], impl: Adapter) -> tuple[bool, str, str]:
    """Run one check in this process: (passed, one line of feedback, the whole traceback)."""
    try:
        check(impl)
        return True, "", ""
    except RankError as e:  # a rank the check launched raised: its traceback came back as text
        feedback = _explain(e.rank_traceback, impl)
        return False, (f"rank {e.rank} " if feedback.startswith("raised") else "") + feedback, e.rank_traceback
    except LaunchTimeout as e:
        return False, f"ranks {e.ranks} timed out: {str(e).splitlines()[-1].strip()}", str(e)
    except Exception:
        text = traceback.format_exc()
        return False, _explain(text, impl), text


def run_tasks(tasks: list[Task], impl: Adapter) -> list[Result]:
    """Each task's result: their checks run in order in a worker process, each under its task's timeout."""
    outcomes = run_checks([t.check for t in tasks], [t.timeout for t in tasks], impl, _run_check)
    return [Result(task, *outcome) for task, outcome in zip(tasks, outcomes, strict=True)]


def run_task(task: Task, impl: Adapter) -> Result:
    """One task's result, in a worker process of its own."""
    return run_tasks([task], impl)[0]


# ------------------------------------------------------------------------------------- grading a lab


def grader(lab: str):
    """The grader module for ``lab`` ('lab01' or 'lab01_collectives')."""
    names = [m.name for m in pkgutil.iter_modules(labs.__path__) if not m.name.startswith("_")]
    matches = [n for n in names if n == lab or n.startswith(lab + "_")]
    if len(matches) != 1:
        raise SystemExit(f"unknown lab {lab!r}: choose one of {', '.join(sorted(names))}")
    return importlib.import_module(f"course_lib.grading.labs.{matches[0]}"), matches[0]


def select(tasks: list[Task], number: int | None) -> list[Task]:
    """The rows that grade task ``number`` (all rows for None); a number no row grades is refused."""
    if number is None:
        return list(tasks)
    chosen = [t for t in tasks if number in t.numbers]
    if not chosen:
        known = sorted(set().union(*(t.numbers for t in tasks)))
        raise SystemExit(f"this lab has no Task {number}: choose --task from {', '.join(map(str, known))}")
    return chosen


def blame_prerequisites(results: list[Result], tasks: list[Task], impl: Adapter, run=run_task) -> None:
    """A failed row whose ``needs`` include a failing check of another task names that task instead.

    Prerequisites already graded are reused; others (``--task`` grades one task) are run now.
    """
    by_check = {t.check: t for t in tasks}
    known = {r.task.check: r for r in results}
    for r in results:
        if r.passed or not r.task.needs:
            continue
        for need in r.task.needs:
            if need not in by_check:
                raise ValueError(f"{r.task.name!r} needs a check that is no task of this lab: {need}")
            if need not in known:
                known[need] = run(by_check[need], impl)
            prerequisite = known[need]
            if not prerequisite.passed:
                r.feedback = (
                    f"needs {prerequisite.task.name.split(':')[0]} first: '{prerequisite.task.name}' fails "
                    f"({prerequisite.feedback})"
                )
                break


def grade(lab: str, lab_dir: Path | None = None, solutions: bool = False, task: int | None = None) -> list[Result]:
    module, full = grader(lab)
    lab_dir = Path(lab_dir) if lab_dir else ROOT / ("solutions" if solutions else "labs") / full
    impl = module.adapter(lab_dir)
    results = run_tasks(select(module.TASKS, task), impl)
    blame_prerequisites(results, module.TASKS, impl)
    return results


def report(results: list[Result], title: str, console: Console | None = None, tracebacks: bool = False) -> None:
    """The table of points. Every text is escaped: rich would read '[b, h, n, d]' as markup and drop it."""
    console = console or Console(width=140)
    table = Table(title=escape(title))
    for col in ("task", "points", "result", "feedback"):
        table.add_column(col, overflow="fold")
    for r in results:
        status = "pass" if r.passed else "FAIL"
        name = r.task.name + (" (setup)" if r.task.setup else "")
        table.add_row(escape(name), f"{r.earned}/{r.task.points}", status, escape(r.feedback))
    total, possible = sum(r.earned for r in results), sum(r.task.points for r in results)
    table.add_row("total", f"{total}/{possible}", "", "", end_section=True)
    console.print(table)
    if tracebacks:
        for r in results:
            if not r.passed and r.details:
                console.rule(escape(r.task.name))
                console.print(escape(r.details.rstrip()), highlight=False)
    elif not all(r.passed for r in results):
        console.print("add --traceback to see the whole traceback of each failure")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./course grade", description="Grade a lab of the course.")
    parser.add_argument("lab", help="lab01, lab02, ... or the full folder name")
    parser.add_argument("--task", type=int, metavar="N", help="grade only the rows of Task N")
    parser.add_argument("--traceback", action="store_true", help="print the whole traceback of each failure")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--solutions", action="store_true", help="grade solutions/ instead of labs/")
    where.add_argument("--dir", type=Path, help="grade the lab folder at this path (a copy of labs/LAB)")
    args = parser.parse_args(argv)
    results = grade(args.lab, args.dir, args.solutions, args.task)
    _, full = grader(args.lab)
    source = str(args.dir) if args.dir else ("solutions/" if args.solutions else "labs/") + full
    only = f", Task {args.task} only" if args.task is not None else ""
    report(results, f"{full} — {source}{only}", tracebacks=args.traceback)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
