import socket
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # tests draw headless: no window, the same drawing

import matplotlib.pyplot as plt
import pytest

# pyproject's --basetemp puts tmp_path under build/ (nothing in the system's temp folder); pytest
# creates that folder but not its parent.
(Path(__file__).resolve().parent.parent / "build").mkdir(exist_ok=True)


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
