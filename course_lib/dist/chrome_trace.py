"""Export the per-rank timelines of :mod:`course_lib.dist.trace` as one Chrome trace-event file.

The timelines of all ranks (:func:`to_chrome`, :func:`write`, :func:`write_from_ranks`) become one
JSON file in the Chrome trace-event format ("Trace Event Format", Google, the format
``chrome://tracing`` and Perfetto's ui.perfetto.dev open; torch.profiler writes it too):

* a *process* per rank (``pid`` = rank) and a *thread* per lane: ``compute`` and one
  ``comm: <group>`` per process group, as ``"M"`` metadata events naming them;
* a complete event (``"ph": "X"``, ``ts`` and ``dur`` in microseconds from the earliest span) per
  span, its ``args`` the span's meta (bytes, group, peer, bucket, micro-batch, stage);
* a flow (``"ph": "s"`` at the send, ``"ph": "f"`` at its receive, one ``id``) from each
  point-to-point send to the receive that matched it: the k-th message from rank a to rank b with
  a given tag is the k-th receive on b from a with that tag (gloo and NCCL deliver a pair's
  messages in order).

Complete events on one thread must nest; asynchronous collectives overlap each other, so a lane
whose spans overlap without nesting is split into numbered sub-lanes (``comm: world #2``). With
``profiles``, the Chrome traces torch.profiler wrote on the same ranks are merged in, their clock
moved onto ours through a marker event both recorded (:func:`profile`). :func:`check_chrome`
validates a file. Tested in tests/dist/test_trace_export.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.dist.trace import Span, Timeline, now, record

SENDS, RECVS = ("send", "isend"), ("recv", "irecv")
TIME_META = ("done",)  # span meta that are moments of our clock (DDP's "all-reduce completed"): µs on the axis
CLOCK_MARKER = "course_lib.clock"  # the event that aligns torch.profiler's clock with ours (profile())


def _lane(span: Span) -> str:
    return "compute" if span.kind == "compute" else f"comm: {span.meta.get('group', 'world')}"


def _jsonable(value):
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def _sub_lanes(spans: list[Span]) -> list[int]:
    """For spans of one lane, the sub-lane of each such that spans on a sub-lane are disjoint or nested
    (what complete events on one thread must be): greedy in order of start, longest first on ties."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start, -spans[i].end))
    open_ends: list[list[float]] = []  # per sub-lane: the ends of the spans still open, innermost last
    where = [0] * len(spans)
    for i in order:
        s = spans[i]
        for k, stack in enumerate(open_ends):
            while stack and stack[-1] <= s.start:
                stack.pop()
            if not stack or s.end <= stack[-1]:
                stack.append(s.end)
                where[i] = k
                break
        else:
            open_ends.append([s.end])
            where[i] = len(open_ends) - 1
    return where


def _ranks(timelines) -> list[tuple[int, list[Span]]]:
    """(rank, spans) for Timelines, or for lists of spans (the list's position is the rank)."""
    out = []
    for i, t in enumerate(timelines):
        out.append((t.rank, list(t.spans)) if isinstance(t, Timeline) else (i, list(t)))
    return out


