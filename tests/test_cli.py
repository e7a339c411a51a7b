"""The two commands of the README: A serves the lectures (or executes them headless), B tests."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_command_a_serves_the_lectures_in_jupyterlab(tmp_path, free_port):
    port = free_port
    env = {
        **os.environ,
        "JUPYTER_TOKEN": "course-test",
        "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
        "BROWSER": "true",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "course_lib.cli", "lectures", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        listing = None
        for _ in range(120):  # JupyterLab takes a few seconds to start
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token=course-test", timeout=2) as r:
                    listing = json.load(r)
                break
            except OSError:
                assert server.poll() is None, "JupyterLab exited instead of serving lectures/"
        assert listing is not None, "JupyterLab did not answer within 60 s"
        served = {item["name"] for item in listing["content"]}
        expected = {p.name for p in (ROOT / "lectures").iterdir() if not p.name.startswith(".")}
        assert expected <= served, f"JupyterLab must serve lectures/: missing {expected - served}"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token=course-test", timeout=5) as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
        tree = [server.pid] + [c.pid for c in psutil.Process(server.pid).children(recursive=True)]
    finally:
        server.terminate()
        server.wait(timeout=30)
    time.sleep(0.5)
    alive = [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"stopping command A must stop JupyterLab too; still running: {alive}"


@pytest.mark.slow
def test_command_a_headless_executes_notebooks_to_html(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    (tmp_path / "nb").mkdir()
    nbformat.write(nb, tmp_path / "nb" / "01_demo.ipynb")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "course_lib.cli",
            "lectures",
            "--execute",
            "--dir",
            str(tmp_path / "nb"),
            "--build",
            str(tmp_path / "html"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    html = (tmp_path / "html" / "01_demo.html").read_text()
    assert "42" in html, "the HTML copy must hold the executed cell's output"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./course test" in readme and "\n./course test\n" in ci, ".ci/run must call exactly the README's command B"


@pytest.mark.slow
def test_lectures_execute_inplace_saves_the_outputs_in_the_notebook(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    path = tmp_path / "01_demo.ipynb"
    nbformat.write(nb, path)
    cmd = [sys.executable, "-m", "course_lib.cli", "lectures", "--execute", "--inplace", "--dir", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    saved = nbformat.read(path, as_version=4).cells[0].outputs
    assert saved and saved[0].text == "42\n", "--inplace must store the executed cell's output in the notebook"
    refused = subprocess.run(cmd[:4] + ["--inplace"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "use it with --execute" in refused.stderr


def test_a_failed_vllm_install_is_tried_once_then_remembered(tmp_path):
    """An offline learner pays for one failed vLLM install, not one per ``./course grade``: the failure is
    remembered in .venv-vllm/.failed, later calls say how to retry (``./course setup-vllm``) and go on."""
    (tmp_path / "requirements").mkdir()
    for name in ("course", "pyproject.toml", "requirements/vllm-cpu.txt", "requirements/vllm-cuda.txt"):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    (tmp_path / "course").chmod(0o755)
    os.utime(tmp_path / "pyproject.toml", (0, 0))  # older than .venv/.installed: no reinstall of the course
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")  # the course's own environment, already installed
    # PYTHON=false: creating vLLM's environment fails at once, as it does offline (after a minute of retries)
    env = {**os.environ, "PYTHON": "false", "PATH": "/usr/bin:/bin"}

    def course(*args):
        return subprocess.run([str(tmp_path / "course"), *args], cwd=tmp_path, env=env, capture_output=True, text=True)

    first = course("grade", "-h")
    assert first.returncode == 0 and "--task N" in first.stdout, first.stderr
    assert "installing vLLM" in first.stderr and "./course setup-vllm" in first.stderr, first.stderr
    assert (tmp_path / ".venv-vllm" / ".failed").exists(), "the failure must be remembered"
    second = course("grade", "-h")
    assert second.returncode == 0 and "setting up" not in second.stderr, "a remembered failure is not tried again"
    assert "the last try failed" in second.stderr and "./course setup-vllm tries again" in second.stderr, second.stderr
    retry = course("setup-vllm")
    assert retry.returncode == 1 and "setting up" in retry.stderr, "setup-vllm tries again, and says it failed"
