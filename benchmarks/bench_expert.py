"""Expert parallelism: step time and all-to-all bytes at ep = 1, 2, 4 against course_lib.cost.expert_dispatch — one run.

    .venv/bin/python benchmarks/bench_expert.py
    .venv/bin/python benchmarks/bench_expert.py --steps 8 --batch 16 --fp8
    .venv/bin/python benchmarks/bench_expert.py --versus-dense 600     # MoE vs dense of equal active params

The MoE course model of :func:`course_lib.experiments.lecture03.expert_training.moe_config` (d_model 64, 2 MoE layers, 8
routed experts top-2 + 1 shared) trains ``steps`` steps at each ep (the first is warm-up; medians of
the rest). Bytes: the all-to-all payload per rank and step (forward and backward, mean over ranks)
beside the formula L · (4 · ep_dispatch_bytes + ids + split sizes): per layer the dispatch, the
combine and their two backward all-to-alls each move T·k rows, the dispatch adds T·k expert ids and
ep split sizes. Time: rank 0's seconds inside all-to-alls per step beside 2 · L · ep_comm_time (forward
and backward, (ep - 1)/ep of the rows leave the rank) at the all-to-all bandwidth measured in the same run.

``--versus-dense N``: the MoE (aux-loss-free bias, rate 1e-2) and the dense model with as many
active parameters (:func:`course_lib.experiments.lecture03.expert_training.dense_config`) train N steps on the same
batches; cross-entropy in windows of 50 steps, and the MoE's max/mean expert load (last layer).
"""

from __future__ import annotations

import argparse
import statistics

from course_lib.cost.expert_dispatch import ep_comm_time, ep_dispatch_bytes, fp8_bytes_per_element
from course_lib.experiments.lecture03.expert_training import (
    a2a_bandwidth,
    dense_config,
    moe_config,
    train_dense,
    train_moe,
)


def versus_dense(steps: int, window: int = 50) -> None:
    cfg = moe_config()
    dense = train_dense(steps=steps)
    moe = train_moe(1, steps=steps, balance="aux_free", rate=1e-2, timeout=max(120, steps))
    mean = lambda v, i: sum(v[i : i + window]) / len(v[i : i + window])
    ratio = [max(step[-1]) / (sum(step[-1]) / len(step[-1])) for step in moe["loads"]]
    print(
        f"dense: {dense_config(cfg).n_active_params():,} active parameters; MoE: {cfg.n_active_params():,} "
        f"active of {cfg.n_params():,}"
    )
    print("| steps | dense CE | MoE CE | MoE max/mean load |")
    print("|---|---|---|---|")
    for i in range(0, steps, window):
        print(
            f"| {i + 1}-{i + window} | {mean(dense['ce'], i):.3f} | {mean(moe['ce'], i):.3f} | {mean(ratio, i):.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="sequences per global batch (32 tokens each)")
    parser.add_argument("--fp8", action="store_true", help="FP8 dispatch")
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--versus-dense", type=int, metavar="STEPS", help="MoE vs dense instead, for STEPS steps")
    args = parser.parse_args()
    if args.versus_dense:
        versus_dense(args.versus_dense)
        return
    cfg = moe_config()
    k, d, layers = cfg.n_activated_experts, cfg.d_model, cfg.n_layers
    bpe = fp8_bytes_per_element(min(128, d)) if args.fp8 else 4
    print("| ep | step (ms) | a2a time (ms) | model a2a time (ms) | a2a bytes / rank | formula | bandwidth (MB/s) |")
    print("|---|---|---|---|---|---|---|")
    for ep in args.eps:
        r = train_moe(ep, steps=args.steps, batch=args.batch, fp8=args.fp8)
        step = statistics.median(r["seconds"][1:])
        a2a = statistics.median(r["a2a_seconds"][1:])
        tokens = args.batch // ep * cfg.max_seq_len
        if ep == 1:
            print(f"| 1 | {step * 1e3:.1f} | 0 | 0 | 0 | 0 | - |")
            continue
        bw = a2a_bandwidth(ep)
        rows = ep_dispatch_bytes(tokens, d, k, 4)
        formula = layers * (3 * rows + ep_dispatch_bytes(tokens, d, k, bpe) + tokens * k * 8 + ep * 8)
        model = 2 * layers * ep_comm_time(tokens, d, k, bpe, 4, bw, remote_fraction=(ep - 1) / ep)
        print(
            f"| {ep} | {step * 1e3:.1f} | {a2a * 1e3:.1f} | {model * 1e3:.3f} | {r['a2a_bytes'][-1]:.0f} | "
            f"{formula:.0f} | {bw / 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()
