"""Every lab's grader proven both ways, the single-source rule, and the accelerate entry points."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from course_lib.cli import PORTABILITY_MATRIX
from course_lib.dist import chrome_trace
from course_lib.grading import grade, starters

ROOT = Path(__file__).resolve().parents[2]
LABS = sorted(p.name for p in (ROOT / "solutions").glob("lab*") if p.is_dir())


def test_there_are_labs():
    assert "lab01_collectives" in LABS


@pytest.mark.parametrize("lab", LABS)
@pytest.mark.slow
def test_solutions_score_full_marks_on_a_baseline_cpu_with_one_thread(lab, tmp_path):
    """Every reference solution scores full marks, graded as a learner grades, ``./course grade LAB``, on
    the portability promise's CPU: torch's plain scalar kernels and one thread, unlike the developer's.

    The solutions are graded here only: the machine's own kernels grade course_lib's implementation of
    every check (tests/grading/test_lab_checks.py) and the planted bugs. The system's temp folder is
    played by an empty one: the command must leave nothing there. The full matrix (default/avx2 × 1/all
    threads, nbval included) is `./course portability`.
    """
    system_temp = tmp_path / "system-temp"
    system_temp.mkdir()
    env = {**os.environ, **PORTABILITY_MATRIX[0], "TMPDIR": str(system_temp)}
    assert env["ATEN_CPU_CAPABILITY"] == "default" and env["OMP_NUM_THREADS"] == "1"
    with subprocess.Popen(
        [str(ROOT / "course"), "grade", lab, "--solutions"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as course:
        stdout, stderr = course.communicate(timeout=600)
    # The script's own scratch folder is build/tmp/course-<its PID> (other tests may run ./course beside it)
    scratch = ROOT / "build" / "tmp" / f"course-{course.pid}"
    assert course.returncode == 0, (
        f"the reference solution of {lab} loses points under ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1: a "
        f"tolerance is tighter than the rounding it must absorb (derive it from what bounds the error):\n"
        f"{stdout}{stderr[-2000:]}"
    )
    left = sorted(p.name for p in system_temp.iterdir())
    assert not left, f"./course grade left {left} in the temp folder: the course script must point TMPDIR at build/"
    assert not scratch.exists(), f"./course must remove its {scratch.relative_to(ROOT)} when it ends"


@pytest.mark.parametrize("lab", LABS)
@pytest.mark.slow
def test_untouched_starters_score_zero(lab):
    results = grade.grade(lab, solutions=False)
    earned = [f"{r.task.name}" for r in results if r.passed and not r.task.setup]
    assert not earned, f"an untouched starter of {lab} must earn no points beyond setup; it earned: {earned}"
    assert all(r.feedback for r in results if not r.passed), "every failure must tell the learner what to look at"


def test_labs_are_generated_from_solutions():
    drifted = starters.drift()
    assert not drifted, "labs/ differs from what solutions/ generates — run `./course starters`:\n" + "\n".join(drifted)


@pytest.mark.slow
def test_grade_one_task_both_ways(capsys):
    """``--task N`` grades Task N's rows alone: full marks on the solution (exit 0, the table's total), nothing
    on the starter (exit 1); an unknown lab is refused by name."""
    assert grade.main(["lab01", "--task", "2", "--solutions"]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "3/3" in out, out
    assert grade.main(["lab01", "--task", "2"]) == 1
    with pytest.raises(SystemExit, match="unknown lab"):
        grade.main(["lab99"])
    solution = grade.grade("lab01", solutions=True, task=2)
    starter = grade.grade("lab01", task=2)
    assert (
        [r.task.name for r in solution]
        == [r.task.name for r in starter]
        == [
            "Task 2: all-gather equals torch.distributed",
            "Task 2: all-gather sends (N-1)/N·S bytes",
        ]
    )
    assert all(r.passed for r in solution) and not any(r.passed for r in starter)
    assert all(r.feedback.startswith("not implemented yet: Task 2") for r in starter), [r.feedback for r in starter]


def test_lab01_runs_under_accelerate_launch_at_4_ranks(accelerate_launch):
    out = accelerate_launch("solutions/lab01_collectives/run.py", "--sizes-kib", 4, "--repeats", 2)
    assert "4 ranks" in out.stdout and "correct: all three equal torch.distributed" in out.stdout
    assert "rank 0 sent 1572864 B; 2(N-1)/N·S = 1572864 B" in out.stdout


@pytest.mark.parametrize("v", [1, 2])
def test_lab05_runs_under_accelerate_launch_with_its_2_rank_config(accelerate_launch, v):
    """Lab 05's entry point (tests/parallel/pipeline/test_pipeline.py tests the library's pipeline; the lab's script is here)."""
    out = accelerate_launch(
        "solutions/lab05_pipeline/run.py",
        "--steps",
        2,
        "--v",
        v,
        config="solutions/accelerate/pipeline_cpu.yaml",
        timeout=240,
    )
    if v == 1:
        assert "1F1B over p=2 ranks, m=8 micro-batches" in out.stdout, out.stdout
        assert "rank 0 |FF..BBFBBFBBFBBFBBFBBFBB.BB|" in out.stdout, "rank 0 idles 3 units, 2 before its first B"
        assert "bubble: 0.1111 of the step; (p - 1)/(m + p - 1) = 0.1111" in out.stdout
    else:
        assert "interleaved 1F1B, v=2 over p=2 ranks" in out.stdout, out.stdout
        assert "bubble: 0.0588 of the step; (p - 1)/(v·m + p - 1) = 0.0588" in out.stdout
    assert "the pipelined model follows the whole model bit for bit" in out.stdout


