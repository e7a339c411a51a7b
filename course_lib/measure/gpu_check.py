"""``./course gpu-check``: what only a GPU can show, in one command, as a PASS/FAIL table.

The course runs the same code on CPU ranks over gloo and on GPUs over NCCL. CPU tests prove the
arithmetic; they cannot prove that every tensor lives on the rank's GPU, that NCCL's crossing sends
do not hang, that ``torch._scaled_mm`` accepts the operands' layouts, or that FP8 is faster than bf16
on a card that has FP8 tensor cores. This command runs those checks on a machine with NVIDIA GPUs in
about 8 minutes on one H100 with 16 cores, prints a table and writes ``build/gpu-check.json``:

* in this process: the device rule at 1 and N ranks (NCCL's all-reduce included), ``_scaled_mm``
  (tensor-wise, row-wise, 1x128/128x128 block) against the dequantize-then-fp32 emulation within a
  stated bound, and FP8 vs bf16 GEMM throughput at 4096 and 8192;
* as subprocesses, several at a time: one step of each parallel component against its
  single-process reference (the graders' checks run on course_lib: ``tests/grading/test_lab_checks.py``),
  the labs' reference solutions graded, the lectures whose cells compute on ``runtime.device()``
  under nbval, and vLLM's greedy tokens against the course's.

Ranks get a GPU each where there are enough (``course_lib.dist.runtime``); a check that needs more
ranks than GPUs runs its ranks on the CPU, which the table says. On a machine without an NVIDIA GPU
the command says so and runs nothing; ``--dry-run`` runs every check there on CPU tensors through the
same code (small sizes), so a GPU's minutes are spent on the GPU, not on fixing this script.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.dist import launch, runtime
from course_lib.dist.timing import clock, time_calls
from course_lib.precision import fp8_gemm, fp8_scaling

ROOT = Path(__file__).resolve().parents[2]
JSON_PATH = ROOT / "build" / "gpu-check.json"
LOG_DIR = ROOT / "build" / "gpu-check-logs"  # each subprocess row's stdout and stderr
DEFAULT_BUDGET_S = 480.0


@dataclass
class Context:
    dry_run: bool
    device: torch.device
    gpus: int  # NVIDIA GPUs the ranks may use (0 in a dry run)


@dataclass
class Row:
    name: str
    what: str
    check: Callable[[Context], str] | None = None  # in this process: returns the detail, raises on failure
    command: list[str] = field(default_factory=list)  # or a subprocess: passes when it exits 0
    budget_s: float = 120.0
    env: dict[str, str] = field(default_factory=dict)  # added to the subprocess's environment


class NotApplicable(Exception):
    """The check cannot run on this card or build (an older GPU without FP8, say): N/A with the reason."""


# ------------------------------------------------------------------ checks run in this process


def _rank_report():
    t = torch.ones(1, device=runtime.device())
    dist.all_reduce(t)  # NCCL's first collective on a GPU: proves the communicator works
    return runtime.backend(), str(runtime.device()), t.item()


def check_device_choice(ctx: Context) -> str:
    """launch(fn, 1) and launch(fn, N): every rank's backend and device are what the rule says."""
    out = []
    for world in sorted({1, max(2, ctx.gpus)}):
        expected = runtime.choice(world)
        got = launch(_rank_report, world, timeout=120)
        for rank, (backend, device, total) in enumerate(got):
            want_device = "cpu" if expected.device_type == "cpu" else f"{expected.device_type}:{rank}"
            assert (backend, device) == (expected.backend, want_device), (
                f"{world} ranks: rank {rank} ran {backend} on {device}, the rule says {expected.backend} on "
                f"{want_device} ({expected.why})"
            )
            assert total == world, f"{world} ranks: all_reduce of ones gave {total} on rank {rank}"
        out.append(f"{world}: {expected.backend}/{expected.device_type}{' (fell back)' if expected.fell_back else ''}")
    return "; ".join(out)


def _operands(ctx: Context, m: int, k: int, n: int):
    # host: drawn on the host, so every machine gets the same operands, then moved to the device
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)  # host: as above
    return a.to(ctx.device), b.to(ctx.device)


