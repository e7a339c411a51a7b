"""Measured next to predicted: one training step of each ZeRO stage on N ranks — the bars of lecture 02.

Bytes held come from :func:`course_lib.dist.census.held_bytes` (via ``Zero.model_state_bytes``),
bytes moved from :mod:`course_lib.dist.counter`; the formulas from :mod:`course_lib.cost.memory`
and :mod:`course_lib.cost.collective_bytes`. :func:`zero3_step_memory` adds what the census of persistent
states leaves out: the allocator's timeline through one ZeRO-3 step, with its transient gathers.

Tested in tests/measure/test_memory.py.
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist
from torch.profiler import record_function

from course_lib.cost.collective_bytes import ring_wire_bytes, zero_comm_bytes
from course_lib.cost.memory import STAGES, zero3_gathered_peak_bytes, zero_model_state_bytes
from course_lib.dist import counter, device, launch
from course_lib.measure.allocations import AllocationTrace
from course_lib.measure.saved_tensors import SavedTensorMeter
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.data.zero import Zero


def _measure_rank(config: str, precision: str, stages, seed: int, batch: int, seq: int) -> dict:

    out = {}
    for stage in stages:
        torch.manual_seed(seed)
        model = Transformer(configs.get(config)).to(device())
        zero = Zero(model, stage, lr=1e-3, precision=precision)
        g = torch.Generator().manual_seed(seed + dist.get_rank())  # host: the same tokens on every machine
        x = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), generator=g).to(device())  # host: drawn by g
        with counter.count() as c:
            model.loss(x[:, :-1], x[:, 1:]).backward()
            zero.step()
        out[stage] = {
            "state": zero.model_state_bytes(),
            "counts": c.as_dict(),
            "n_params": sum(u.numel for u in zero.units),
        }
    return out


def measured_state_bytes(world_size: int = 2, config: str = "tiny", precision: str = "bf16") -> dict[int, tuple]:
    """{stage: (measured bytes of model states on rank 0, formula)} — one bar pair per stage."""
    return {s: (m["state_bytes"], m["state_formula"]) for s, m in measure_stages(world_size, config, precision).items()}


def measured_comm_bytes(world_size: int = 2, config: str = "tiny", precision: str = "bf16") -> dict[int, tuple]:
    """{stage: (measured ring bytes rank 0 moves in one step, formula)} — one bar pair per stage."""
    return {s: (m["comm_bytes"], m["comm_formula"]) for s, m in measure_stages(world_size, config, precision).items()}


def measure_stages(
    world_size: int = 2,
    config: str = "tiny",
    precision: str = "bf16",
    stages=STAGES,
    seed: int = 0,
    batch: int = 2,
    seq: int = 16,
) -> dict[int, dict]:
    """Run one training step of each stage on ``world_size`` ranks; measurement next to formula.

    Returns {stage: {"n_params", "state_bytes" (rank 0's census), "state_bytes_per_rank",
    "state_formula", "state_breakdown" (params/grads/optimizer), "comm_bytes" (rank 0, ring wire
    bytes from the counter), "comm_bytes_per_rank", "comm_formula"}} — the numbers for a bar chart.
    """
    per_rank = launch(_measure_rank, world_size, config, precision, tuple(stages), seed, batch, seq, timeout=120)
    width = {"fp32": dict(k=8, param_bytes=4, grad_bytes=4), "bf16": dict(k=12, param_bytes=2, grad_bytes=2)}[precision]
    result = {}
    for stage in stages:
        psi = per_rank[0][stage]["n_params"]
        comm = [ring_wire_bytes(r[stage]["counts"], world_size) for r in per_rank]
        result[stage] = {
            "n_params": psi,
            "state_bytes": per_rank[0][stage]["state"]["total"],
            "state_bytes_per_rank": [r[stage]["state"]["total"] for r in per_rank],
            "state_breakdown": {k: v for k, v in per_rank[0][stage]["state"].items() if k != "total"},
            "state_formula": zero_model_state_bytes(psi, world_size, stage, **width),
            "comm_bytes": comm[0],
            "comm_bytes_per_rank": comm,
            "comm_formula": zero_comm_bytes(psi, world_size, stage, width["param_bytes"]),
        }
    return result


# ------------------------------------------------------------------ ZeRO-3's transient memory

PHASES = ("forward", "backward", "optimizer step")


def _gathered_events(trace: AllocationTrace) -> list:
    """The allocations of gathered parameter buffers, and their frees, in time order.

    An allocation made inside a "ZeRO-3 all-gather" range is the gathered buffer when the free
    that returns it falls inside a "ZeRO-3 free" range; anything else allocated there (a
    communication library's scratch space) is freed elsewhere and is left out.
    """
    gathers, frees = trace.ranges("ZeRO-3 all-gather "), trace.ranges("ZeRO-3 free ")
    keep = []
    for i, e in enumerate(trace.events):
        if e.nbytes > 0 and any(e.t_us in r for r in gathers):
            j = trace.matching_free(i)
            if j is None or any(trace.events[j].t_us in r for r in frees):
                keep += [i] if j is None else [i, j]
    return [trace.events[i] for i in sorted(keep)]


def _zero3_rank(config: str, prefetches, seed: int, batch: int, seq: int) -> dict:
    out = {}
    for prefetch in prefetches:
        torch.manual_seed(seed)
        model = Transformer(configs.get(config)).to(device())
        zero = Zero(model, 3, lr=1e-3, precision="bf16", prefetch=prefetch)
        g = torch.Generator().manual_seed(seed + dist.get_rank())  # host: the same tokens on every machine
        x = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), generator=g).to(device())  # host: drawn by g
        model.loss(x[:, :-1], x[:, 1:]).backward()  # warm-up: records the order prefetch follows
        zero.step()
        zero.zero_grad()
        dist.barrier()
        with AllocationTrace(device()) as trace:
            with record_function("forward"), SavedTensorMeter(exclude=model) as saved:
                loss = model.loss(x[:, :-1], x[:, 1:])
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer step"):
                zero.step()
                zero.zero_grad()
        gathered = _gathered_events(trace)
        # The x axis is the allocator's event count, not wall time: a profiler's first run in a process
        # spends hundreds of ms warming up, and 2 shared cores stretch time unevenly; the order is the story.
        times, allocated = trace.curve()
        step = list(range(1, len(times) + 1))

        g_times, g_bytes = trace.curve(gathered)
        out[prefetch] = {
            "unit_bytes": [u.padded * zero.dtype.itemsize for u in zero.order],
            "units": [u.name for u in zero.order],
            "persistent": zero.model_state_bytes()["total"],
            "activations": saved.bytes,
            "peak": trace.peak(),
            "gathered_peak": max([0, *g_bytes]),
            "gathers": sum(e.nbytes > 0 for e in gathered),
            "allocated_curve": (step, allocated),
            "gathered_curve": ([bisect.bisect_right(times, t) for t in g_times], g_bytes),
            "phases": {
                r.name: (bisect.bisect_right(times, r.start_us) + 0.5, bisect.bisect_right(times, r.end_us) + 0.5)
                for r in trace.ranges()
                if r.name in PHASES
            },
        }
    return out


def zero3_step_memory(
    world_size: int = 2, config: str = "tiny", prefetches=(0, 1), seed: int = 0, batch: int = 2, seq: int = 32
) -> dict[int, dict]:
    """The allocator's timeline through one bf16 ZeRO-3 step on rank 0, for each prefetch depth.

    Returns {prefetch: {"unit_bytes" (gathered bytes per unit, execution order), "units",
    "persistent" (the census of model states: (2 + 2 + 12)Ψ/N), "activations" (bytes autograd saved
    in the forward pass), "peak" (the most bytes allocated at once during the step, above what was
    held before it: activations, gathered parameters, gradients and scratch), "gathered_peak" (the
    most bytes of gathered parameters at once) and its formula "gathered_formula", "gathers"
    (all-gathers in the step, every rank), "allocated_curve" and "gathered_curve" ((allocator
    event number, bytes)), "phases" ({name: (first, last event number)})}}.
    """
    per_rank = launch(_zero3_rank, world_size, config, tuple(prefetches), seed, batch, seq, timeout=120)
    result = {}
    for prefetch, m in per_rank[0].items():
        m["gathered_peak_per_rank"] = [r[prefetch]["gathered_peak"] for r in per_rank]
        m["gathers_per_rank"] = [r[prefetch]["gathers"] for r in per_rank]
        m["gathered_formula"] = zero3_gathered_peak_bytes(m["unit_bytes"], prefetch)
        result[prefetch] = m
    return result
