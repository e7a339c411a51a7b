"""course_lib's pipeline runtime beside torch.distributed.pipelining, schedule by schedule (lecture 03,
tests/parallel/pipeline/test_pipeline.py, benchmarks/bench_pipeline.py).

Both get the same stages (``course_lib.parallel.pipeline.stages.split`` of one seeded model), the
same micro-batches and the same loss; each runs one training step; the gradients are compared
tensor by tensor, and each step is timed. torch's schedules of the same shape:

    gpipe        ScheduleGPipe              interleaved  ScheduleInterleaved1F1B
    1f1b         Schedule1F1B               zb-h1        ScheduleInterleavedZeroBubble (1 stage per rank)
    dualpipev    ScheduleDualPipeV
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from course_lib.dist import device, launch, trace
from course_lib.dist.timing import clock
from course_lib.measure.stage_activations import StageActivationMeter
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.pipeline import executor, stages
from course_lib.parallel.pipeline.schedules import build

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
MULTI_STAGE = ("interleaved", "zb-h1", "dualpipev")  # torch's PipelineScheduleMulti: a list of stages


def _step_torch(name, schedule, parts, xs, ys):
    rank = dist.get_rank()
    held = schedule.stages_of(rank)
    pstages = [pipelining.PipelineStage(parts[s], s, schedule.n_stages, device()) for s in held]
    cls = getattr(pipelining, TORCH_SCHEDULES[name])
    arg = pstages if name in MULTI_STAGE else pstages[0]
    pipe = cls(arg, n_microbatches=schedule.m, loss_fn=next_token_loss)
    batch, target = xs.flatten(0, 1), ys.flatten(0, 1)  # torch splits the batch into the m micro-batches
    losses: list = []
    args = (batch,) if 0 in held else ()
    start = clock()
    pipe.step(*args, target=target if schedule.n_stages - 1 in held else None, losses=losses)
    return clock() - start, [loss.item() for loss in losses]


def _compare_rank(name: str, m: int, v: int, config: str, batch: int, seq: int, seed: int, steps: int) -> dict:
    p = dist.get_world_size()
    cfg = configs.get(config, n_layers=p * v)
    schedule = build(name, p, m, v)
    g = torch.Generator().manual_seed(seed + 1)  # host: a CPU generator, so every machine draws the same tokens
    tokens = torch.randint(0, cfg.vocab_size, (m, batch, seq + 1), generator=g).to(device())  # host: drawn by g
    xs, ys = tokens[:, :, :-1].contiguous(), tokens[:, :, 1:].contiguous()
    grads, seconds = {}, {"course_lib": [], "torch": []}
    for who in ("course_lib", "torch"):
        torch.manual_seed(seed)
        parts = stages.split(Transformer(cfg).to(device()), schedule.n_stages)
        mine = {s: parts[s] for s in schedule.stages_of(dist.get_rank())}
        for _ in range(steps):  # the first step of each warms up (torch infers shapes on it)
            for part in mine.values():
                part.zero_grad(set_to_none=True)
            dist.barrier()
            if who == "course_lib":
                start = clock()
                executor.run_step(schedule, mine, xs, ys, next_token_loss, (batch, seq, cfg.d_model))
                seconds[who].append(clock() - start)
            else:
                seconds[who].append(_step_torch(name, schedule, parts, xs, ys)[0])
        grads[who] = {f"s{s}.{n}": p.grad.clone() for s, part in mine.items() for n, p in part.named_parameters()}
    diffs = {k: (grads["course_lib"][k] - grads["torch"][k]).abs().max().item() for k in grads["torch"]}
    return {"diffs": diffs, "seconds": {k: sorted(v[1:])[len(v[1:]) // 2] for k, v in seconds.items()}}


def versus_torch(
    name: str,
    p: int = 2,
    m: int | None = None,
    steps: int = 3,
    seed: int = 0,
    config: str = "tiny",
    batch: int = 2,
    seq: int = 32,
) -> dict:
    """Schedule ``name`` by course_lib and by torch.distributed.pipelining on ``p`` ranks: ``config``
    with p·v blocks, m micro-batches of ``batch`` x ``seq`` tokens, ``steps`` steps each.

    Returns {"diffs": {rank: {parameter: max |course_lib - torch| of its gradient}}, "seconds":
    {"course_lib", "torch"}: rank 0's median step time over ``steps`` - 1 timed steps}.
    """
    v = 2 if name in ("interleaved", "dualpipev") else 1
    m = m or 2 * p
    per_rank = launch(_compare_rank, p, name, m, v, config, batch, seq, seed, steps, timeout=600)
    return {"diffs": dict(enumerate(r["diffs"] for r in per_rank)), "seconds": per_rank[0]["seconds"]}


# ------------------------------------------------------------------ the bubble, measured fairly


class _Sleep(torch.autograd.Function):
    """Identity that takes ``t_f`` seconds forward and ``t_b`` backward without using a core."""

    @staticmethod
    def forward(ctx, x, t_f: float, t_b: float):
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_b)
        return grad, None, None


class SleepStage(torch.nn.Module):
    """A stage whose forward lasts ``t_f`` and backward ``t_b``: equal stages, whatever the cores do.
    Its one weight is made on ``on``, the device the runtime's activations arrive on (the rank's
    :func:`course_lib.dist.device`)."""

    def __init__(self, t_f: float, t_b: float, on: torch.device | str):
        super().__init__()
        self.t_f, self.t_b = t_f, t_b
        self.weight = torch.nn.Parameter(torch.ones(1, device=on))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x.float() * self.weight, self.t_f, self.t_b)


def _bubble_rank(name: str, m: int, v: int, t_f: float, t_b: float) -> dict:
    schedule = build(name, dist.get_world_size(), m, v)
    mine = {s: SleepStage(t_f / v, t_b / v, device()) for s in schedule.stages_of(dist.get_rank())}
    xs = [torch.zeros(1, 1, device=device()) for _ in range(m)]
    dist.barrier()
    with trace.record() as timeline:
        executor.run_step(schedule, mine, xs, xs, lambda y, _t: y.sum(), (1, 1))
    return {"spans": [s for s in timeline.spans if s.kind == "compute"]}


def measured_bubble(
    name: str = "1f1b", p: int = 4, m: int = 8, t_f: float = 0.04, t_b: float = 0.08, trace: str | None = None
) -> dict:
    """The idle share of one step, read from the runtime's trace, with every stage made to take
    ``t_f`` forward and ``t_b`` backward by sleeping: p ranks on fewer cores then do not compete for
    them, and what is measured is the schedule plus the runtime's own overhead. ``trace="x.json"``
    also writes the step as a Chrome trace (ui.perfetto.dev): each rank's F/B spans and its sends
    and receives, with an arrow from each send to its receive.

    Returns {"bubble": 1 - busy / (p · makespan), "spans": per-rank lists of trace Spans}.
    """
    v = 2 if name in ("interleaved", "dualpipev") else 1
    per_rank = launch(_bubble_rank, p, name, m, v, t_f, t_b, timeout=120, trace=trace)
    spans = [r["spans"] for r in per_rank]
    start = min(s.start for r in spans for s in r)
    end = max(s.end for r in spans for s in r)
    busy = sum(s.duration for r in spans for s in r)
    return {"bubble": 1 - busy / (p * (end - start)), "spans": spans}


# ------------------------------------------------------------------ activations in flight


def _memory_rank(name: str, m: int, v: int, batch: int, seq: int, seed: int) -> dict:
    p = dist.get_world_size()
    cfg = configs.get("tiny", n_layers=p * v)
    schedule = build(name, p, m, v)
    torch.manual_seed(seed)
    parts = stages.split(Transformer(cfg).to(device()), schedule.n_stages)
    mine = {s: parts[s] for s in schedule.stages_of(dist.get_rank())}
    g = torch.Generator().manual_seed(seed + 1)  # host: a CPU generator, so every machine draws the same tokens
    tokens = torch.randint(0, cfg.vocab_size, (m, batch, seq + 1), generator=g).to(device())  # host: drawn by g
    meter = StageActivationMeter(mine)
    r = executor.run_step(
        schedule, mine, tokens[:, :, :-1], tokens[:, :, 1:], next_token_loss, (batch, seq, cfg.d_model), observer=meter
    )
    return {"in_flight": r.peak_in_flight, "peak_bytes": meter.peak_bytes, "per_microbatch": meter.bytes_per_microbatch}


def activations_in_flight(
    name: str, p: int = 4, m: int = 8, batch: int = 2, seq: int = 32, seed: int = 0
) -> list[dict]:
    """Per rank, one real step of the course model (``tiny`` with p·v blocks): the most micro-batches
    in flight, the most bytes of saved activations, and the bytes one micro-batch saves per stage."""
    v = 2 if name in ("interleaved", "dualpipev") else 1
    return launch(_memory_rank, p, name, m, v, batch, seq, seed, timeout=120)
