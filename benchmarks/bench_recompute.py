"""Activation checkpointing: step time and memory of none / selective / full, and of torch.compile's
activation memory budget, on one model, side by side in one run.

    .venv/bin/python benchmarks/bench_recompute.py                    # d_model 256, 4 layers, 8 x 256 tokens
    .venv/bin/python benchmarks/bench_recompute.py --no-compile       # the eager policies only (a minute)
    .venv/bin/python benchmarks/bench_recompute.py --d-model 128 --layers 2 --seq-len 64 --budgets 1.0 0.0

The course Transformer in fp32: course_lib.model.recompute.set_recompute for the eager policies; the
whole loss under torch.compile(backend="inductor") with torch._functorch.config.activation_memory_budget
for the budgets. Per row:
* step (ms): median over --repeats runs of the median of --steps training steps (loss of the whole model,
  forward + backward) after two warm-up steps (which compile); the runs go through the rows forwards,
  then backwards, so drifting load hits every row alike; ×none: over the eager, unchecked step;
* FLOPs ×: (step + recompute) / step, course_lib.cost.activations.recompute_flops (eager rows);
* kept / peak (KiB): the blocks' activations after the forward pass and at the peak of the backward pass,
  model (recompute_peak_bytes) and measurement (measure_recompute: LiveTensorMeter, exact), on the blocks
  alone; for the budgets, what the compiled blocks save for backward (measure_memory_budget:
  SavedTensorMeter; their peak is not measurable that way: a dispatch mode makes dynamo run eagerly);
* allocator peak (MiB): the most bytes allocated at once during one whole training step, from
  torch.profiler's memory events (step_time_and_peak): everything — the parameters' gradients, logits,
  the backward's temporaries, compiled kernels' buffers.
Timings on a shared 2-core machine vary by ±20% between runs; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

# torch writes its compile cache (and an empty one whenever torch._dynamo is imported) under the temp
# folder: keep it inside build/, as the test suite does, so that nothing is left in /tmp.
_TMP = Path(__file__).resolve().parent.parent / "build" / "tmp" / "bench_recompute"
_TMP.mkdir(parents=True, exist_ok=True)
os.environ["TMPDIR"] = str(_TMP)
tempfile.tempdir = None

import torch  # noqa: E402

from course_lib.cost.activations import RECOMPUTE_POLICIES, recompute_flops, recompute_peak_bytes  # noqa: E402
from course_lib.experiments.lecture06.recompute_memory import (  # noqa: E402
    measure_memory_budget,
    measure_recompute,
    step_time_and_peak,
)
from course_lib.model import configs  # noqa: E402

KIB, MIB = 2**10, 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="runs through all rows, alternating direction")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--budgets", type=float, nargs="*", default=[1.0, 0.5, 0.0])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile budgets")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b, s = args.batch, args.seq_len
    budgets = [] if args.no_compile else args.budgets
    cfg = configs.get("small", d_model=args.d_model, n_layers=args.layers, d_ff=None, max_seq_len=s)
    print(
        f"course model d_model={cfg.d_model}, d_ff={cfg.d_ff}, {cfg.n_layers} layers, {cfg.n_heads} heads "
        f"({cfg.n_kv_heads} KV), {cfg.n_params() / 1e6:.2f}M parameters, fp32, batch {b} x {s} tokens, "
        f"{torch.get_num_threads()} thread(s), torch {torch.__version__}"
    )
    rows = {}
    for policy in RECOMPUTE_POLICIES:  # exact, deterministic: measured once
        model, got = recompute_peak_bytes(cfg, b, s, policy), measure_recompute(cfg, b, s, policy)
        rows[policy, None] = {
            "name": f"eager {policy}",
            "flops": f"{recompute_flops(cfg, b, s, policy)['ratio']:.3f}",
            "kept": (model["saved"], got["saved"]),
            "peak": (model["peak"], got["peak"]),
        }
    saved = measure_memory_budget(cfg, b, s, budgets, backend="inductor") if budgets else {}
    for budget in budgets:
        rows["none", budget] = {
            "name": f"compiled, budget {budget:g}",
            "flops": "-",
            "kept": (None, saved[budget]["saved"]),
            "peak": (None, None),
        }
    runs = {key: [] for key in rows}
    for repeat in range(args.repeats):
        for policy, budget in list(rows) if repeat % 2 == 0 else list(rows)[::-1]:
            runs[policy, budget].append(step_time_and_peak(cfg, b, s, policy, budget, steps=args.steps))
    for key, row in rows.items():
        row["step"] = statistics.median(r["step_s"] for r in runs[key])
        row["allocator"] = statistics.median(r["allocator_peak"] for r in runs[key])

    base = rows["none", None]["step"]
    fmt = lambda v, unit: "-" if v is None else f"{v / unit:.0f}"
    print(
        f"{'':>20} {'step (ms)':>10} {'×none':>6} {'FLOPs ×':>8} {'kept model':>11} {'kept meas.':>11} "
        f"{'peak model':>11} {'peak meas.':>11} {'alloc. peak':>12}"
    )
    print(f"{'':>20} {'':>10} {'':>6} {'':>8} {'KiB':>11} {'KiB':>11} {'KiB':>11} {'KiB':>11} {'MiB':>12}")
    for r in rows.values():
        print(
            f"{r['name']:>20} {r['step'] * 1e3:>10.1f} {r['step'] / base:>6.2f} {r['flops']:>8} "
            f"{fmt(r['kept'][0], KIB):>11} {fmt(r['kept'][1], KIB):>11} {fmt(r['peak'][0], KIB):>11} "
            f"{fmt(r['peak'][1], KIB):>11} {r['allocator'] / MIB:>12.1f}"
        )


if __name__ == "__main__":
    main()