def test_lab07_runs_under_accelerate_launch_at_2_ranks(accelerate_launch):
    """Lab 07's entry point (tests/parallel/expert/test_expert_parallel.py tests the library's dispatch; the lab's script is here)."""
    out = accelerate_launch("solutions/lab07_moe/run.py", "--steps", 12, num_processes=2, timeout=240)
    assert "2 ranks, backend gloo; E=8 experts (4 per rank), top-2" in out.stdout, out.stdout
    assert (
        "expert parallel output equals the layer on one rank (max |Δ| ≤ 1e-5 of the largest entry): True" in out.stdout
    )
    sent = [line for line in out.stdout.splitlines() if line.startswith("rank 0 handed")]
    assert len(sent) == 1 and sent[0].split(" B to ")[0].split()[-1] == sent[0].split(" = ")[-1].removesuffix(" B"), (
        f"the bytes measured must equal the formula: {sent}"
    )
    assert "your balancing loss evened out the load: True" in out.stdout, out.stdout


def test_lab08_runs_under_accelerate_launch_at_2_ranks(accelerate_launch):
    """Lab 08's entry point (tests/precision/test_fp8.py tests the library's FP8; the lab's script is here)."""
    out = accelerate_launch("solutions/lab08_fp8/run.py", "--steps", 12, num_processes=2, timeout=120)
    assert "2 ranks, backend gloo; FP8 recipe 'block', 12 steps of 2·256 examples" in out.stdout, out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith(("e4m3 ", "e5m2 "))]
    flushed = {(row[0], row[1]): int(row[-3]) for row in rows}  # format, recipe, error, N "of" total
    assert flushed[("e4m3", "tile")] < flushed[("e4m3", "tensor")], f"tiles must flush fewer to zero: {flushed}"
    assert "FP8 training follows bf16 (loss decrease within 25%): True" in out.stdout, out.stdout


def test_lab02_run_py_writes_one_chrome_trace_of_every_rank(accelerate_launch, tmp_path):
    """``run.py --trace PATH`` (every lab's entry point has it): rank 0 writes one Chrome trace with a
    process per rank and each rank's communication on it, and writes nothing anywhere else."""
    root_json = set(ROOT.glob("*.json"))
    path = tmp_path / "run.json"
    out = accelerate_launch(
        "solutions/lab02_ddp/run.py", "--steps", 1, "--batch", 4, "--trace", path, num_processes=2, timeout=120
    )
    assert "replicas identical after 1 steps: True" in out.stdout, out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"], "--trace must write PATH and nothing beside it"
    assert set(ROOT.glob("*.json")) == root_json, "--trace must not write into the working directory"
    chrome = json.loads(path.read_text())
    totals = chrome_trace.check_chrome(chrome)
    assert sorted(totals) == [0, 1], f"one process per rank: {sorted(totals)}"
    named = {e["pid"]: e["args"]["name"] for e in chrome["traceEvents"] if e["name"] == "process_name"}
    assert named == {0: "rank 0", 1: "rank 1"}, named
    comm = {e["pid"] for e in chrome["traceEvents"] if e["ph"] == "X" and e.get("cat") == "comm"}
    assert comm == {0, 1}, f"every rank's all-reduces must be on the trace; comm spans on ranks {sorted(comm)}"


def test_lab09_runs_under_accelerate_launch_at_2_ranks(accelerate_launch):
    """Lab 09's entry point (tests/inference/test_paged_cache.py tests the library's cache; the lab's script is here)."""
    out = accelerate_launch("solutions/lab09_kv_cache/run.py", "--requests", 8, num_processes=2, timeout=240)
    assert "2 ranks, backend gloo; 8 requests" in out.stdout, out.stdout
    assert "tokens equal decoding without a cache on every rank: True" in out.stdout, out.stdout
    waste = [line for line in out.stdout.splitlines() if line.startswith("paged cache waste")]
    assert len(waste) == 1 and float(waste[0].split(": ")[1].split("%")[0]) < 4.0, waste


def test_lab11_survives_a_sigkill_under_accelerate_launch(accelerate_launch, tmp_path):
    """Lab 11's entry point, as its README runs it: an uninterrupted run; a run whose rank 1 SIGKILLs
    itself after 7 steps (accelerate reports the failure); the restart, which resumes from step 6 and
    ends with the uninterrupted run's fingerprint (tests/labs/test_lab11_fault_tolerance.py attacks the loop)."""
    script, kw = "solutions/lab11_fault_tolerance/run.py", dict(num_processes=2, timeout=240)
    whole = accelerate_launch(script, "--root", tmp_path / "a", **kw).stdout
    assert "2 ranks, backend gloo; 12 steps, a checkpoint every 3" in whole, whole
    killed = accelerate_launch(script, "--root", tmp_path / "b", "--kill-at", 7, fails=True, **kw)
    assert "rank 1: SIGKILL after 7 steps" in killed.stdout, killed.stdout
    resumed = accelerate_launch(script, "--root", tmp_path / "b", "--resume", **kw).stdout
    assert "resumed from: step_00000006" in resumed, resumed
    prints = [
        line for out in (whole, resumed) for line in out.splitlines() if line.startswith("final state fingerprint")
    ]
    assert len(prints) == 2 and prints[0] == prints[1], f"the resumed run must end bit-identical: {prints}"
    losses = [line for line in resumed.splitlines() if line.startswith("step ")]
    assert losses and all(line in whole.splitlines() for line in losses), "the losses after the resume must be the same"
