"""DDP's gradient buckets in time: the bucket-size trade-off and one modelled step (lecture 02).

PyTorch DDP (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB, §3.2) all-reduces gradients in buckets, each launched as soon as autograd has
produced it, so communication overlaps the rest of the backward pass. Each bucket is a ring
all-reduce of :mod:`course_lib.cost.alpha_beta`, 2(N-1)·α + 2(N-1)/N·S·β on N = ``world_size`` ranks:

* :func:`bucketed_all_reduce_seconds`: many small buckets pay α again and again, one big bucket
  cannot start before the backward pass ends;
* :func:`ddp_step_timeline`: one step as spans (forward, backward, each bucket's all-reduce, the
  wait, the optimizer) that ``course_lib.plots.data_parallel.ddp_timeline`` draws.

Tested in tests/cost/test_comm_model.py.
"""

from __future__ import annotations

from course_lib.cost.alpha_beta import ring_all_reduce_seconds
from course_lib.dist.trace import Span


def bucketed_all_reduce_seconds(
    total_bytes: int, bucket_bytes: int, world_size: int, alpha: float, beta: float
) -> float:
    """All-reduce ``total_bytes`` as consecutive ring all-reduces of ``bucket_bytes`` (the last one smaller).

    Each bucket pays the ring's 2(N-1)·α again, the bytes cost the same in total: small buckets are
    all latency, one big bucket cannot start before the whole backward is done (Li et al. 2020, §3.2).
    """
    full, rest = divmod(total_bytes, bucket_bytes)
    sizes = [bucket_bytes] * full + ([rest] if rest else [])
    return sum(ring_all_reduce_seconds(s, world_size, alpha, beta) for s in sizes)


def ddp_step_timeline(
    bucket_bytes: list[int],
    backward_seconds: list[float],
    forward_seconds: float,
    optimizer_seconds: float,
    world_size: int,
    alpha: float,
    beta: float,
    overlap: bool,
) -> list[Span]:
    """One modelled DDP step on one rank, as spans that ``plots.data_parallel.ddp_timeline`` draws.

    ``bucket_bytes[k]`` is bucket k in launch order; ``backward_seconds[k]`` the autograd time that
    produces its gradients. One communication channel: bucket k starts when it is complete (with
    ``overlap``; after the whole backward without) and when bucket k-1 has finished. The optimizer
    runs once autograd and every all-reduce are done (Li et al. 2020, DDP's overlap).
    """
    if len(bucket_bytes) != len(backward_seconds):
        raise ValueError("one backward time per bucket: backward_seconds[k] produces bucket k")
    spans = [Span("forward", "compute", 0.0, forward_seconds)]
    t, ready = forward_seconds, []
    for seconds in backward_seconds:
        t += seconds
        ready.append(t)
    backward_end = t
    spans.append(Span("backward", "compute", forward_seconds, backward_end))
    free = 0.0
    for k, nbytes in enumerate(bucket_bytes):
        start = max(ready[k] if overlap else backward_end, free)
        free = start + ring_all_reduce_seconds(nbytes, world_size, alpha, beta)
        spans.append(Span("all_reduce", "comm", start, free, {"bucket": k, "bytes": nbytes}))
    if free > backward_end:
        spans.append(Span("ddp.wait", "compute", backward_end, free))
    end = max(free, backward_end)
    spans.append(Span("optimizer", "compute", end, end + optimizer_seconds))
    return spans
