"""The capstone step across "nodes": two accelerate launchers on this machine, machine_rank 0 and 1,
meeting at 127.0.0.1 as two real nodes meet at node 0's address, give the losses and the final
parameters of one launcher starting the same 8 ranks (tests/parallel/test_compose.py checks the composed
step itself against one process)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the composed-training demo under accelerate launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/composed_training/run.py"


def _results(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("step ", "final parameters"))]


def test_two_launchers_on_loopback_equal_one_launcher(accelerate_launch, free_port):
    one = accelerate_launch(SCRIPT, num_processes=8, timeout=300).stdout
    assert "dp=2 tp=2 pp=2 m=2 on 8 ranks, backend gloo; 8 ranks per launcher" in one, one
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
            + [f"solutions/accelerate/loopback_node{r}.yaml", "--main_process_port", str(free_port), SCRIPT],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=300) for p in launchers]
    finally:
        for p in launchers:  # a launcher left waiting for its peer must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (out, err)) in enumerate(zip(launchers, outs)):
        assert p.returncode == 0, f"launcher {r} (machine_rank {r}) failed:\n{out[-2000:]}{err[-3000:]}"
    two = outs[0][0]  # rank 0 runs under the launcher of machine_rank 0
    assert "on 8 ranks, backend gloo; 4 ranks per launcher" in two, two
    assert _results(two) and _results(two) == _results(one), (
        f"two launchers must train exactly as one:\n{_results(two)}\n{_results(one)}"
    )
