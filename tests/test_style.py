"""One linter and one formatter, enforced: ``ruff check`` and ``ruff format --check`` over the repository
(library, tests, labs, solutions, benchmarks and the lecture notebooks), configured in pyproject.toml.

Fix a failure with ``.venv/bin/ruff check --fix . && .venv/bin/ruff format .`` (CONTRIBUTING.md).
"""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUFF = [sys.executable, "-m", "ruff"]


def _ruff(*args, cwd=ROOT):
    return subprocess.run([*RUFF, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_ruff_check_passes():
    out = _ruff("check", "--output-format", "concise", ".")
    assert out.returncode == 0, (
        f"ruff check found problems (fix them, or `ruff check --fix .`):\n{out.stdout}{out.stderr}"
    )


def test_ruff_format_check_passes():
    out = _ruff("format", "--check", ".")
    assert out.returncode == 0, f"files need formatting: run `ruff format .`\n{out.stdout}{out.stderr}"


def test_notebooks_and_the_runtime_are_linted_too():
    out = _ruff("check", "--show-files", ".")
    assert "01_foundations.ipynb" in out.stdout, "ruff must read the lecture notebooks (extend-include in pyproject)"
    # ruff's default exclude list skips every folder named "dist": pyproject.toml lists it without that name
    assert "course_lib/dist/launch.py" in out.stdout, "ruff must read course_lib/dist/ (exclude in pyproject)"


def test_a_planted_unused_import_fails_the_check(tmp_path):
    """The check can fail: a copy of the configuration over a file with an unused import is reported."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "planted.py").write_text('"""A module with an unused import."""\n\nimport os\n')
    out = _ruff("check", "--output-format", "concise", ".", cwd=tmp_path)
    assert out.returncode != 0 and "F401" in out.stdout, out.stdout + out.stderr
