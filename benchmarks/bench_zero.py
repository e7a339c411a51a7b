"""ZeRO-2 and ZeRO-3: course_lib against DeepSpeed — step time and peak memory, in one run.

    .venv/bin/python benchmarks/bench_zero.py                  # 2 ranks, d_model 512, 8 layers
    .venv/bin/python benchmarks/bench_zero.py --world 2 --d-model 256 --layers 4 --steps 8 --repeats 1

Both train the course Transformer in fp32 with torch's AdamW, the same data and seed, through the
functions of solutions/lab03_zero/train_deepspeed.py (DeepSpeed's settings: solutions/deepspeed/zeroN.json).
Each configuration runs in fresh rank processes (one course_lib.dist.launch each), so peaks do not mix.

What is measured, per rank (the table shows the slowest or largest rank, median over --repeats
fresh launches, the two implementations alternating):
* step time: median over the steps after the first two (warm-up), forward + backward + step;
* peak memory: the process's peak resident set (``ru_maxrss``) minus its resident set just before
  the model is built (deepspeed already imported in both cases, so its import is not counted),
  with glibc's mmap threshold fixed at 64 KiB so that freed tensors leave the resident set.
  This includes everything a rank allocates — model states, activations, communication buckets,
  the full model built before it is sharded — the honest number on a CPU, where torch keeps no
  allocator statistics;
* model states (course_lib only): the census of course_lib.parallel.data.zero, next to the ZeRO formula;
* DeepSpeed's start-up allocation: the peak of deepspeed.initialize alone on the tiny model,
  a cost that does not grow with the model, reported so that it can be set apart.
Timings on a shared 2-core machine vary by ±20% between runs; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import sys
from pathlib import Path

import psutil

from course_lib.cost.memory import zero_model_state_bytes
from course_lib.dist import launch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "solutions" / "lab03_zero"))

MB = 2**20


def _rank(kind: str, stage: int, steps: int, overrides: dict) -> dict:
    # A fixed mmap threshold: every tensor above 64 KiB gets its own mapping, returned to the OS when
    # freed. glibc's default raises the threshold after the first large free, after which freed
    # blocks stay in the heap and the resident set remembers them: ZeRO-3's gather/free per unit
    # would then show as memory still held.
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import train_deepspeed as T

    base = psutil.Process().memory_info().rss
    cfg = T.load_config(stage)
    if kind == "deepspeed-start-up":  # what deepspeed.initialize costs by itself: a 0.1M-parameter model
        net = T._model("tiny", 0)
        deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
        return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base}
    if kind == "deepspeed":
        out = T.train_deepspeed(stage, steps, cfg, model="small", overrides=overrides)
    else:
        out = T.train_course(stage, steps, cfg, model="small", overrides=overrides)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "step_s": statistics.median(out["step_s"][2:]),
        "peak": peak - base,
        "loss": out["losses"][-1],
        "state_bytes": out.get("state_bytes"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="fresh launches per configuration")
    args = parser.parse_args()
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3: the first two are warm-up")

    from course_lib.model import configs

    overrides = {"d_model": args.d_model, "n_layers": args.layers, "d_ff": None}  # d_ff re-derived from d_model
    psi = configs.get("small", **overrides).n_params()
    print(
        f"{args.world} ranks, gloo, course model d_model={args.d_model}, {args.layers} layers: "
        f"Ψ = {psi / 1e6:.1f}M parameters, fp32 AdamW, micro-batch 8 x 32 tokens per rank"
    )
    runs = {}
    for repeat in range(args.repeats):  # alternate the order between repeats: drifting load hits both
        kinds = ("course_lib", "deepspeed") if repeat % 2 == 0 else ("deepspeed", "course_lib")
        for stage in (2, 3):
            for kind in kinds:
                ranks = launch(_rank, args.world, kind, stage, args.steps, overrides, timeout=600)
                runs.setdefault((kind, stage), []).append(ranks)
    rows = {}
    for (kind, stage), repeats in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rows[kind, stage] = {  # the slowest / largest rank of each run, median over the runs
            "step_s": statistics.median(max(r["step_s"] for r in ranks) for ranks in repeats),
            "peak": statistics.median(max(r["peak"] for r in ranks) for ranks in repeats),
            "loss": repeats[0][0]["loss"],
            "state_bytes": repeats[0][0]["state_bytes"],
        }
    print(
        f"{'stage':>5} {'implementation':>14} {'step (ms)':>10} {'peak MiB':>9} {'states MiB':>11} "
        f"{'formula MiB':>12} {'final loss':>11}"
    )
    for (kind, stage), r in rows.items():
        formula = zero_model_state_bytes(psi, args.world, stage, k=8, param_bytes=4, grad_bytes=4) / MB
        states = f"{r['state_bytes'] / MB:.1f}" if r["state_bytes"] else "-"
        print(
            f"{stage:>5} {kind:>14} {r['step_s'] * 1e3:>10.0f} {r['peak'] / MB:>9.0f} {states:>11} "
            f"{formula:>12.1f} {r['loss']:>11.4f}"
        )
    fixed = max(r["peak"] for r in launch(_rank, args.world, "deepspeed-start-up", 2, 0, overrides, timeout=600))
    print(f"DeepSpeed start-up alone (deepspeed.initialize on the 0.1M-parameter tiny model): {fixed / MB:.0f} MiB")
    for stage in (2, 3):
        ours, ds = rows["course_lib", stage], rows["deepspeed", stage]
        print(
            f"ZeRO-{stage}: course_lib / DeepSpeed step time = {ours['step_s'] / ds['step_s']:.2f}, "
            f"peak memory = {ours['peak'] / ds['peak']:.2f} "
            f"({ours['peak'] / (ds['peak'] - fixed):.2f} without DeepSpeed's start-up allocation)"
        )


if __name__ == "__main__":
    main()
