"""Pipeline schedules: course_lib's runtime against torch.distributed.pipelining — step time, one run.

    .venv/bin/python benchmarks/bench_pipeline.py                      # p = 2, every schedule
    .venv/bin/python benchmarks/bench_pipeline.py --p 2 --steps 6 --schedules 1f1b gpipe

Both run the same stages (the course model, config ``small`` with p·v blocks), micro-batches and
loss through :func:`course_lib.experiments.lecture03.pipeline_runs.versus_torch`, which also checks that their gradients
agree; the time is rank 0's median step after one warm-up step (torch infers shapes on its first).
The two implementations run one after the other in the same rank processes, so their ratio is the
figure to read; absolute times on a shared 2-core machine move by ±20% between runs.
"""

from __future__ import annotations

import argparse

from course_lib.experiments.lecture03.pipeline_runs import TORCH_SCHEDULES, versus_torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=2, help="pipeline ranks")
    parser.add_argument("--m", type=int, default=None, help="micro-batches per step (default 2p)")
    parser.add_argument("--steps", type=int, default=6, help="steps per implementation (the first is warm-up)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--schedules", nargs="+", default=list(TORCH_SCHEDULES), choices=list(TORCH_SCHEDULES))
    args = parser.parse_args()
    print(
        "| schedule | torch class | course_lib (ms) | torch (ms) | course_lib / torch | largest gradient difference |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.schedules:
        r = versus_torch(name, args.p, args.m, args.steps, config="small", batch=args.batch, seq=args.seq)
        ours, theirs = r["seconds"]["course_lib"], r["seconds"]["torch"]
        worst = max(max(d.values()) for d in r["diffs"].values())
        print(
            f"| {name} | {TORCH_SCHEDULES[name]} | {ours * 1e3:.0f} | {theirs * 1e3:.0f} | {ours / theirs:.2f} | {worst:.1g} |"
        )


if __name__ == "__main__":
    main()