def _flows(per_rank: list[tuple[int, list[Span]]]) -> list[tuple[int, Span, int, Span]]:
    """(sender, send span, receiver, recv span) for every point-to-point message, paired in order."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, spans in per_rank:
        for s in sorted(spans, key=lambda s: s.start):
            if s.kind != "comm" or "peer" not in s.meta:
                continue
            if s.name in SENDS:
                sends[(rank, s.meta["peer"], s.meta.get("tag", 0))].append(s)
            elif s.name in RECVS:
                recvs[(s.meta["peer"], rank, s.meta.get("tag", 0))].append(s)
    pairs = []
    for (src, dst, tag), out in sends.items():
        for a, b in zip(out, recvs.get((src, dst, tag), [])):
            pairs.append((src, a, dst, b))
    return pairs


def to_chrome(timelines, profiles: dict | None = None, origin: float | None = None) -> dict:
    """The trace-event JSON object (module docstring) of ``timelines``: Timelines, or per-rank span lists.

    ``profiles``: {rank: (chrome trace dict from torch.profiler, clock offset in µs)} as :func:`profile`
    returns them, merged on the same processes. ``origin``: the time (seconds of :func:`now`) that
    becomes ts = 0; the earliest span by default.
    """
    per_rank = _ranks(timelines)
    starts = [s.start for _, spans in per_rank for s in spans]
    if origin is None:
        origin = min(starts) if starts else 0.0
    us = lambda t: (t - origin) * 1e6
    events, tids, tid_of = [], {}, {}
    for rank, spans in per_rank:
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        lanes = defaultdict(list)
        for s in spans:
            lanes[_lane(s)].append(s)
        for lane in sorted(lanes, key=lambda name: (name != "compute", name)):
            members = lanes[lane]
            for s, sub in zip(members, _sub_lanes(members)):
                key = (rank, lane, sub)
                if key not in tids:
                    tids[key] = len([k for k in tids if k[0] == rank]) + 1
                    label = lane if sub == 0 else f"{lane} #{sub + 1}"
                    events.append(
                        {"ph": "M", "name": "thread_name", "pid": rank, "tid": tids[key], "args": {"name": label}}
                    )
                    events.append(
                        {
                            "ph": "M",
                            "name": "thread_sort_index",
                            "pid": rank,
                            "tid": tids[key],
                            "args": {"sort_index": tids[key]},
                        }
                    )
                events.append(
                    {
                        "ph": "X",
                        "name": s.name,
                        "cat": s.kind,
                        "pid": rank,
                        "tid": tids[key],
                        "ts": us(s.start),
                        "dur": max(0.0, (s.end - s.start) * 1e6),
                        "args": _jsonable({k: us(v) if k in TIME_META else v for k, v in s.meta.items()}),
                    }
                )
                tid_of[id(s)] = tids[key]  # for the flows below
    for n, (src, send, dst, recv) in enumerate(_flows(per_rank)):
        common = {"name": "p2p", "cat": "p2p", "id": n}
        events.append({**common, "ph": "s", "pid": src, "tid": tid_of[id(send)], "ts": us(send.start)})
        events.append({**common, "ph": "f", "bp": "e", "pid": dst, "tid": tid_of[id(recv)], "ts": us(recv.end)})
    for rank, (prof, offset_us) in (profiles or {}).items():
        events.extend(_profiler_events(prof, rank, offset_us - origin * 1e6))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"source": "course_lib.dist.trace"}}


def _profiler_events(prof: dict, rank: int, shift_us: float) -> list[dict]:
    """torch.profiler's events moved onto ``rank``'s process: its threads become tracks "torch: <name>"
    numbered from 1000 (integer tids, which every viewer reads), its ts shifted onto the merged clock."""
    events = prof.get("traceEvents", [])
    names = {e.get("tid"): _thread_name(e) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    tids: dict = {}
    out = []
    for e in events:
        if e.get("ph") not in ("X", "i", "I") or e.get("name") == CLOCK_MARKER:
            continue  # torch's metadata would rename the rank's process; its flows link its own events
        if e.get("tid") not in tids:
            tids[e.get("tid")] = 1000 + len(tids)
            label = f"torch: {names.get(e.get('tid'), e.get('tid'))}"
            out.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tids[e.get("tid")], "args": {"name": label}}
            )
        out.append(
            {
                **e,
                "pid": rank,
                "tid": tids[e.get("tid")],
                "ts": float(e["ts"]) + shift_us,
                "cat": f"torch.{e.get('cat', 'op')}",
            }
        )
    return out


def _thread_name(event: dict) -> str:
    return str(event.get("args", {}).get("name", event.get("tid")))


def write(path: str | os.PathLike, timelines, profiles: dict | None = None) -> Path:
    """Write :func:`to_chrome` of ``timelines`` to ``path`` (folders created); returns the path.
    Open it in ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome(timelines, profiles)))
    return path


