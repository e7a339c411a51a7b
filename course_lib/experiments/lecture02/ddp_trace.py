"""One traced DDP training step on N ranks, for lecture 02's overlap timeline.

Used again by lecture 08a. Tested in tests/parallel/data/test_ddp.py and tests/dist/test_trace_export.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.dist import device, launch, trace
from course_lib.experiments import small_run
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.data.ddp import DistributedDataParallel, split_batch


def _traced_rank(config: str, bucket_cap_mb: float, global_batch: int, seq_len: int, seed: int):

    torch.manual_seed(seed)
    cfg = configs.get(config)
    dev = device()
    model = DistributedDataParallel(Transformer(cfg).to(dev), bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the same global batch on every rank: the first of a stream of two
    [(x, y)] = small_run.batches(1, global_batch, seq_len, seed, stream_batches=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = split_batch(x, rank, world).to(dev), split_batch(y, rank, world).to(dev)
    for _ in range(2):  # step 0 warms up allocator and caches; step 1 is the one returned
        opt.zero_grad()
        dist.barrier()
        with trace.record() as tl:
            # sync=True: each span ends when the device has finished its work (a no-op on CPU)
            with trace.span("forward", sync=True):
                loss = model.module.loss(x, y)
            with trace.span("backward", sync=True):
                loss.backward()
            with trace.span("optimizer", sync=True):
                opt.step()
    origin = min(s.start for s in tl.spans)
    return tl.spans, origin, model.bucket_names()


def trace_step(
    world_size: int = 2,
    config: str = "tiny",
    bucket_cap_mb: float = 0.05,
    global_batch: int = 8,
    seq_len: int = 32,
    seed: int = 0,
    trace: str | None = None,
    profile: bool = False,
) -> dict:
    """Run one DDP training step on ``world_size`` ranks and return its per-rank timeline.

    ``trace="x.json"`` also writes both steps of every rank as one Chrome trace (ui.perfetto.dev), with
    torch.profiler's aten and autograd ops merged in when ``profile=True``.

    Returns ``{"spans": [[Span, ...] per rank], "origin": t0, "buckets": [[names] per bucket]}``.
    Spans: "forward", "backward", "ddp.wait", "optimizer" (kind "compute") and one "all_reduce"
    (kind "comm") per bucket, with ``meta["bucket"]``, ``meta["bytes"]`` and ``meta["done"]``, the
    moment the all-reduce completed (the span's end is when finish() waited for it). "backward"
    encloses "ddp.wait": autograd's own work is [backward.start, ddp.wait.start]. Times are seconds
    of a clock shared by the ranks: subtract ``origin`` and draw every rank on one axis.
    """

    results = launch(
        _traced_rank,
        world_size,
        config,
        bucket_cap_mb,
        global_batch,
        seq_len,
        seed,
        timeout=120,
        trace=trace,
        profile=profile,
    )
    origin = min(r[1] for r in results)
    return {"spans": [r[0] for r in results], "origin": origin, "buckets": results[0][2]}
