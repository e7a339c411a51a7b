"""Device discipline, enforced: rank-side code names the device of every tensor it creates.

On CPU every tensor lives in one place, so a forgotten ``device=`` costs nothing and no test on a
laptop notices it. Under NCCL the same line hands a CPU tensor to a collective (an error), adds it
to a CUDA tensor (an error), or silently computes on the host. This test reads the code the ranks
run (``course_lib/``, the graders, ``solutions/``, the labs' entry scripts and ``benchmarks/``) with
``ast``, nothing executed, and fails on:

* a tensor factory (``torch.tensor``, ``zeros``, ``ones``, ``empty``, ``full``, ``arange``,
  ``rand*``, ``linspace``, ``eye``, ``Generator`` ...) called without ``device=``;
* ``time.perf_counter()`` outside :mod:`course_lib.dist.timing`: a GPU runs asynchronously, and a
  timing that does not synchronise measures the queueing (use ``course_lib.dist.timing.clock``).

A tensor that is meant to live on the host (an RNG state, a count kept for bookkeeping, data made on
the CPU so that every machine draws the same numbers) says so with a comment on the statement's
lines or the line above: ``# host: <why>``. A module that never meets a rank's device (the synthetic language
is drawn on the host so any machine gets the same tokens) says so once, near its top:
``# device-guard: host-only: <why>``. The reason is required; an empty one is a finding too.

It proves it can fail: a planted file with a bare factory, a bare timer and an empty reason must be
reported, and the same file with the devices named must not.

Run it over some paths to list the findings: ``python tests/test_device_guard.py course_lib/measure``.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "logspace",
    "eye",
    "empty_strided",
    "Generator",
}
HOST = re.compile(r"#\s*host:\s*(\S.*)?$")
HOST_ONLY = re.compile(r"#\s*device-guard:\s*host-only:\s*(\S.*)?$")
# Pure arithmetic and drawing: no tensor of a rank's is made there.
EXEMPT_DIRS = ("course_lib/cost/", "course_lib/plots/")
# The one clock that synchronises the device.
TIMER_HOME = "course_lib/dist/timing.py"


def rank_side_files(root: Path = ROOT) -> list[Path]:
    """The code a rank runs: the library (graders included), the solutions, labs' entry scripts, the examples,
    benchmarks."""
    files = [*root.glob("course_lib/**/*.py"), *root.glob("solutions/**/*.py"), *root.glob("benchmarks/*.py")]
    files += root.glob("examples/**/*.py")
    files += root.glob("labs/*/run.py")
    return sorted(p for p in files if not any(p.relative_to(root).as_posix().startswith(d) for d in EXEMPT_DIRS))


def _is_torch_attr(func: ast.expr, names: set[str]) -> str | None:
    if isinstance(func, ast.Attribute) and func.attr in names and isinstance(func.value, ast.Name):
        if func.value.id == "torch":
            return func.attr
    return None


def _is_perf_counter(func: ast.expr) -> bool:
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "perf_counter"
        and isinstance(func.value, ast.Name)
        and func.value.id == "time"
    )


def _reason(lines: list[str], first: int, last: int) -> str | None:
    """The ``# host:`` reason on the call's lines or the line above ("" when the reason is empty)."""
    for i in range(max(0, first - 2), last):
        m = HOST.search(lines[i])
        if m:
            return (m.group(1) or "").strip()
    return None


def _simple_statements(tree: ast.AST) -> dict[int, tuple[int, int]]:
    """id(call) -> the lines of the simple statement (an assignment, a return, an expression ...) that
    holds it. Calls inside a compound statement's header (``for x in torch.arange(n):``) keep their own."""
    spans = {}
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.stmt) and not hasattr(stmt, "body"):
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call):
                    spans[id(node)] = (stmt.lineno, stmt.end_lineno or stmt.lineno)
    return spans