def write_from_ranks(path: str | os.PathLike, timeline: Timeline, profile_trace=None) -> Path | None:
    """Collective: every rank hands its timeline (and :func:`profile`'s result, if any) to rank 0, which
    writes one file for all (what the labs' ``run.py --trace`` calls). Returns the path on rank 0."""
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((timeline.rank, timeline.spans, profile_trace), gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    timelines = [Timeline(rank, spans) for rank, spans, _ in gathered]
    profiles = {rank: p for rank, _, p in gathered if p is not None}
    return write(path, timelines, profiles or None)


@contextlib.contextmanager
def to_file(path: str | os.PathLike | None, with_profiler: bool = False):
    """For scripts under ``accelerate launch`` (the labs' ``run.py --trace PATH``): record this rank's
    timeline during the block (and torch.profiler's ops with ``with_profiler``); at its end every rank
    hands its spans to rank 0, which writes one trace file for all (:func:`write_from_ranks`).
    ``path=None`` records and writes nothing, so ``with chrome_trace.to_file(args.trace):`` costs nothing
    unless asked. A collective at the end: every rank must reach it."""
    if path is None:
        yield None
        return
    with record() as timeline:
        if with_profiler:
            with profile() as prof:
                yield timeline
        else:
            prof = {}
            yield timeline
    write_from_ranks(path, timeline, prof.get("trace"))


@contextlib.contextmanager
def _quiet_stderr_fd():
    """File descriptor 2 to /dev/null for the block: C++ code writes there, past Python's sys.stderr."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def profile():
    """Run the block under torch.profiler (CPU activities: the aten ops) and yield a dict that holds,
    after the block, ``"trace"``: (its Chrome trace, the µs to add to its ts to land on :func:`now`'s
    clock), for :func:`to_chrome`'s ``profiles``. The offset comes from a marker event recorded at a
    known time of our clock; its own duration (a few µs) bounds the alignment error."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    out: dict = {}
    prof = torch_profile(activities=[ProfilerActivity.CPU])
    with _quiet_stderr_fd():  # kineto prints "USDT: ... profiler_start" lines no setting turns off
        prof.start()
    try:
        marked = now()
        with record_function(CLOCK_MARKER):
            pass
        yield out
    finally:
        with _quiet_stderr_fd():
            prof.stop()
    with tempfile.TemporaryDirectory(prefix="course_trace_") as folder:
        file = Path(folder) / "profile.json"
        prof.export_chrome_trace(str(file))
        chrome = json.loads(file.read_text())
    marker = next(e for e in chrome["traceEvents"] if e.get("name") == CLOCK_MARKER and e.get("ph") == "X")
    out["trace"] = (chrome, marked * 1e6 - float(marker["ts"]))


def check_chrome(trace: dict) -> dict:
    """Validate a trace-event object: required fields per phase, durations ≥ 0, every flow start with
    exactly one finish that does not precede it. Returns {pid: summed duration (µs) of its course spans}.
    Raises ValueError naming the first event that breaks a rule."""
    required = {"X": ("name", "ph", "ts", "dur", "pid", "tid"), "M": ("name", "ph", "pid", "args")}
    required |= {"s": ("name", "ph", "ts", "pid", "tid", "id"), "f": ("name", "ph", "ts", "pid", "tid", "id")}
    flows: dict = defaultdict(dict)
    totals: dict = defaultdict(float)
    for e in trace["traceEvents"]:
        for f in required.get(e.get("ph"), ("name", "ph")):
            if f not in e:
                raise ValueError(f"event {e} has no {f!r}: the {e.get('ph')!r} phase needs {required.get(e.get('ph'))}")
        if e["ph"] == "X":
            if e["dur"] < 0:
                raise ValueError(f"event {e['name']!r} on pid {e['pid']} ends before it starts (dur {e['dur']})")
            if not str(e.get("cat", "")).startswith("torch."):
                totals[e["pid"]] += e["dur"]
        if e["ph"] in ("s", "f"):
            if e["ph"] in flows[e["id"]]:
                raise ValueError(f"flow id {e['id']} has two {e['ph']!r} events")
            flows[e["id"]][e["ph"]] = e
    for fid, ends in flows.items():
        if set(ends) != {"s", "f"}:
            raise ValueError(f"flow id {fid} has {sorted(ends)} only: a send without its receive, or the reverse")
        if ends["f"]["ts"] < ends["s"]["ts"]:
            raise ValueError(f"flow id {fid} arrives ({ends['f']['ts']}) before it was sent ({ends['s']['ts']})")
    return dict(totals)
