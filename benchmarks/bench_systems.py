"""Lectures 07 and 08 on this machine: its roofline, gloo's fitted alpha-beta figures, and what a sharded
checkpoint costs to write.

    .venv/bin/python benchmarks/bench_systems.py
    .venv/bin/python benchmarks/bench_systems.py --repeats 15 --save-rounds 5

* the CPU roofline: peak fp32 GEMM FLOP/s and STREAM copy/triad bandwidth (course_lib.measure.cpu_roofline),
  with the measured kernels' fraction of their roof;
* α and β of each collective at 2 gloo ranks, fitted (relative least squares) to every size from 16 B
  to 24 MiB (course_lib.measure.collective_timing), and the worst held-out error of the lecture's split;
* seconds to write and verify one atomic, checksummed DCP checkpoint of the tiny model's ZeRO-2 state
  at 2 ranks (course_lib.checkpoint), the C of Young's interval, median of ``--save-rounds``.
Wall-clock figures: they depend on the machine and its load; BENCHMARKS.md records them with the date.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from course_lib.checkpoint import commit, sharded
from course_lib.checkpoint.zero_state import zero_state_dict
from course_lib.cost.alpha_beta import fit_alpha_beta
from course_lib.dist import device, launch
from course_lib.dist.timing import clock
from course_lib.measure.collective_timing import held_out_errors, time_collectives
from course_lib.measure.cpu_roofline import measure_cpu_roofline
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.data.zero import Zero


def _save_seconds(root: str, rounds: int) -> list[float]:
    torch.manual_seed(0)
    model = Transformer(configs.get("tiny")).to(device())  # Zero keeps its shards on device()
    zero = Zero(model, stage=2, lr=1e-3)
    state = zero_state_dict(zero)
    out = []
    for step in range(rounds):
        torch.distributed.barrier()
        start = clock()
        path = sharded.save(root, step, state, keep=2)
        commit.verify_collective(path)
        torch.distributed.barrier()
        out.append(clock() - start)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--save-rounds", type=int, default=5)
    args = parser.parse_args()

    roof = measure_cpu_roofline()
    print(
        f"CPU roofline ({roof.threads} threads, fp32): peak {roof.peak_flops_per_second / 1e9:.1f} GFLOP/s, "
        f"copy {roof.copy_bytes_per_second / 1e9:.1f} GB/s, triad {roof.triad_bytes_per_second / 1e9:.1f} GB/s, "
        f"ridge {roof.roofline.ridge_point:.1f} FLOP/byte"
    )
    for m in roof.kernels:
        attainable = roof.roofline.attainable(m.kernel.intensity)
        print(
            f"  {m.kernel.name:<24} I = {m.kernel.intensity:8.2f}  {m.flops_per_second / 1e9:7.1f} GFLOP/s "
            f"= {m.flops_per_second / attainable:4.0%} of its roof"
        )

    measured = time_collectives(2, repeats=args.repeats)
    print(
        f"gloo, 2 ranks, {args.repeats} repeats: alpha-beta fitted to all sizes; worst held-out error of the 11/5 split"
    )
    _, held_out, _ = held_out_errors(measured)
    for name, times in measured.items():
        sizes = sorted(times)
        alpha, beta = fit_alpha_beta(sizes, [times[s] for s in sizes], 2, collective=name, relative=True)
        worst = max(held_out[name].values(), key=abs)
        print(
            f"  {name:<16} alpha {alpha * 1e6:7.1f} us   1/beta {1 / beta / 1e9:6.2f} GB/s   held-out worst {worst:+.2f}"
        )

    with tempfile.TemporaryDirectory(prefix="bench-systems-") as root:
        seconds = launch(_save_seconds, 2, root, args.save_rounds, timeout=300)
    per_round = [max(r[i] for r in seconds) for i in range(args.save_rounds)]
    print(
        f"atomic DCP checkpoint of tiny ZeRO-2 at 2 ranks (save + manifest + rename + verify): "
        f"median {statistics.median(per_round) * 1e3:.0f} ms over {args.save_rounds}"
    )


if __name__ == "__main__":
    main()
