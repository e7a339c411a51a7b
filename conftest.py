"""For every pytest run in this repository (tests/ and lectures/ under nbval alike).

Nothing outside build/, and the lectures' exercises answered by their references.

pyproject's --basetemp puts ``tmp_path`` under build/. The temp folder of the run itself and of every
program it starts (torchrun's logs, torch's compile cache, the ranks of ``launch``, nbval's kernels,
which are stopped without the chance to remove their forkserver's socket folder) is
build/tmp/pytest-PID, emptied at the end; so are the trace files the lectures write ($COURSE_TRACES).
"""

import multiprocessing.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
TMP = ROOT / "build" / "tmp" / f"pytest-{os.getpid()}"


def pytest_configure(config):
    TMP.mkdir(parents=True)
    os.environ["TMPDIR"] = str(TMP)  # inherited by every subprocess and kernel
    tempfile.tempdir = None  # this process asks again, and gets TMP
    # nbval runs the lectures with the exercises' reference answers (course_lib/grading/exercises.py)
    os.environ["COURSE_REFERENCE_ANSWERS"] = "1"
    # the lectures' Perfetto traces go to the run's temp folder, removed at the end: a test leaves none
    os.environ["COURSE_TRACES"] = str(TMP / "traces")
    # C++ ops that DeepSpeed and quanto compile on first use are cached in build/, not ~/.cache: shared by
    # the tests and the lectures (built once per checkout: lecture 09's DeepSpeed run finds it warm)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))


def pytest_unconfigure(config):
    # Not now: multiprocessing removes this interpreter's own pymp-* folder in TMP at exit, with a
    # finalizer of priority -100; one of priority -101 runs after it and removes the rest.
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(TMP,), kwargs={"ignore_errors": True}, exitpriority=-101)


# The lectures whose cells time something against a model, and what: they run alone (marker serial,
# see course_lib/cli.py). The others (04, 05, 06, 08b, 09: counts, bytes, tokens and losses) share the cores.
# Keyed by the part of the file name before the first "_": "01" for 01_foundations.ipynb, "08a" and "08b"
# for the two parts of lecture 08.
TIMED_LECTURES = {
    "01": "the machine's peak FLOP/s and MFU, optimizer steps timed",
    "02": "DDP's buckets against the α-β model, all-reduces timed",
    "03": "the pipeline's measured bubble against (p - 1)/(m + p - 1)",
    "07": "kernels under the roofline",
    "08a": "the α-β fit's held-out sizes, the DDP timeline",
    "10": "the composed layouts' measured step times against the planner",
}


def pytest_collection_modifyitems(items):
    """A lecture that times something runs alone (marker ``serial``): a test sharing the cores would move
    its figures (lecture 03's measured bubble missed its 15% by 1 point beside another worker)."""
    for item in items:
        if item.path.suffix == ".ipynb" and item.path.name.split("_")[0] in TIMED_LECTURES:
            item.add_marker(pytest.mark.serial)