def _within_fp32_bound(got: torch.Tensor, a, b, out_dtype: torch.dtype) -> float:
    """The emulation and _scaled_mm add the same exact fp8 products in different orders: each fp32
    addition errs by at most 2^-24 of the running sum, so |Δ| <= K·2^-24·(|â| |b̂|ᵀ) (Higham, "Accuracy
    and Stability of Numerical Algorithms", §3.1), twice for the two sums, plus the output's rounding
    (2^-8 relative for bf16's 8 significant bits). Returns the largest |Δ| / bound (must be <= 1).

    A card whose tensor cores accumulate FP8 products in fewer bits (Hopper keeps about 14 between
    promotions to fp32, DeepSeek-V3 technical report §3.3.2) adds up to (K/32)·2^-13 of the sum when
    nothing promotes. torch asks cuBLAS not to accumulate fast (``use_fast_accum=False``, its default),
    which should keep the result inside this bound. Measured on an H100 (torch 2.11+cu130, 2026-11-28,
    BENCHMARKS.md): 0.43 of the bound tensor-wise, 0.44 row-wise. Should a card exceed it, the row fails
    saying by how much: a finding to record."""
    ref = fp8_gemm.fp8_matmul(a, b, backend="emulate")
    k = a[0].shape[1]
    mag = fp8_scaling.dequantize(*a).abs() @ fp8_scaling.dequantize(*b).abs().T
    rounding = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-24
    bound = 2 * k * 2.0**-24 * mag + rounding * ref.abs() + 1e-30
    ratio = ((got.float() - ref).abs() / bound).max().item()
    assert ratio <= 1.0, f"_scaled_mm differs from the emulation by {ratio:.2f}x the stated bound"
    return ratio


def check_scaled_mm(ctx: Context) -> str:
    """_scaled_mm with tensor-wise, row-wise and block scales == the emulation within the bound."""
    if ctx.device.type == "cuda" and torch.cuda.get_device_capability(ctx.device) < (8, 9):
        raise NotApplicable(
            f"FP8 tensor cores need compute capability 8.9 or newer, this card has "
            f"{torch.cuda.get_device_capability(ctx.device)}"
        )
    m, k, n = (256, 512, 384) if ctx.dry_run else (1024, 4096, 2048)
    a, b = _operands(ctx, m, k, n)
    out = []
    for recipe in ("tensor", "row"):
        qa, qb = fp8_scaling.quantize(a, "e4m3", recipe), fp8_scaling.quantize(b, "e4m3", recipe)
        got = fp8_gemm.fp8_matmul(qa, qb, backend="scaled_mm", out_dtype=torch.bfloat16)
        out.append(f"{recipe} {_within_fp32_bound(got, qa, qb, torch.bfloat16):.2f} of bound")
    qa, qb = fp8_scaling.quantize(a, "e4m3", "tile"), fp8_scaling.quantize(b, "e4m3", "block")
    try:
        got = torch._scaled_mm(qa[0], qb[0].t(), qa[1], qb[1].t(), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError) as e:  # CPU, or no block-scaled FP8 GEMM in this build
        first = str(e).strip().splitlines()[0][:120]
        out.append(f"block: emulated only ({first})")
    else:
        out.append(f"block {_within_fp32_bound(got, qa, qb, torch.bfloat16):.2f} of bound")
    return "; ".join(out)


def _gemm_seconds(ctx: Context, size: int) -> tuple[float, float]:
    """The fastest of a few S x S x S GEMMs: FP8 (tensor-wise scales, bf16 out) and bf16."""
    a, b = _operands(ctx, size, size, size)
    (qa, sa), (qb, sb) = fp8_scaling.quantize(a, "e4m3", "tensor"), fp8_scaling.quantize(b, "e4m3", "tensor")
    a16, b16t = a.bfloat16(), b.bfloat16().t()
    qbt = qb.t()  # column-major, as cuBLASLt wants the second operand
    repeats = 2 if ctx.dry_run else 20
    fp8_s = min(time_calls(lambda: torch._scaled_mm(qa, qbt, sa, sb, out_dtype=torch.bfloat16), repeats, 2))
    bf16_s = min(time_calls(lambda: a16 @ b16t, repeats, 2))
    return fp8_s, bf16_s


def check_fp8_speed(ctx: Context) -> str:
    """FP8 (tensor-wise, bf16 out) against bf16 GEMMs of S x S x S: TFLOP/s of each, and their ratio."""
    if ctx.device.type == "cuda" and torch.cuda.get_device_capability(ctx.device) < (8, 9):
        raise NotApplicable("no FP8 tensor cores on this card")
    out = []
    for size in (256,) if ctx.dry_run else (4096, 8192):
        fp8_s, bf16_s = _gemm_seconds(ctx, size)
        flops, ratio = 2 * size**3, bf16_s / fp8_s
        out.append(f"{size}: fp8 {flops / fp8_s / 1e12:.3g} vs bf16 {flops / bf16_s / 1e12:.3g} TFLOP/s ({ratio:.2f}x)")
        if not ctx.dry_run:
            assert ratio > 1.0, f"FP8 GEMM at {size} is not faster than bf16 ({ratio:.2f}x): check the operand layout"
    return "; ".join(out)


