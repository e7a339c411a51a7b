"""course_lib.dist.trace's export: every timeline as one Chrome trace-event file for Perfetto.

* the JSON is well-formed trace-event data: required fields, durations ≥ 0, every send's arrow ends at
  exactly one receive and not before it, per-rank totals equal the recorded spans;
* lanes whose spans overlap without nesting are split, so complete events on a thread always nest;
* a 1F1B step at p = 4 traced through ``launch(trace=...)``: the bubble read from the file equals the
  bubble measured from the runtime's spans (lecture 03's measurement);
* a DDP step merged with torch.profiler: the buckets' all-reduces and torch's autograd ops are on one
  clock, and the all-reduces overlap the backward ops;
* traces are written only where asked.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

from course_lib.dist import chrome_trace, device, launch, trace
from course_lib.experiments.lecture02.ddp_trace import trace_step
from course_lib.experiments.lecture03.pipeline_runs import measured_bubble


def _ring_and_reduce(rounds: int):
    """Compute spans, a ring of point-to-point messages and two overlapping async all-reduces."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    with trace.record() as tl:
        for r in range(rounds):
            with trace.span("work", step=r):
                torch.randn(64, 64, device=dev) @ torch.randn(64, 64, device=dev)
            out = torch.full((8,), float(rank), device=dev)
            got = torch.empty(8, device=dev)
            send = dist.isend(out, (rank + 1) % world, tag=r)
            dist.recv(got, (rank - 1) % world, tag=r)
            send.wait()
        a = dist.all_reduce(torch.ones(1000, device=dev), async_op=True)
        b = dist.all_reduce(torch.ones(1000, device=dev), async_op=True)
        with trace.span("between"):
            torch.randn(32, 32, device=dev).sum()
        a.wait()  # a started first and ends first: the two comm spans overlap without nesting
        b.wait()
    return tl


@pytest.fixture(scope="module")
def ring_timelines():
    return launch(_ring_and_reduce, 3, 2, timeout=60)


def test_exported_json_is_valid_trace_event_format(ring_timelines, tmp_path):
    path = chrome_trace.write(tmp_path / "ring.json", ring_timelines)
    exported = json.loads(path.read_text())  # it is JSON a viewer can load
    totals = chrome_trace.check_chrome(exported)
    for tl in ring_timelines:
        recorded = sum(s.duration for s in tl.spans) * 1e6
        assert totals[tl.rank] == pytest.approx(recorded, rel=1e-9, abs=1e-3), (
            f"rank {tl.rank}: the file's spans add up to {totals[tl.rank]:.1f} µs, the recorded ones to {recorded:.1f}"
        )
    names = {(e["pid"], e["args"]["name"]) for e in exported["traceEvents"] if e["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in range(3)}, "one process per rank, named after it"


def test_every_send_gets_an_arrow_to_its_receive(ring_timelines):
    exported = chrome_trace.to_chrome(ring_timelines)
    flows = [e for e in exported["traceEvents"] if e["ph"] in ("s", "f")]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    ends = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert len(starts) == len(ends) == 3 * 2, "3 ranks x 2 rounds of one message each: 6 arrows"
    for fid, s in starts.items():
        assert ends[fid]["pid"] == (s["pid"] + 1) % 3, "each arrow goes from a rank to its ring successor"
    args = [e["args"] for e in exported["traceEvents"] if e["ph"] == "X" and e["name"] == "isend"]
    assert all({"peer", "tag", "bytes"} <= set(a) for a in args), "send spans carry their peer, tag and bytes"


def test_overlapping_spans_are_split_into_lanes_that_nest(ring_timelines):
    exported = chrome_trace.to_chrome(ring_timelines)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in exported["traceEvents"] if e["name"] == "thread_name"}
    assert (0, 1) in threads and threads[(0, 1)] == "compute"
    assert "comm: world #2" in threads.values(), "two all-reduces in flight at once need a second lane"
    by_thread = {}
    for e in exported["traceEvents"]:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for key, spans in by_thread.items():
        spans.sort(key=lambda se: (se[0], -se[1]))
        stack = []
        for start, end in spans:
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], f"{threads[key]} on rank {key[0]}: complete events must nest"
            stack.append(end)


def test_a_broken_trace_is_refused_with_the_rule_it_breaks():
    with pytest.raises(ValueError, match="ends before it starts"):
        chrome_trace.check_chrome({"traceEvents": [{"ph": "X", "name": "F", "ts": 5, "dur": -1, "pid": 0, "tid": 1}]})
    with pytest.raises(ValueError, match="a send without its receive"):
        chrome_trace.check_chrome({"traceEvents": [{"ph": "s", "name": "p2p", "ts": 1, "pid": 0, "tid": 1, "id": 7}]})
    with pytest.raises(ValueError, match="has no 'ts'"):
        chrome_trace.check_chrome({"traceEvents": [{"ph": "X", "name": "F", "dur": 1, "pid": 0, "tid": 1}]})


def test_1f1b_trace_reproduces_the_measured_bubble(tmp_path):
    path = tmp_path / "1f1b.json"
    measured = measured_bubble("1f1b", p=4, m=8, trace=path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    assert {e["name"] for e in events} == {"F", "B"}
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    busy = sum(e["dur"] for e in events)
    from_file = 1 - busy / (4 * (end - start))
    # the same spans in µs instead of s: equal up to the rounding of the unit change (~1e-12)
    assert from_file == pytest.approx(measured["bubble"], abs=1e-9), (
        f"the trace's compute spans give a bubble of {from_file:.4f}, the runtime's spans {measured['bubble']:.4f}"
    )
    assert sum(1 for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "s") > 0, "1F1B's sends draw arrows"


def test_merged_ddp_trace_has_buckets_overlapping_torchs_backward_ops(tmp_path):
    path = tmp_path / "ddp.json"
    trace_step(world_size=2, trace=path, profile=True)
    events = json.loads(path.read_text())["traceEvents"]
    chrome_trace.check_chrome({"traceEvents": events})
    for rank in (0, 1):
        buckets = [
            e
            for e in events
            if e["pid"] == rank and e["ph"] == "X" and e["name"] == "all_reduce" and "bucket" in e["args"]
        ]
        autograd = [
            e
            for e in events
            if e["pid"] == rank
            and e["ph"] == "X"
            and str(e.get("cat", "")).startswith("torch.")
            and e["name"].startswith("autograd::engine::evaluate_function")
        ]
        assert buckets and autograd, f"rank {rank}: the merged trace needs both the course's buckets and torch's ops"
        overlapping = [
            b for b in buckets if any(a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"] for a in autograd)
        ]
        assert overlapping, (
            f"rank {rank}: no bucket all-reduce overlaps a backward op in time — DDP should launch a bucket's "
            "all-reduce while autograd still computes the gradients of earlier layers (or the clocks are misaligned)"
        )


def _nothing():
    return dist.get_rank()


def test_traces_are_written_only_where_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
    assert launch(_nothing, 2) == [0, 1]
    assert list(tmp_path.iterdir()) == [], "launch without trace= must write no file"
    assert launch(_nothing, 2, trace="asked.json", profile=True) == [0, 1]
    assert [p.name for p in tmp_path.iterdir()] == ["asked.json"]
    after = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
    assert after <= before, f"the profiler's export left {sorted(after - before)} in the temp folder"
    with pytest.raises(ValueError, match="pass trace="):
        launch(_nothing, 2, profile=True)
