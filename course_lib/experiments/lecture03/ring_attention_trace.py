"""One traced ring-attention forward and backward on N ranks, for lecture 03's overlap timeline.

Tested in tests/lectures/test_lecture03.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.dist import device, launch, trace
from course_lib.parallel.context import ring_attention as ra


def _traced_rank(batch, n_heads, n_kv_heads, seq_len, head_dim, layout, seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)  # host: the same full tensors on every rank; each keeps its shard
    # host: drawn on the CPU generator above; each rank moves its shard to its device below
    full = [torch.randn(batch, h, seq_len, head_dim, generator=g) for h in (n_heads, n_kv_heads, n_kv_heads)]
    q, k, v = (ra.shard(t, rank, world, layout).to(device()).requires_grad_() for t in full)
    for _ in range(2):  # the first pass warms up allocator and caches; the second is the one returned
        q.grad = k.grad = v.grad = None
        dist.barrier()
        with trace.record() as tl:
            out = ra.ring_attention(q, k, v, layout=layout)
            out.sum().backward()
    return tl.spans


def trace_ring_attention(
    world_size: int = 4,
    batch: int = 1,
    n_heads: int = 8,
    n_kv_heads: int = 4,
    seq_len: int = 1024,
    head_dim: int = 64,
    layout: str = "zigzag",
    seed: int = 0,
    trace: str | None = None,
) -> list[list]:
    """Run causal ring attention forward and backward on ``world_size`` ranks; return each rank's spans.

    Compute spans "ring.forward block" / "ring.backward block" (``meta["step"]``) come from
    ``course_lib.parallel.context.ring_attention``; every isend/irecv is a "comm" span from posting to
    its ``wait()``. Times are seconds of a clock the ranks share (``course_lib.dist.trace``): draw them
    on one axis with ``course_lib.plots.context_parallel.ring_timeline``. ``trace="x.json"`` also writes
    both passes of every rank as one Chrome trace (ui.perfetto.dev), an arrow from each K/V send to its
    receive.
    """
    return launch(
        _traced_rank, world_size, batch, n_heads, n_kv_heads, seq_len, head_dim, layout, seed, timeout=120, trace=trace
    )
