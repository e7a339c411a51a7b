"""The commands behind ./course (the set-up itself is in that script).

./course lectures [--execute [--inplace]]   ./course test [--fast] [pytest args]   ./course grade LAB [--solutions]
./course gpu-check [--dry-run] [--plan] [--only NAMES]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from course_lib.grading import grade, starters

ROOT = Path(__file__).resolve().parent.parent
LECTURES = ROOT / "lectures"
BUILD = ROOT / "build" / "lectures"


def lectures(
    execute: bool, port: int | None, folder: Path = LECTURES, build: Path = BUILD, inplace: bool = False
) -> int:
    if not execute:
        cmd = [sys.executable, "-m", "jupyter", "lab", f"--notebook-dir={folder}"]
        if port:
            cmd.append(f"--port={port}")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")  # containers and CI run as root; Jupyter refuses without this
        # Become JupyterLab (same process): stopping this command stops the server, no orphan is left.
        os.execv(sys.executable, cmd)
    build.mkdir(parents=True, exist_ok=True)
    # headless runs execute the exercises' reference answers (course_lib.grading.exercises): every cell runs
    env = {**os.environ, "COURSE_REFERENCE_ANSWERS": "1"}
    failed = []
    for nb in sorted(folder.glob("*.ipynb")):
        start = time.monotonic()
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "jupyter",
                "nbconvert",
                "--execute",
                "--ExecutePreprocessor.timeout=600",
                *(["--to", "notebook", "--inplace"] if inplace else ["--to", "html", f"--output-dir={build}"]),
                str(nb),
            ],
            stderr=subprocess.DEVNULL,
            env=env,
        )
        print(f"{nb.name}: {'ok' if code == 0 else 'FAILED'} in {time.monotonic() - start:.0f} s")
        if code:
            failed.append(nb.name)
    where = f"saved in place in {folder}" if inplace else f"HTML in {build}"
    print(where + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


# The CPUs a learner may have, as torch sees them: the vector unit its kernels use (ATEN_CPU_CAPABILITY;
# "default" is plain scalar code, available everywhere) and the threads a reduction is split over.
PORTABILITY_MATRIX = [
    {"ATEN_CPU_CAPABILITY": isa, "OMP_NUM_THREADS": threads}
    for isa in ("default", "avx2")
    for threads in ("1", str(os.cpu_count() or 1))
]


def nbval_command(*extra: str) -> list[str]:
    """pytest over the lectures with nbval: stored outputs compared (timings sanitized)."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "lectures",
        "--nbval",
        "--nbval-current-env",
        f"--nbval-sanitize-with={LECTURES / 'sanitize.cfg'}",
        "--nbval-cell-timeout=300",
        *extra,
    ]


def portability(labs_only: bool = False) -> int:
    """Every lab's reference solution and every lecture's stored outputs, on each CPU of the matrix.

    The course promises the same numbers on any learner's CPU: the graders must give full marks and
    nbval must pass whatever vector unit torch uses and however many threads it splits sums over.
    About 5 minutes per configuration on 2 cores; ``--labs-only`` skips nbval.
    """
    labs = sorted(p.name for p in (ROOT / "solutions").glob("lab*") if p.is_dir())
    rows = []
    for config in PORTABILITY_MATRIX:
        env = {**os.environ, **config}
        label = " ".join(f"{k}={v}" for k, v in config.items())
        for lab in labs:
            code = subprocess.call(
                [sys.executable, "-m", "course_lib.cli", "grade", lab, "--solutions"],
                env=env,
                stdout=subprocess.DEVNULL,
            )
            rows.append((label, f"grade {lab} --solutions", code == 0))
        if not labs_only:
            code = subprocess.call(nbval_command("-q"), cwd=ROOT, env=env)
            rows.append((label, "nbval lectures/", code == 0))
    width = max(len(r[0]) for r in rows)
    for label, what, ok in rows:
        print(f"{label:{width}}  {what:40} {'pass' if ok else 'FAIL'}")
    return 0 if all(ok for _, _, ok in rows) else 1


