"""Step time of course_lib.parallel.data.ddp against torch's DistributedDataParallel, side by side in one run.

    .venv/bin/python benchmarks/bench_ddp.py                       # 2 and 4 ranks, tiny and small
    .venv/bin/python benchmarks/bench_ddp.py --worlds 2 --models tiny --repeats 3

Every rank builds one model and wraps two copies of it, one in each DDP, with the same bucket
cap (so both end with the same buckets) and the same per-step work (torch with
``forward_sync_buffers=False``, see below). A step is forward + backward + AdamW on this rank's
shard. Repeats interleave the two (ours first on even repeats, torch first on odd ones), each
repeat timing ``--steps`` steps after a barrier, so a noisy neighbour on the machine slows both
alike; the figure is the ratio of medians over repeats. The bucket caps: 25 MiB (torch's default:
one bucket for these models) and a small cap that gives several buckets, where the Python-side
hooks of course_lib run more often.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course_lib import data
from course_lib.dist import device, launch
from course_lib.dist.timing import clock
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.data.ddp import DistributedDataParallel, split_batch

SHAPES = {"tiny": (8, 64), "small": (8, 128)}  # global batch, sequence length


def _rank(model_name: str, cap_mb: float, steps: int, repeats: int, warmup: int):
    torch.manual_seed(0)
    cfg = configs.get(model_name)
    dev = device()
    base = Transformer(cfg).to(dev)
    models = {
        "course_lib": DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap_mb),
        # forward_sync_buffers=False: both broadcast buffers once, at construction; torch's
        # default re-broadcasts them before every forward (for BatchNorm statistics), an extra
        # collective per step that the course model's constant buffers do not need.
        "torch": TorchDDP(copy.deepcopy(base), bucket_cap_mb=cap_mb, forward_sync_buffers=False),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    batch, seq = SHAPES[model_name]
    ds = data.make_dataset(data.MarkovLanguage(), batch * seq * 4 + 1, seq, seed=0)
    r, w = dist.get_rank(), dist.get_world_size()
    batches = [tuple(split_batch(t, r, w).to(dev) for t in b) for b in ds.batches(batch, seed=0)]

    def run(name: str, n: int) -> float:
        model, opt = models[name], opts[name]
        dist.barrier()
        start = clock()
        for i in range(n):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            next_token_loss(model(x), y).backward()
            opt.step()
        return (clock() - start) / n  # clock() waits for the device to finish the n steps

    for name in models:  # warm-up; also lets torch rebuild its buckets after its first iteration
        run(name, warmup)
    times = {name: [] for name in models}
    for rep in range(repeats):
        order = list(models) if rep % 2 == 0 else list(models)[::-1]
        for name in order:
            times[name].append(run(name, steps))
    n_buckets = len(models["course_lib"].buckets)
    return {name: statistics.median(t) for name, t in times.items()}, n_buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(SHAPES))
    parser.add_argument("--caps", type=float, nargs="+", default=[25.0, 0.25])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    print("| model | ranks | bucket cap (MiB) | buckets | course_lib (ms/step) | torch DDP (ms/step) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for model_name in args.models:
        for world in args.worlds:
            for cap in args.caps:
                results = launch(_rank, world, model_name, cap, args.steps, args.repeats, args.warmup, timeout=600)
                # a step ends for everyone when the slowest rank ends: take the slowest rank's median
                ours = max(r[0]["course_lib"] for r in results)
                theirs = max(r[0]["torch"] for r in results)
                print(
                    f"| {model_name} | {world} | {cap:g} | {results[0][1]} | {ours * 1e3:.1f} | "
                    f"{theirs * 1e3:.1f} | {ours / theirs:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
