"""Time gloo's ring all-reduce, for lecture 02's comparison with the alpha-beta model.

Two measurements on ``world_size`` ranks: single all-reduces of growing size (to fit α and β with
:func:`course_lib.cost.alpha_beta.fit_alpha_beta`), and one gradient buffer all-reduced in buckets of
several sizes (the bucket-size sweep, against :func:`course_lib.cost.ddp_timeline.bucketed_all_reduce_seconds`).
Wall-clock figures: they depend on the machine and its load, so a lecture prints them only in
lines that ``lectures/sanitize.cfg`` replaces.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from course_lib.dist import device, launch
from course_lib.dist.timing import clock


def _median_seconds(tensors, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = clock()
        for t in tensors:
            dist.all_reduce(t)
        samples.append(clock() - start)  # clock() waits for the device: the all-reduces have finished
    return statistics.median(samples)


def _time_rank(sizes, total_bytes, bucket_sizes, repeats):
    dev = device()
    dist.all_reduce(torch.zeros(1024, device=dev))  # warm-up: the first collective sets up the connections
    single = {s: _median_seconds([torch.zeros(s // 4, device=dev)], repeats) for s in sizes}
    grads = torch.zeros(total_bytes // 4, device=dev)
    bucketed = {cap: _median_seconds(list(grads.split(cap // 4)), repeats) for cap in bucket_sizes}
    return single, bucketed


def time_all_reduce(
    world_size: int, sizes: list[int], total_bytes: int, bucket_sizes: list[int], repeats: int = 5
) -> dict:
    """Median seconds of fp32 all-reduces: {"single": {bytes: s}, "bucketed": {bucket bytes: s}}.

    A collective completes on all ranks together, so each figure is the slowest rank's median.
    ``bucketed[cap]`` all-reduces a ``total_bytes`` buffer as consecutive buckets of ``cap`` bytes.
    """
    results = launch(_time_rank, world_size, sizes, total_bytes, bucket_sizes, repeats, timeout=120)
    return {
        "single": {s: max(r[0][s] for r in results) for s in sizes},
        "bucketed": {c: max(r[1][c] for r in results) for c in bucket_sizes},
    }
