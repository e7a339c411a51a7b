"""Grade a lab: run its graded tasks against the learner's code and print a table of points.

    python -m course_lib.grading.grade lab01               # grades labs/lab01_collectives (your work)
    python -m course_lib.grading.grade lab01 --solutions   # grades solutions/lab01_collectives
    python -m course_lib.grading.grade lab01 --dir PATH    # grades a copy somewhere else

XX ``AssertionError("what to look at")`` on failure; its message
becomes the learner's feedback line. Each task runs in its own process with its own timeout, so a
submission that hangs loses that task's points and grading goes on. Exit code 0 only on full marks.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from course_lib.dist import LaunchTimeout, RankError, launch
from course_lib.grading import labs
from course_lib.grading.adapter import Adapter

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Task:
    name: str
    points: int
    check: Callable[[Adapter], None]
    timeout: float = 60.0
    setup: bool = False  # points an untouched starter also earns (it imports, files are in place)


@dataclass
class Result:
    task: Task
    passed: bool
    feedback: str = ""

    @property
    def earned(self) -> int:
        return self.task.points if self.passed else 0


def _run_check(check: Callable[[Adapter], None], impl: Adapter) -> tuple[bool, str]:
    try:
        check(impl)
        return True, ""
    except AssertionError as e:
        return False, str(e).strip().splitlines()[0] if str(e).strip() else "an assertion failed"
    except NotImplementedError as e:
        return False, f"not implemented yet: {e}"
    except RankError as e:
        last = e.rank_traceback.strip().splitlines()[-1]
        if "NotImplementedError" in last:
            return False, f"not implemented yet: {last.split(':', 1)[-1].strip()}"
        if "AssertionError" in last:
            return False, last.split(":", 1)[-1].strip()
        return False, f"rank {e.rank} raised {last}"
    except LaunchTimeout as e:
        return False, f"ranks {e.ranks} timed out: {str(e).splitlines()[-1].strip()}"
    except Exception:
        return False, "raised " + traceback.format_exc().strip().splitlines()[-1]


def run_task(task: Task, impl: Adapter) -> Result:
    """Run one task in a process of its own, bounded by the task's timeout."""
    try:
        passed, feedback = launch(_run_check, 1, task.check, impl, timeout=task.timeout)[0]
    except LaunchTimeout:
        passed, feedback = False, f"timed out after {task.timeout:g} s: look for a send without a matching recv"
    except RankError as e:
        passed, feedback = False, f"the check crashed: {e.rank_traceback.strip().splitlines()[-1]}"
    return Result(task, passed, feedback)


def grader(lab: str):
    """The grader module for ``lab`` ('lab01' or 'lab01_collectives')."""
    names = [m.name for m in pkgutil.iter_modules(labs.__path__)]
    matches = [n for n in names if n == lab or n.startswith(lab + "_")]
    if len(matches) != 1:
        raise SystemExit(f"unknown lab {lab!r}: choose one of {', '.join(sorted(names))}")
    return importlib.import_module(f"course_lib.grading.labs.{matches[0]}"), matches[0]


def grade(lab: str, lab_dir: Path | None = None, solutions: bool = False) -> list[Result]:
    module, full = grader(lab)
    lab_dir = Path(lab_dir) if lab_dir else ROOT / ("solutions" if solutions else "labs") / full
    impl = module.adapter(lab_dir)
    return [run_task(t, impl) for t in module.TASKS]


def report(results: list[Result], title: str, console: Console | None = None) -> None:
    table = Table(title=title)
    for col in ("task", "points", "result", "feedback"):
        table.add_column(col, overflow="fold")
    for r in results:
        status = "pass" if r.passed else "FAIL"
        table.add_row(
            r.task.name + (" (setup)" if r.task.setup else ""), f"{r.earned}/{r.task.points}", status, r.feedback
        )
    total, possible = sum(r.earned for r in results), sum(r.task.points for r in results)
    table.add_row("total", f"{total}/{possible}", "", "", end_section=True)
    (console or Console(width=140)).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Grade a lab of the course.")
    parser.add_argument("lab", help="lab01, lab02, ... or the full folder name")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--solutions", action="store_true", help="grade solutions/ instead of labs/")
    where.add_argument("--dir", type=Path, help="grade the lab folder at this path")
    args = parser.parse_args(argv)
    results = grade(args.lab, args.dir, args.solutions)
    _, full = grader(args.lab)
    source = args.dir or ("solutions/" if args.solutions else "labs/") + full
    report(results, f"{full} — {source}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