# The suite runs on WORKERS pytest-xdist processes, a file to each at a time; what times something
# against a model (marker serial: a few tests, and the lectures that time something) runs afterwards, alone.
WORKERS = 2
# The shared phase gives each worker one thread (OpenMP threads that sleep when idle, not spin). With
# torch's default, a thread per core in each worker, every parallel region waited at its barrier for a
# thread the other worker had descheduled: lab 09's grading took 61-71 s beside one busy process, 6-10 s
# with these settings, and 6 s on a quiet machine (BENCHMARKS.md, "The test suite after issue 29").
SHARED_THREADS = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def test(extra: list[str]) -> int:
    """The whole suite: unit tests, nbval on every lecture (outputs compared), every lab's grader both ways.

    ``--fast``: the contributor's loop, tests/ without the tests marked slow and without nbval (the
    markers are described in pyproject.toml). Two runs of pytest: first everything not marked serial,
    spread over WORKERS processes of one thread each, then the serial tests alone; extra arguments go to both. The
    ``course`` script points TMPDIR at build/tmp/ for everything the tests start, and removes it.
    """
    fast = "--fast" in extra
    rest = [a for a in extra if a != "--fast"]
    if fast:
        base = [sys.executable, "-m", "pytest", "tests"]
        tier = "not slow and "
    else:
        # tests first, then the lectures: the lectures first gained nothing (982 s against 968 s) and started
        # lectures 06 and 09's vLLM engines beside test_vllm's
        base = nbval_command()
        base.insert(3, "tests")
        tier = ""
    shared = [*base, "-m", f"{tier}not serial", "-n", str(WORKERS), "--dist", "loadfile", *rest]
    alone = [*base, "-m", f"{tier}serial", *rest]
    code = 0
    for cmd, env in ((shared, {**os.environ, **SHARED_THREADS}), (alone, None)):
        print(" ".join(cmd[2:]), flush=True)
        result = subprocess.call(cmd, cwd=ROOT, env=env)
        # 5: pytest collected nothing (arguments that select only tests of the other run)
        code = code or (0 if result == 5 else result)
    return code


def gpu_check(args: list[str]) -> int:
    """./course gpu-check: a harness (course_lib.measure), so it runs as its own program, not imported here."""
    return subprocess.call([sys.executable, "-m", "course_lib.measure.gpu_check", *args])


# Commands that hand every later argument to another program as it is (argparse's REMAINDER refuses
# one that starts with an option, such as `./course starters --check`).
PASS_THROUGH = {"test": test, "grade": grade.main, "starters": starters.main, "gpu-check": gpu_check}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASS_THROUGH:
        os.chdir(ROOT)
        return PASS_THROUGH[argv[0]](argv[1:])
    parser = argparse.ArgumentParser(prog="./course", description="Efficient LLM Training — the course that runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("lectures", help="JupyterLab on lectures/ (or --execute them headless)")
    p.add_argument("--execute", action="store_true", help="run every lecture, write HTML to build/lectures/")
    p.add_argument("--inplace", action="store_true", help="with --execute: save each notebook with its outputs")
    p.add_argument("--port", type=int, help="JupyterLab port")
    p.add_argument("--dir", type=Path, default=LECTURES, help="the notebook folder (default: lectures/)")
    p.add_argument("--build", type=Path, default=BUILD, help="where --execute writes HTML (default: build/lectures/)")
    sub.add_parser(
        "test", help="the whole test suite; --fast: without the slow tests and nbval (pytest arguments pass through)"
    )
    sub.add_parser("grade", help="grade a lab: LAB [--solutions]")
    p = sub.add_parser("portability", help="graders (--solutions) and nbval on every CPU of the matrix")
    p.add_argument("--labs-only", action="store_true", help="graders only, no nbval")
    sub.add_parser(
        "gpu-check", help="on a machine with NVIDIA GPUs: the checks only a GPU can show (--plan, --dry-run)"
    )
    sub.add_parser("starters", help="regenerate labs/ from solutions/ (or --check)")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    if args.command == "lectures":
        if args.inplace and not args.execute:
            parser.error("--inplace saves executed notebooks: use it with --execute")
        return lectures(args.execute, args.port, args.dir.resolve(), args.build.resolve(), args.inplace)
    return portability(args.labs_only)


if __name__ == "__main__":
    sys.exit(main())