def findings(path: Path, text: str | None = None, rel: str | None = None) -> list[str]:
    """Every violation in one file, as ``path:line: what to do``."""
    text = path.read_text() if text is None else text
    rel = rel or path.relative_to(ROOT).as_posix()
    lines = text.splitlines()
    for line in lines[:40]:
        m = HOST_ONLY.search(line)
        if m:
            return [] if (m.group(1) or "").strip() else [f"{rel}: '# device-guard: host-only:' needs a reason"]
    out = []
    tree = ast.parse(text)
    statement = _simple_statements(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        # the reason may stand anywhere in the simple statement holding the call (the formatter moves a
        # trailing comment to the statement's last line when it wraps a long call) or on the line above
        first, last = statement.get(id(node), (node.lineno, node.end_lineno or node.lineno))
        factory = _is_torch_attr(node.func, FACTORIES)
        if factory is not None and not any(k.arg in ("device", None) for k in node.keywords):  # None: **kwargs
            problem = (
                f"torch.{factory}(...) without device=: pass device=course_lib.dist.device() (or the device "
                "of the tensor it meets), or say why it lives on the host: '# host: <why>'"
            )
        elif _is_perf_counter(node.func) and rel != TIMER_HOME:
            problem = (
                "time.perf_counter() does not wait for the device: use course_lib.dist.timing.clock() "
                "(or '# host: <why>' for a host-only duration)"
            )
        else:
            continue
        reason = _reason(lines, first, last)
        if reason is None:
            out.append(f"{rel}:{first}: {problem}")
        elif not reason:
            out.append(f"{rel}:{first}: '# host:' needs a reason")
    return sorted(out, key=lambda s: int(s.split(":")[1]) if s.split(":")[1].isdigit() else 0)


def test_rank_side_code_names_its_devices():
    files = rank_side_files()
    assert len(files) > 150, f"only {len(files)} rank-side files found: is ROOT right?"
    problems = [f for p in files for f in findings(p)]
    assert not problems, "tensors made without a device, or timings that skip the device:\n" + "\n".join(problems)


PLANTED = """\
import time
import torch

def step(x):
    start = time.perf_counter()
    ones = torch.ones(4)
    out = x + ones
    seed = torch.tensor([1, 2])  # host:
    return out, seed, start
"""

FIXED = """\
import time
import torch
from course_lib.dist.timing import clock

def step(x, device):
    start = clock()
    ones = torch.ones(4, device=device)
    seed = torch.tensor([1, 2])  # host: an RNG seed, read on the host
    like = torch.zeros(3, **{"device": device})
    wall = time.perf_counter()  # host: the deadline of a host-side wait
    out = dict(
        state=x, rng=torch.rand(4)
    )  # host: the CPU generator's next draws (ruff put this comment after the wrapped call)
    return x + ones, clock() - start
"""


def test_planted_violations_are_reported():
    problems = findings(Path("planted.py"), PLANTED, rel="planted.py")
    assert len(problems) == 3, problems
    assert "planted.py:5: time.perf_counter()" in problems[0]
    assert "planted.py:6: torch.ones(...) without device=" in problems[1]
    assert "planted.py:8: '# host:' needs a reason" in problems[2]


def test_named_devices_and_stated_reasons_pass():
    assert findings(Path("fixed.py"), FIXED, rel="fixed.py") == []


def test_a_host_only_module_needs_its_reason():
    body = "import torch\nx = torch.ones(3)\n"
    assert (
        findings(Path("m.py"), "# device-guard: host-only: drawn on the host for every machine\n" + body, "m.py") == []
    )
    assert findings(Path("m.py"), "# device-guard: host-only:\n" + body, "m.py") == [
        "m.py: '# device-guard: host-only:' needs a reason"
    ]


def test_the_timer_home_may_read_the_clock():
    text = "import time\ndef clock():\n    return time.perf_counter()\n"
    assert findings(Path("t.py"), text, rel=TIMER_HOME) == []
    assert findings(Path("t.py"), text, rel="course_lib/measure/t.py")


if __name__ == "__main__":
    targets = [Path(a).resolve() for a in sys.argv[1:]] or [ROOT]
    found = [f for p in rank_side_files() if any(p == t or t in p.parents for t in targets) for f in findings(p)]
    print("\n".join(found) or "no findings")
    print(f"{len(found)} findings", file=sys.stderr)
