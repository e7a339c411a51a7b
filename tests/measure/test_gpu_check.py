"""./course gpu-check on a machine without a GPU: the plan, the refusal to pretend, the JSON table,
and every row's statuses — so that a GPU's minutes are spent on the GPU, not on fixing the script."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from course_lib.measure import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_covers_what_only_a_gpu_can_show():
    names = [r.name for r in gpu_check.plan()]
    assert len(names) == len(set(names)), "each check has one name"
    for needed in (
        "device-choice",
        "scaled-mm",
        "fp8-gemm-speed",
        "ddp",
        "zero",
        "zero-offload",
        "tp-sp",
        "1f1b",
        "ring-attention",
        "ep-dispatch",
        "ep-fp8",
        "composed",
        "kv-engine",
        "lectures",
        "vllm",
    ):
        assert needed in names, f"gpu-check lost its {needed!r} row"
    graded = [n for n in names if n.startswith("grade-")]
    assert len(graded) == len(gpu_check.LABS) == 11, "every lab's solutions are graded on the GPU"


def test_every_pytest_row_selects_tests_that_exist():
    """A renamed test file or lab would make a row select nothing: each path, node and -k word must exist."""
    for row in gpu_check.plan():
        if row.check is not None or "pytest" not in row.command:
            continue
        args = row.command[row.command.index("pytest") + 1 :]
        paths = [a for a in args if a.startswith(("tests/", str(ROOT)))]
        assert paths, f"{row.name}: no test path in {args}"
        for path in paths:
            file, _, node = path.partition("::")
            text = (ROOT / file).read_text()
            if node:
                assert node.split("[")[0] in text, f"{row.name}: {node} is not in {file}"
        if "-k" in args:
            word = args[args.index("-k") + 1]
            assert any(word in (ROOT / p.partition("::")[0]).read_text() for p in paths), f"{row.name}: -k {word}"


def test_a_cpu_machine_runs_nothing_and_says_so(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "course_lib.measure.gpu_check", "--json", str(tmp_path / "t.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0 and "no NVIDIA GPU" in out.stdout and "--dry-run" in out.stdout, out.stdout
    assert not (tmp_path / "t.json").exists(), "nothing ran, so no table is written"


def test_the_dry_run_writes_the_table(tmp_path):
    path = tmp_path / "gpu-check.json"
    code = gpu_check.main(["--dry-run", "--only", "scaled-mm,fp8-gemm-speed", "--json", str(path)])
    doc = json.loads(path.read_text())
    assert code == 0 and doc["passed"] and doc["dry_run"] and doc["device"] == "CPU (dry run)"
    assert set(doc) == {"date", "device", "gpus", "dry_run", "torch", "passed", "rows"}
    assert [r["name"] for r in doc["rows"]] == ["scaled-mm", "fp8-gemm-speed"]
    assert all(set(r) == {"name", "what", "status", "seconds", "detail"} for r in doc["rows"])
    assert "tensor" in doc["rows"][0]["detail"] and "of bound" in doc["rows"][0]["detail"]


def _not_applicable(ctx):
    raise gpu_check.NotApplicable("no FP8 on this card")


def _wrong(ctx):
    raise AssertionError("rank 1 ran on cpu\nmore")


def test_each_status_is_a_row_of_the_table():
    ctx = gpu_check.Context(dry_run=True, device=torch.device("cpu"), gpus=0)
    rows = [
        gpu_check.Row("ok", "passes", check=lambda ctx: "fine"),
        gpu_check.Row("na", "n/a", check=_not_applicable),
        gpu_check.Row("bad", "fails", check=_wrong),
        gpu_check.Row("exit0", "command", command=[sys.executable, "-c", "print('done')"]),
        gpu_check.Row("exit1", "command", command=[sys.executable, "-c", "import sys; sys.exit('broken')"]),
    ]
    got = {r["name"]: (r["status"], r["detail"]) for r in gpu_check.run(rows, ctx, budget_s=60)}
    assert got == {
        "ok": ("PASS", "fine"),
        "na": ("N/A", "no FP8 on this card"),
        "bad": ("FAIL", "AssertionError: rank 1 ran on cpu"),
        "exit0": ("PASS", "done"),
        "exit1": ("FAIL", "broken"),
    }
    spent = gpu_check.run(rows[:1], ctx, budget_s=0)
    assert spent[0]["status"] == "NOT RUN", "a row the budget did not reach says so; it is not a pass"
    assert not gpu_check.report(spent, ctx)["passed"]


def test_an_unknown_check_is_refused_with_the_names():
    with pytest.raises(SystemExit):
        gpu_check.main(["--only", "nope"])


def test_a_timed_out_row_keeps_what_it_printed(tmp_path, monkeypatch):
    """A row stopped at its budget fails saying so, and its output so far is in LOG_DIR/NAME.log (where it was)."""
    monkeypatch.setattr(gpu_check, "LOG_DIR", tmp_path)
    code = "import time; print('reached step 1', flush=True); time.sleep(30)"
    row = gpu_check.Row("sleeper", "prints, then hangs", command=[sys.executable, "-c", code], budget_s=3)
    ctx = gpu_check.Context(dry_run=True, device=torch.device("cpu"), gpus=0)
    result = gpu_check._run_row(row, ctx, deadline=time.monotonic() + 60, env=dict(os.environ))
    assert result["status"] == "FAIL" and "timed out" in result["detail"], result
    assert "reached step 1" in (tmp_path / "sleeper.log").read_text()
