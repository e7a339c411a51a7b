import socket
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # tests draw headless: no window, the same drawing

import matplotlib.pyplot as plt
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _close_figures():
    """Plots made by one test must not pile up in the next."""
    yield
    plt.close("all")


@pytest.fixture
def free_port() -> int:
    """A TCP port nobody listens on right now (for servers and launchers started by a test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def accelerate_launch(free_port):
    """Run a script of solutions/ under `accelerate launch`, as a learner would, and return its output.

    ``accelerate_launch("solutions/lab02_ddp/run.py", "--steps", 2, num_processes=2)``; the config is
    the course's CPU one unless another is named. A non-zero exit fails the test with the output.
    """

    def run(script, *args, num_processes=None, config="solutions/accelerate/cpu.yaml", timeout=300):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
        if num_processes is not None:
            cmd += ["--num_processes", str(num_processes)]
        cmd += ["--main_process_port", str(free_port), script, *map(str, args)]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"{' '.join(cmd[2:])} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        return out

    return run
