"""Run a schedule's action lists on paper: a timeline from per-action costs, with no model.

Each rank walks its list in order. A compute action starts when the rank is free and takes
``cost[op]`` seconds (a dict, or a callable ``cost(op, stage)``); a send costs the sender nothing
and its message arrives ``link`` seconds after it is sent; a receive waits for its message. If no
rank can move and some have actions left, the schedule would deadlock: :class:`Deadlock` says
which rank waits on what. The spans are :class:`course_lib.dist.trace.Span`, the same type the
executor records, so one plot draws both.

    sim = simulate(build("1f1b", p=4, m=8), {"F": 1.0, "B": 2.0})
    sim.bubble_fraction()        # (p - 1) / (m + p - 1) = 3/11 for equal stages
    sim.peak_in_flight()         # [4, 3, 2, 1]: micro-batches whose activations each rank holds

Tested in tests/parallel/pipeline/test_pipeline.py (bubble and in-flight counts against cost/pipeline.py's formulas,
deadlocks named) and by course_lib/grading/labs/lab05_pipeline.py's checks, via tests/grading/test_lab_checks.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from course_lib.dist.trace import Span
from course_lib.parallel.pipeline.schedules import COMPUTE, RECV_B, RECV_F, SEND_B, SEND_F, B, F, Schedule, W


class Deadlock(RuntimeError):
    """No rank can take its next action, and some have actions left."""


@dataclass
class Simulation:
    schedule: Schedule
    spans: list[list[Span]]  # per rank, compute spans named "F", "B", "I", "W" with meta mb/stage

    @property
    def makespan(self) -> float:
        return max(s.end for spans in self.spans for s in spans)

    def bubble_fraction(self) -> float:
        """Share of p x step time that ranks spend idle: 1 - busy / (p · makespan)."""
        busy = sum(s.duration for spans in self.spans for s in spans)
        return 1.0 - busy / (self.schedule.p * self.makespan)

    def peak_in_flight(self) -> list[int]:
        """Per rank, the most (micro-batch, stage) activations held at once: from F until B (or W)."""
        return peak_in_flight(self.schedule)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most (micro-batch, stage) pairs whose forward has run and whose last backward
    (B, or W when split) has not: what the rank must keep for the backward pass."""
    peaks = []
    for rank in range(schedule.p):
        held = peak = 0
        for a in schedule.compute(rank):
            held += 1 if a.op == F else -1 if a.op in (B, W) else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def simulate(
    schedule: Schedule, cost: Mapping[str, float] | Callable[[str, int], float], link: float = 0.0
) -> Simulation:
    """Play ``schedule`` with ``cost`` per compute action and ``link`` seconds per message."""
    price = cost if callable(cost) else (lambda op, stage: cost[op])
    arrived: dict[tuple, float] = {}  # (kind, micro-batch, producing stage) -> arrival time
    clock = [0.0] * schedule.p
    at = [0] * schedule.p
    spans: list[list[Span]] = [[] for _ in range(schedule.p)]
    while any(at[r] < len(schedule.actions[r]) for r in range(schedule.p)):
        moved = False
        for r in range(schedule.p):
            while at[r] < len(schedule.actions[r]):
                a = schedule.actions[r][at[r]]
                if a.op in (RECV_F, RECV_B):
                    key = (a.op[-1], a.microbatch, a.stage + (-1 if a.op == RECV_F else 1))
                    if key not in arrived:
                        break  # blocked until the sender gets there
                    clock[r] = max(clock[r], arrived.pop(key))
                elif a.op in (SEND_F, SEND_B):
                    arrived[(a.op[-1], a.microbatch, a.stage)] = clock[r] + link
                elif a.op in COMPUTE:
                    start = clock[r]
                    clock[r] += price(a.op, a.stage)
                    spans[r].append(Span(a.op, "compute", start, clock[r], {"mb": a.microbatch, "stage": a.stage}))
                at[r] += 1
                moved = True
        if not moved:
            waiting = {
                r: repr(schedule.actions[r][at[r]]) for r in range(schedule.p) if at[r] < len(schedule.actions[r])
            }
            raise Deadlock(
                f"schedule {schedule.name!r} (p={schedule.p}, m={schedule.m}) deadlocks: rank -> the receive it waits on: {waiting}"
            )
    return Simulation(schedule, spans)