# ------------------------------------------------------------------ checks run as subprocesses


def _pytest(*selection: str, stop_at_first: bool = True) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        *(["-x"] if stop_at_first else []),
        "-p",
        "no:cacheprovider",
        *selection,
    ]


def _grade(lab: str) -> list[str]:
    return [sys.executable, "-m", "course_lib.cli", "grade", lab, "--solutions"]


CHECKS = "tests/grading/test_lab_checks.py"
COMPOSE = "tests/parallel/test_compose.py::test_composed_training_follows_one_process"
LECTURES_ON_DEVICE = ("05", "06", "07")  # cells that compute on runtime.device() in the notebook's process
LABS = sorted(p.name for p in (ROOT / "solutions").glob("lab*") if p.is_dir())


def plan() -> list[Row]:
    """Every row, in the order they run (the in-process ones first)."""
    rows = [
        Row("device-choice", "backend and device at 1 and N ranks, NCCL all-reduce", check_device_choice),
        Row("scaled-mm", "_scaled_mm tensor/row/block == emulation within bound", check_scaled_mm),
        Row("fp8-gemm-speed", "FP8 vs bf16 GEMM TFLOP/s at 4096 and 8192", check_fp8_speed),
    ]
    steps = {
        "ddp": ("one DDP step == one process", _pytest(CHECKS, "-k", "lab02")),
        "zero": ("ZeRO-1/2/3 == AdamW on one process", _pytest(CHECKS, "-k", "lab03")),
        "zero-offload": ("ZeRO with CPU offload", _pytest("tests/parallel/data/test_zero.py", "-k", "offload")),
        "tp-sp": ("TP + SP layers == dense", _pytest(CHECKS, "-k", "lab04")),
        "1f1b": ("a 1F1B step == one process", _pytest(CHECKS, "-k", "lab05")),
        "ring-attention": ("ring attention == full attention", _pytest(CHECKS, "-k", "lab06")),
        "ep-dispatch": (
            "EP dispatch/combine fp32 == one rank",
            _pytest("tests/parallel/expert/test_expert_parallel.py"),
        ),
        "ep-fp8": ("MoE checks incl. FP8 dispatch", _pytest(CHECKS, "-k", "lab07")),
        "fp8-linear": ("FP8 linear and training", _pytest(CHECKS, "-k", "lab08")),
        "kv-engine": ("paged KV engine == generate", _pytest("tests/inference/test_paged_cache.py", "-k", "engine")),
        "composed": ("DP x TP x PP step == one process", _pytest(f"{COMPOSE}[dp=2 tp=2 pp=2 m=2]")),
    }
    rows += [Row(name, what, command=cmd, budget_s=180) for name, (what, cmd) in steps.items()]
    rows += [Row(f"grade-{lab[:5]}", f"{lab} solutions: full marks", command=_grade(lab), budget_s=240) for lab in LABS]
    notebooks = [str(p) for n in LECTURES_ON_DEVICE for p in sorted((ROOT / "lectures").glob(f"{n}_*.ipynb"))]
    sanitize = f"--nbval-sanitize-with={ROOT / 'lectures' / 'sanitize.cfg'}"
    # Every cell's failure, not the first (no -x). Cells that launch more ranks than the machine has GPUs
    # run them on the CPU and would say so on stderr, which the stored outputs (made without a GPU) lack.
    nbval = _pytest(*notebooks, "--nbval", sanitize, stop_at_first=False)
    rows.append(
        Row("lectures", "lectures 05-07 under nbval", command=nbval, budget_s=300, env={"COURSE_FALLBACK_NOTICE": "0"})
    )
    rows.append(
        Row("vllm", "vLLM greedy tokens == course_lib's", command=_pytest("tests/inference/test_vllm.py"), budget_s=300)
    )
    return rows


# ------------------------------------------------------------------ running and reporting


def _keep_log(row: Row, stdout: str | bytes | None, stderr: str | bytes | None) -> None:
    """The subprocess's whole output in LOG_DIR/NAME.log: the table keeps one line of it."""
    text = [t.decode(errors="replace") if isinstance(t, bytes) else (t or "") for t in (stdout, stderr)]
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    (LOG_DIR / f"{row.name}.log").write_text(f"$ {' '.join(row.command)}\n{text[0]}\n{text[1]}")


