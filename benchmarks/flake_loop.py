"""The flake loop: the launch-heavy tests, N times in a row, every failure named with its run.

    .venv/bin/python benchmarks/flake_loop.py              # 10 runs of `pytest -m launch_heavy`, as ./course test
    .venv/bin/python benchmarks/flake_loop.py --runs 3 -- -k deepspeed

The tests marked ``launch_heavy`` (pyproject.toml) start whole programs or kill processes: every
test that runs a script under ``accelerate launch``, DeepSpeed and the other frameworks, vLLM's
engine and HTTP server, and the fault injection (a rank SIGKILLed and resumed, a grading whose
check hangs or ends its worker). A test that passes nine times in ten fails one CI run in ten, so
each must pass every time on a quiet machine (nothing else running): an exit-time abort or a
start-up race is fixed at its root, not retried. Each run goes on after a failure, so one loop
shows every test that failed and how often. Prints a table for BENCHMARKS.md; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from course_lib.cli import SHARED_THREADS, WORKERS

ROOT = Path(__file__).resolve().parents[1]


def one_run(extra: list[str], report: Path) -> tuple[int, list[str], float]:
    """(tests run, the failed ones' ids, seconds) of one pytest run over the launch-heavy tests."""
    cmd = [sys.executable, "-m", "pytest", "tests", "-m", "launch_heavy", "-q"]
    cmd += ["-n", str(WORKERS), "--dist", "loadfile"]
    start = time.monotonic()
    env = {**os.environ, **SHARED_THREADS}  # as ./course test runs them
    subprocess.run([*cmd, f"--junitxml={report}", *extra], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    seconds = time.monotonic() - start
    cases = ET.parse(report).getroot().iter("testcase")
    ran, failed = 0, []
    for case in cases:
        ran += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return ran, failed, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (-k ...)")
    args = parser.parse_args()
    failures: Counter[str] = Counter()
    print("| run | tests | failed | wall |\n|---|---|---|---|", flush=True)
    scratch = ROOT / "build" / "tmp"  # the reports, removed after: nothing outside build/
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flake_loop_", dir=scratch) as folder:
        for run in range(1, args.runs + 1):
            ran, failed, seconds = one_run(args.pytest_args, Path(folder) / f"run{run}.xml")
            failures.update(failed)
            print(f"| {run} | {ran} | {', '.join(failed) or 0} | {seconds:.0f} s |", flush=True)
    if failures:
        print("\nfailed (times out of the runs):")
        for name, times in failures.most_common():
            print(f"  {times}/{args.runs}  {name}")
    else:
        print(f"\nno failure in {args.runs} runs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
