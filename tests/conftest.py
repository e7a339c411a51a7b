import socket
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # tests draw headless: no window, the same drawing

import matplotlib.pyplot as plt
import pytest
import torch
from hypothesis import configuration as hypothesis_configuration
from hypothesis import settings as hypothesis_settings

ROOT = Path(__file__).resolve().parent.parent

# Property-based tests: the same examples on every run (a red CI run must be reproducible), no example
# database, and hypothesis's own folder inside build/ rather than .hypothesis/ beside the sources.
hypothesis_configuration.set_hypothesis_home_dir(ROOT / "build" / "hypothesis")
hypothesis_settings.register_profile("course", derandomize=True, database=None, deadline=None)
hypothesis_settings.load_profile("course")


@pytest.fixture(autouse=True)
def _close_figures():
    """Plots made by one test must not pile up in the next."""
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``). The course
    model's 64- to 128-wide matrices gain nothing from a second thread, and on the shared 2-core machine it
    waits for a busy core: a tiny-model step took ~130 ms on 1 thread and 700-1000 ms on 2 under load, and
    test_fp8_training's four runs ~12 s against 70 s (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def free_tcp_port() -> int:
    """A TCP port nobody listens on right now (for servers and launchers started by a test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    """:func:`free_tcp_port`, as a fixture."""
    return free_tcp_port()


@pytest.fixture
def accelerate_launch(free_port):
    """Run a script of solutions/ under `accelerate launch`, as a learner would, and return its output.

    ``accelerate_launch("solutions/lab02_ddp/run.py", "--steps", 2, num_processes=2)``; the config is
    the course's CPU one unless another is named. A non-zero exit fails the test with the output
    (``fails=True``: a zero exit does, for a run that is meant to die).
    """

    def run(script, *args, num_processes=None, config="solutions/accelerate/cpu.yaml", timeout=300, fails=False):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
        if num_processes is not None:
            cmd += ["--num_processes", str(num_processes)]
        cmd += ["--main_process_port", str(free_port), script, *map(str, args)]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if fails:  # a run meant to die (lab 11 kills a rank): it must, and say so
            assert out.returncode != 0, f"{' '.join(cmd[2:])} was meant to fail and exited 0:\n{out.stdout[-3000:]}"
        else:
            assert out.returncode == 0, f"{' '.join(cmd[2:])} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        return out

    return run


def pytest_collection_modifyitems(items):
    """A test that runs a whole program under ``accelerate launch`` is slow (new processes import torch,
    accelerate and the course): ``./course test --fast`` leaves it out, the whole suite runs it. It is
    launch-heavy too: benchmarks/flake_loop.py runs it ten times in a row."""
    for item in items:
        if "accelerate_launch" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.launch_heavy)
