"""Running a lab's checks apart from the grader: one worker process, each check under its own timeout.

A check runs in a worker process (rank 0 of a one-rank :func:`~course_lib.dist.launch`), so a
submission that crashes the interpreter or never returns costs its task, not the grading. The checks
of one grading run one after another in ONE worker, not one worker each: a check that launches ranks
starts a fork server in the process it runs in (a fresh interpreter that imports torch, 2-5 s of the
course machine), and one worker pays for it once per lab instead of once per task (BENCHMARKS.md,
"The test suite after issue 29").

Inside the worker each check is bounded by its task's timeout: an interval timer raises
``_TimedOut`` in the check, which unwinds through the check's own launches (their ``finally`` stops
their ranks) and is reported as that task's timeout. A check that blocks where the timer cannot reach
it (inside one C call) or that kills the worker is found from the worker's end: every check writes
its outcome to a file as it finishes, the first check without one is the culprit, and the checks after
it go on in a new worker. Tested in tests/grading/test_grade.py (a hanging check, a rank that hangs, a crash).
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

from course_lib.dist import LaunchTimeout, RankError, launch
from course_lib.grading.adapter import Adapter

Check = Callable[[Adapter], None]
Outcome = tuple[bool, str, str]  # passed, one line of feedback, the whole traceback
# The worker's own start (fork, imports) on top of its checks' timeouts, for the outer bound.
WORKER_START_S = 60.0


def timed_out(timeout: float) -> str:
    """The feedback of a check that ran out of time."""
    return f"timed out after {timeout:g} s: look for a send without a matching recv, or a loop that never ends"


def run_checks(checks: list[Check], timeouts: list[float], impl: Adapter, explain: Callable) -> list[Outcome]:
    """Each check's outcome, run in order in one worker process (a new one after a lost worker).

    ``explain(check, impl)`` turns a check into its outcome in the worker (the grader's ``_run_check``).
    """
    outcomes: list[Outcome] = []
    while len(outcomes) < len(checks):
        start = len(outcomes)
        pending, limits = checks[start:], timeouts[start:]
        folder = Path(tempfile.mkdtemp(prefix="course_grade_"))  # under build/tmp when run by ./course
        try:
            lost = None
            try:
                launch(_worker, 1, pending, limits, impl, explain, str(folder), timeout=sum(limits) + WORKER_START_S)
            except LaunchTimeout as e:  # blocked where the timer could not reach it
                lost = (timed_out(limits[min(_finished(folder), len(pending) - 1)]), str(e))
            except RankError as e:
                lost = (f"the check crashed: {e.rank_traceback.strip().splitlines()[-1]}", str(e))
            done = [_read(folder, i) for i in range(_finished(folder))]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        outcomes += done
        if len(outcomes) < len(checks):
            if lost is None:  # the worker returned without finishing: a bug of this module, not the learner's
                raise RuntimeError(f"the grading worker stopped after {len(done)} of {len(pending)} checks")
            outcomes.append((False, *lost))  # the check the worker was running when it was lost
    return outcomes


# ----------------------------------------------------------------------------------------- the worker


class _TimedOut(BaseException):
    """Raised in a check by its timer: not an ``Exception``, so the check's own handlers let it through."""


def _on_timer(signum, frame):
    raise _TimedOut


def _worker(checks: list[Check], timeouts: list[float], impl: Adapter, explain: Callable, folder: str) -> None:
    """In the worker: run each check under its timer, writing ``i.json`` as each one finishes."""
    signal.signal(signal.SIGALRM, _on_timer)
    for i, (check, timeout) in enumerate(zip(checks, timeouts, strict=True)):
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            outcome = explain(check, impl)
        except _TimedOut:
            outcome = (False, timed_out(timeout), traceback.format_exc())
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        (Path(folder) / f"{i}.json").write_text(json.dumps(outcome))


def _finished(folder: Path) -> int:
    """How many checks wrote their outcome (they finish in order)."""
    return sum(1 for _ in folder.glob("*.json"))


def _read(folder: Path, i: int) -> Outcome:
    passed, feedback, details = json.loads((folder / f"{i}.json").read_text())
    return bool(passed), feedback, details
