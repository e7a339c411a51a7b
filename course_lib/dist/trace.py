"""A per-rank timeline: when each compute and communication span started and ended.

    with trace.record() as timeline:
        with trace.span("forward"):
            ...
        dist.all_reduce(grad)             # recorded as a "comm" span (course_lib.dist.intercept)
    timeline.spans  # [Span(name="forward", kind="compute", ...), Span(name="all_reduce", kind="comm", ...)]

Every plot of overlap (DDP buckets during backward, pipeline schedules, MoE dispatch) and every
"measured bubble" in the course is read from these spans. Times come from ``time.perf_counter``,
a monotonic clock shared by all processes of one machine, so spans of different ranks can be drawn
on one axis. On a GPU the work is asynchronous, so a span can ask for ``sync=True`` to wait for the
device before reading the clock (a no-op on CPU).

Communication spans of asynchronous collectives end when their ``wait()`` returns: that is when
the rank *knows* the data arrived, which is the moment overlap is about. On a GPU, a collective's
host call and even its ``wait()`` return once the work is queued on the device's stream (NCCL's
``wait`` makes the *compute stream* wait, not the host), so there a comm span measures the enqueue
and carries ``ends="enqueued"`` in its meta; time a collective's transfer with
:func:`course_lib.dist.timing.clock` around it.

Exporting the timelines of all ranks as one Chrome trace-event file is :mod:`course_lib.dist.chrome_trace`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from course_lib.dist import intercept, runtime


@dataclass
class Span:
    name: str
    kind: str  # "compute" or "comm"
    start: float
    end: float
    meta: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    rank: int
    spans: list[Span] = field(default_factory=list)

    def add(self, name: str, kind: str, start: float, end: float, **meta) -> Span:
        s = Span(name, kind, start, end, meta)
        self.spans.append(s)
        return s

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]

    def observe(self, op: str, group: str, nbytes: int, **info):
        """The interception's callback: a comm span that ends when the operation (or its wait) returns.
        ``info``: a point-to-point call's ``peer`` and ``tag``, from which an exported trace draws its arrows."""
        if runtime.device().type != "cpu":
            # A GPU runs the collective on its own stream: the host call (or its wait()) returns once
            # the work is queued, so on a device the span's end marks the enqueue, and says so.
            info = {**info, "ends": "enqueued"}
        s = self.add(op, "comm", now(), now(), group=group, bytes=nbytes, **info)

        def finish() -> None:
            s.end = now()

        return finish


_ACTIVE: list[Timeline] = []


def now() -> float:
    return time.perf_counter()  # host: a span's moments are host moments (sync=True waits for the device first)


def active() -> Timeline | None:
    """The timeline being recorded in this process, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def last_comm_spans() -> list[Span]:
    """The communication span each timeline being recorded got last (for an algorithm to annotate the
    collective it just started, as DDP tags a bucket's all-reduce); empty when nothing records."""
    return [tl.spans[-1] for tl in _ACTIVE if tl.spans and tl.spans[-1].kind == "comm"]


@contextlib.contextmanager
def record():
    """Record every span of this rank until the block ends; yields the :class:`Timeline`."""
    tl = Timeline(runtime.rank())
    _ACTIVE.append(tl)
    try:
        with intercept.observe(tl.observe):
            yield tl
    finally:
        _ACTIVE.remove(tl)


@contextlib.contextmanager
def span(name: str, kind: str = "compute", sync: bool = False, **meta):
    """Time the block as one span (no cost when nothing is recording). Recordings nest: every timeline
    being recorded gets the span, as every one gets the communication spans."""
    if not _ACTIVE:
        yield
        return
    timelines = list(_ACTIVE)
    if sync:
        runtime.synchronize()
    start = now()
    try:
        yield
    finally:
        if sync:
            runtime.synchronize()
        end = now()
        for tl in timelines:
            tl.add(name, kind, start, end, **meta)