def _run_row(row: Row, ctx: Context, deadline: float, env: dict) -> dict:
    left = deadline - time.monotonic()
    result = {"name": row.name, "what": row.what, "status": "NOT RUN", "seconds": 0.0, "detail": "time budget spent"}
    if left <= 0:
        return result
    start = clock()
    try:
        if row.check is not None:
            result.update(status="PASS", detail=row.check(ctx))
        else:
            out = subprocess.run(
                row.command,
                cwd=ROOT,
                env={**env, **row.env},
                capture_output=True,
                text=True,
                timeout=min(row.budget_s, left),
            )
            _keep_log(row, out.stdout, out.stderr)
            # pytest's summary is stdout's last line, a grader's its "total" row; a crash leaves its reason on stderr
            lines = [ln.strip("│ ") for ln in out.stdout.strip().splitlines() if ln.strip("│└─┴┘ ")]
            totals = [" ".join(ln.replace("│", " ").split()) for ln in lines if ln.startswith("total")]
            tail = totals[-1:] or lines[-1:] or out.stderr.strip().splitlines()[-1:] or [""]
            if out.returncode != 0 and out.stderr.strip():
                tail = out.stderr.strip().splitlines()[-1:]
            result.update(status="PASS" if out.returncode == 0 else "FAIL", detail=tail[0][:200])
    except NotApplicable as e:
        result.update(status="N/A", detail=str(e))
    except subprocess.TimeoutExpired as e:  # what it printed before it was stopped says where it was
        _keep_log(row, e.stdout, e.stderr)
        result.update(status="FAIL", detail=f"timed out after {min(row.budget_s, left):.0f} s")
    except Exception as e:  # a failed check is a row of the table, not the end of the run
        first = (str(e).strip().splitlines() or [""])[0]
        result.update(status="FAIL", detail=f"{type(e).__name__}: {first[:300]}")
    result["seconds"] = round(clock() - start, 1)
    return result


def run(rows: list[Row], ctx: Context, budget_s: float = DEFAULT_BUDGET_S, jobs: int = 1) -> list[dict]:
    """The in-process rows one after another, then the subprocesses ``jobs`` at a time, within the budget."""
    deadline = time.monotonic() + budget_s
    env = dict(os.environ)
    if ctx.dry_run:
        env.update(CUDA_VISIBLE_DEVICES="")  # the rehearsal computes on CPU tensors, even on a GPU machine
    results = [_run_row(r, ctx, deadline, env) for r in rows if r.check is not None]
    commands = [r for r in rows if r.check is None]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results += list(pool.map(lambda r: _run_row(r, ctx, deadline, env), commands))
    return results


def table(results: list[dict]) -> str:
    width = max(len(r["name"]) for r in results)
    lines = [f"{'check':{width}}  status   seconds  detail"]
    lines += [f"{r['name']:{width}}  {r['status']:7} {r['seconds']:8.1f}  {r['detail']}" for r in results]
    return "\n".join(lines)


def report(results: list[dict], ctx: Context) -> dict:
    card = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU (dry run)"
    return {
        "date": datetime.date.today().isoformat(),
        "device": card,
        "gpus": ctx.gpus,
        "dry_run": ctx.dry_run,
        "torch": torch.__version__,
        "passed": all(r["status"] in ("PASS", "N/A") for r in results),
        "rows": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="./course gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="run every check on CPU tensors (small sizes)")
    p.add_argument("--plan", action="store_true", help="list the checks and their commands, run nothing")
    p.add_argument("--only", help="comma-separated check names (see --plan)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run")
    p.add_argument("--jobs", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)), help="subprocesses at once")
    p.add_argument("--json", type=Path, default=JSON_PATH, help=f"where the table goes (default {JSON_PATH})")
    args = p.parse_args(argv)
    rows = plan()
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {r.name for r in rows}
        if unknown:
            p.error(f"unknown check(s) {', '.join(sorted(unknown))}: choose from {', '.join(r.name for r in rows)}")
        rows = [r for r in rows if r.name in wanted]
    if args.plan:
        for r in rows:
            how = "in this process" if r.check is not None else " ".join(r.command[1:])
            print(f"{r.name:16} {r.what}  [{how}]")
        return 0
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0 and not args.dry_run:
        print(
            "gpu-check: no NVIDIA GPU on this machine (torch.cuda.is_available() is False), so nothing was run. "
            "Run it on a machine with GPUs, or rehearse it here on CPU tensors with --dry-run."
        )
        return 0
    if args.dry_run:
        os.environ["COURSE_BACKEND"] = "gloo"  # CPU ranks here and in every subprocess, even on a GPU machine
    ctx = Context(
        args.dry_run, torch.device("cpu") if args.dry_run else torch.device("cuda", 0), 0 if args.dry_run else gpus
    )
    results = run(rows, ctx, args.budget, args.jobs)
    print(table(results))
    doc = report(results, ctx)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"gpu-check: {'all passed' if doc['passed'] else 'FAILED'} on {doc['device']}; table in {args.json}")
    print(f"gpu-check: each subprocess row's whole output is in {LOG_DIR}/NAME.log")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
