"""What the allocator handed out, over time: torch.profiler's memory events read back as a curve.

``torch.profiler.profile(profile_memory=True)`` records one event for every allocation and every
free, on the CPU as on a GPU, with its size, its address and its time, and it records the ranges
that code labels with ``torch.profiler.record_function``. That is the one memory timeline that works
on both kinds of device (``torch.cuda.max_memory_allocated`` and memory snapshots exist only for
CUDA), so the course uses it on both. Lecture 02 reads ZeRO-3's peak off it.

    with AllocationTrace(device) as trace:
        ...                                     # one training step
    times, allocated = trace.curve()            # bytes allocated since the trace began
    trace.peak(), trace.ranges("ZeRO-3 all-gather ")

Bytes allocated before the trace began are not seen; ``curve`` starts at 0 and may dip below it
when such a tensor is freed.

Tested in tests/measure/test_memory.py.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# How the profiler's trace names device types ("Device Type" in a memory event's args).
_DEVICE_TYPE = {"cpu": 0, "cuda": 1}


@dataclass(frozen=True)
class Event:
    """One allocation (``nbytes`` > 0) or free (``nbytes`` < 0) at ``t_us`` microseconds."""

    t_us: float
    nbytes: int
    addr: int


@dataclass(frozen=True)
class Range:
    """A ``record_function`` label and the span it covered."""

    name: str
    start_us: float
    end_us: float

    def __contains__(self, t_us: float) -> bool:
        return self.start_us <= t_us <= self.end_us


class AllocationTrace:
    """Allocations and frees on ``device`` while the context is open, in time order."""

    def __init__(self, device: torch.device | str):
        kind = torch.device(device).type
        if kind not in _DEVICE_TYPE:
            raise ValueError(f"AllocationTrace reads CPU and CUDA allocations; got device {device!r}")
        self._device_type = _DEVICE_TYPE[kind]
        # Kineto (the profiler's backend) in this torch prints a timestamped line at every start and
        # stop, above its ERROR level; level 6 keeps them out of notebook outputs. Read at its first use.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == "cuda" else [])
        self._profile = profile(activities=activities, profile_memory=True)
        self.events: list[Event] = []
        self._ranges: list[Range] = []

    def __enter__(self) -> AllocationTrace:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        if exc[0] is not None:
            return
        # The addresses are only in the exported trace (the in-memory events carry sizes, not addresses).
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            self._profile.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())["traceEvents"]
        for e in trace:
            args = e.get("args", {})
            if e.get("name") == "[memory]" and args.get("Device Type") == self._device_type:
                self.events.append(Event(float(e["ts"]), int(args["Bytes"]), int(args["Addr"])))
            elif e.get("cat") == "user_annotation" and e.get("ph") == "X":
                self._ranges.append(Range(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        self.events.sort(key=lambda e: e.t_us)
        self._ranges.sort(key=lambda r: r.start_us)

    def ranges(self, prefix: str = "") -> list[Range]:
        """The labelled ranges whose name starts with ``prefix``, in time order."""
        return [r for r in self._ranges if r.name.startswith(prefix)]

    def curve(self, events: list[Event] | None = None) -> tuple[list[float], list[int]]:
        """(times in µs, bytes allocated since the trace began) after each of ``events`` (default all)."""
        times, total, level = [], [], 0
        for e in self.events if events is None else events:
            level += e.nbytes
            times.append(e.t_us)
            total.append(level)
        return times, total

    def peak(self) -> int:
        """The most bytes allocated at once, above where the trace began."""
        return max([0, *self.curve()[1]])

    def matching_free(self, i: int) -> int | None:
        """Index of the event that frees allocation ``i`` (the next free at its address), or None."""
        alloc = self.events[i]
        for j in range(i + 1, len(self.events)):
            e = self.events[j]
            if e.addr == alloc.addr and e.nbytes < 0:
                return j
        return None
