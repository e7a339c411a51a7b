"""Decode tokens/s with no cache, the contiguous cache and the paged cache as the context grows.

    .venv/bin/python benchmarks/bench_kv_cache.py                      # small model, contexts 32..960
    .venv/bin/python benchmarks/bench_kv_cache.py --model tiny --contexts 64 256 --new-tokens 16

course_lib.experiments.lecture06.decode_speed.decode_speed times ``--new-tokens`` decoding steps after a prompt of each
length (prefill not timed), best of ``--repeats``, the three paths interleaved per context so a noisy
neighbour slows them alike. The plot goes to build/bench_kv_cache.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch

from course_lib.experiments.lecture06.decode_speed import decode_speed
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.plots import inference as plots

ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32, 128, 256, 512, 960])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Transformer(configs.get(args.model, max_seq_len=max(args.contexts) + args.new_tokens)).eval()
    speeds = decode_speed(model, args.contexts, args.new_tokens, repeats=args.repeats)
    print(f"{args.model}, {torch.get_num_threads()} threads: decode tokens/s after a prompt of each length")
    print(f"{'context':>8}" + "".join(f"{'no cache' if c is None else c:>12}" for c in speeds) + f"{'paged/none':>12}")
    for i, n in enumerate(args.contexts):
        row = "".join(f"{v[i]:>12.0f}" for v in speeds.values())
        print(f"{n:>8}{row}{speeds['paged'][i] / speeds[None][i]:>12.1f}")
    ax = plots.decode_speed(args.contexts, speeds)
    (ROOT / "build").mkdir(exist_ok=True)
    ax.figure.savefig(ROOT / "build" / "bench_kv_cache.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
