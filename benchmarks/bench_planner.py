"""The auto-planner against this machine: its ranking of the 8-rank composed layouts beside their measured step times.

    .venv/bin/python benchmarks/bench_planner.py                 # 8 ranks, tiny model with 4 blocks
    .venv/bin/python benchmarks/bench_planner.py --rounds 5

Every layout of dp × tp × pp = 8 that the planner accepts and course_lib.parallel.compose can run
(tp ≤ 2: the course model has 2 key/value heads; m ≤ 4 micro-batches) is measured in one launch, in
interleaved rounds (course_lib.experiments.lecture10.layout_timing.step_times). The planner runs in its shared-cores mode
(8 ranks on this machine's cores): the arithmetic rate comes from a one-thread measurement of a block,
and the two constants a time-shared CPU adds — the fixed cost of a block pass and the α of a message
under load — are fitted on the probe layouts (m = 1) only; the other layouts are predictions. The
acceptance: the planner's top pick is among the two fastest layouts measured.
"""

from __future__ import annotations

import argparse
import os

from course_lib.cost import planner
from course_lib.experiments.lecture10.layout_timing import (
    as_planned,
    calibrate,
    candidates,
    fit_shared_cores,
    step_times,
)
from course_lib.model import configs


def spearman(a: list[float], b: list[float]) -> float:
    rank = lambda xs: {i: r for r, i in enumerate(sorted(range(len(xs)), key=xs.__getitem__))}
    ra, rb = rank(a), rank(b)
    n = len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    args = parser.parse_args()
    cfg = configs.get("tiny", n_layers=args.layers)
    G, S = args.global_batch, args.seq
    pass_alone, rate = calibrate("tiny", {"n_layers": args.layers}, seq_len=S)
    layouts = candidates(cfg, args.world_size, G, S)
    measured = step_times(layouts, "tiny", {"n_layers": args.layers}, G, S, rounds=args.rounds)
    seconds = {ly: measured[str(ly)] for ly in layouts}
    probes = {ly: t for ly, t in seconds.items() if ly.m == 1}
    cluster, constant = fit_shared_cores(cfg, probes, G, S, args.world_size, args.cores, rate)
    predicted = {ly: planner.predict(cfg, cluster, as_planned(ly, G), G, S, dp_overlap=0.0) for ly in layouts}
    order = sorted(layouts, key=lambda ly: predicted[ly].step_seconds)
    fastest = sorted(layouts, key=seconds.__getitem__)
    print(
        f"{args.world_size} ranks on {args.cores} cores, tiny model with {args.layers} blocks, G={G}, s={S}; "
        f"block pass alone {pass_alone * 1e3:.2f} ms, rate {rate / 1e9:.1f} GFLOP/s per thread"
    )
    print(
        f"fitted on the {len(probes)} probe layouts (m=1): pass_seconds {cluster.pass_seconds * 1e3:.2f} ms, "
        f"α {cluster.links['scale_up'][0] * 1e3:.2f} ms, constant {constant * 1e3:.1f} ms"
    )
    print("| planner rank | layout | probe | predicted (ms) | measured (ms) | measured rank |")
    print("|---|---|---|---|---|---|")
    for i, ly in enumerate(order):
        p = (predicted[ly].step_seconds + constant) * 1e3
        print(
            f"| {i + 1} | {ly} | {'yes' if ly.m == 1 else ''} | {p:.0f} | {seconds[ly] * 1e3:.0f} | "
            f"{fastest.index(ly) + 1} |"
        )
    rho = spearman([predicted[ly].step_seconds for ly in layouts], [seconds[ly] for ly in layouts])
    pick = order[0]
    print(f"Spearman rank correlation, predicted vs measured: {rho:.2f}")
    print(f"planner's pick {pick}: measured rank {fastest.index(pick) + 1} of {len(layouts)}")
    print(f"among the two fastest measured: {'yes' if fastest.index(pick) < 2 else 'NO'}")
    print("\n" + planner.explain(predicted[pick], predicted[order[1]]))


if __name__ == "__main__":
    main()
