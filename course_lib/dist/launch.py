"""Run a function on N ranks, from a notebook cell, a test or a script, and get its results back.

    results = launch(fn, world_size, *args, timeout=60, **kwargs)   # results[r] is rank r's return

How it works, and why each piece is there:

* Each rank is a process started from a *fork server* that has already imported torch: starting a
  rank costs milliseconds instead of a fresh interpreter's seconds, and (unlike a plain fork of a
  notebook kernel) the server has never touched CUDA or OpenMP threads, so children are safe.
* ``fn`` travels by value with cloudpickle, so a function defined in a notebook cell works.
* The caller hosts the rendezvous store on a port the OS picks (port 0): two launches, in two
  pytest workers at once, can never collide on a port.
* Each rank's ``print`` output is collected and shown in rank order when the ranks finish, so a
  notebook's output is the same every run.
* A rank that raises: the caller gets :class:`RankError` with that rank's number and traceback.
  A rank that never returns: ``timeout`` seconds after the first rank started ``fn`` (starting, the
  process group and unpickling ``fn`` included, has STARTUP_S more), the caller gets :class:`LaunchTimeout`
  naming the ranks that did not finish and the line each was waiting on (Python's faulthandler
  dumps their stacks). Either way, every rank — and anything a rank started — is killed before the
  error is raised: no process is left behind, and the folder of stack dumps is removed.
"""

from __future__ import annotations

import faulthandler
import functools
import io
import linecache
import multiprocessing
import os
import pickle
import queue as queue_mod
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from course_lib.dist import chrome_trace, runtime
from course_lib.dist import trace as tracing

HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 120.0
# Starting the ranks (the fork server's first preload, the process group, unpickling ``fn``, which
# imports its module) is bounded apart from ``timeout``: under load it took more than a 4-s timeout
# by itself, and a test's hanging rank was then reported as "ranks [0, 1]" stuck in imports.
STARTUP_S = 60.0
BACKSTOP_S = 10.0  # a rank's own collective timeout is the caller's plus this (see _rank_main)


class RankError(RuntimeError):
    """A rank raised; ``.rank`` says which and ``.rank_traceback`` shows where."""

    def __init__(self, rank: int, rank_traceback: str, unfinished: str = ""):
        self.rank, self.rank_traceback = rank, rank_traceback
        last = rank_traceback.strip().splitlines()[-1] if rank_traceback.strip() else "?"
        super().__init__(f"rank {rank} raised {last}\n\n--- traceback of rank {rank} ---\n{rank_traceback}{unfinished}")


class LaunchTimeout(TimeoutError):
    """Some ranks did not finish in time; ``.ranks`` lists them."""

    def __init__(self, ranks: list[int], timeout: float, where: str):
        self.ranks = ranks
        super().__init__(
            f"ranks {ranks} did not finish within {timeout:g} s (a collective or recv waiting for a "
            f"peer that never came, or an endless loop). Where each was:\n{where}"
        )


# ----------------------------------------------------------------------------------------- child


class _RankOutput(io.TextIOBase):
    """Stands in for sys.stdout/stderr in a rank: text goes back to the caller via the queue."""

    def __init__(self, q, rank: int, stream: str):
        self.q, self.rank, self.stream = q, rank, stream

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text:
            self.q.put(("out", self.rank, (self.stream, text)))
        return len(text)


def _to_cpu(obj: Any) -> Any:
    """Results cross a process boundary; GPU tensors must not."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _rank_main(rank: int, world_size: int, port: int, payload: bytes, q, release, stack_dir: str, timeout: float):
    # Own process group: the caller can kill this rank together with anything it starts.
    os.setsid()
    # On request (SIGUSR1) write this rank's stacks to a file, so a timeout can say where it hung.
    stack_file = open(Path(stack_dir) / f"rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    sys.stdout, sys.stderr = _RankOutput(q, rank, "stdout"), _RankOutput(q, rank, "stderr")
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
    )
    try:
        if runtime.backend() == "gloo":
            # N ranks share this machine's cores: more threads than cores only slows everyone. A lower
            # limit the caller set (OMP_NUM_THREADS, as ./course test does for its shared phase) holds.
            torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // world_size)))
        # The group's own timeout is the backstop, BACKSTOP_S after the caller's: the caller's fires
        # first and quotes the line each rank waits on, rather than gloo's "Timed out waiting 3000ms".
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=_td(timeout + BACKSTOP_S))
        runtime.init(rank, world_size, store=store, timeout_s=timeout + BACKSTOP_S)
        fn, args, kwargs = cloudpickle.loads(payload)
        # The caller's clock for ``timeout`` starts at the first rank's start (CLOCK_MONOTONIC is the
        # machine's, not the process's): before any rank's own collective timeout, so the caller's fires first.
        q.put(("started", rank, time.monotonic()))
        result = fn(*args, **kwargs)
        q.put(("ok", rank, cloudpickle.dumps(_to_cpu(result))))
    except BaseException:  # everything must reach the caller, KeyboardInterrupt too
        q.put(("err", rank, traceback.format_exc()))
    finally:
        # Stay connected until the caller releases every rank at once: a rank that left early would
        # reset its peers' connections, turning "rank 1 waits forever in recv" into a confusing
        # "connection reset by peer" instead of a timeout that shows the line rank 1 waits on.
        release.wait(timeout + 60)
        try:
            runtime.shutdown()
        except Exception:  # a broken group cannot be torn down cleanly; we exit anyway
            pass
        sys.stdout.flush()


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


# ---------------------------------------------------------------------------------------- caller

_CONTEXT = None
_ANNOUNCED: set[int] = set()  # world sizes whose fall-back to CPU ranks this process has reported


def _context():
    """A fork-server context that pre-imports torch (created once per caller process).

    Every rank is forked from the server, so what the server imported once each rank has for free.
    ``torch._dynamo`` is among it because the first ``step()`` of any torch.optim optimizer imports
    it (with sympy): ~3 s of one core per rank otherwise, measured at 4 s against 0.6 s for a 2-rank
    launch whose ranks take one AdamW step (2 cores). It starts no thread, so forking after it is safe.
    A rank's own launches (the grading worker runs every check of a lab, most of which launch ranks)
    preload it too: measured on the course machine, grading lab 11's solution took 50 s without it in
    the worker's server and 25 s with it, lab 10's 40 s and 17 s, lab 04's (no optimizer) 15 s and 16 s.
    The last preload, :mod:`course_lib.dist.forkserver_freeze`, freezes that heap, so a rank's garbage
    collections skip it: a two-rank launch went from 0.45 s to 0.07 s, a four-rank one from 0.67 s to 0.13 s.
    """
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "torch._dynamo",
                "course_lib.dist.runtime",
                "course_lib.dist.forkserver_freeze",
            ]
        )
    return _CONTEXT


def _run_traced(fn: Callable, profile: bool, *args, **kwargs):
    """``fn`` under a recorded timeline (and torch.profiler when ``profile``): its result and the trace."""
    with tracing.record() as timeline:
        if profile:
            with chrome_trace.profile() as prof:
                result = fn(*args, **kwargs)
        else:
            result, prof = fn(*args, **kwargs), {}
    return result, timeline, prof.get("trace")


def launch(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT_S,
    trace: str | os.PathLike | None = None,
    profile: bool = False,
    **kwargs,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the list of their return values.

    Inside ``fn`` the default process group is initialised (gloo+cpu or nccl+cuda, see
    :mod:`course_lib.dist.runtime`), so ``torch.distributed`` can be used directly. ``timeout``
    bounds ``fn``'s run, counted from the first rank's start of it once every rank has started, and
    every collective in it; starting the ranks has ``STARTUP_S`` more.

    ``trace="run.json"`` records every rank's timeline while ``fn`` runs and writes them as one Chrome
    trace-event file (:func:`course_lib.dist.chrome_trace.write`: open it in ui.perfetto.dev); with
    ``profile=True`` torch.profiler's aten ops of each rank are merged into it, on the same clock.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if profile and trace is None:
        raise ValueError("profile=True merges torch.profiler's events into the trace file: pass trace='path.json' too")
    if trace is not None:
        traced = launch(functools.partial(_run_traced, fn, profile), world_size, *args, timeout=timeout, **kwargs)
        profiles = {t.rank: p for _, t, p in traced if p is not None}
        chrome_trace.write(trace, [t for _, t, _ in traced], profiles or None)
        return [result for result, _, _ in traced]
    # The rule is applied here first: a forced backend that cannot work is refused before any rank
    # starts, and a fall-back from a present accelerator to CPU ranks is said once, not hidden (unless
    # COURSE_FALLBACK_NOTICE=0: nbval on a 1-GPU machine, whose stored outputs were made without one).
    choice = runtime.choice(world_size)
    if choice.fell_back and world_size not in _ANNOUNCED and os.environ.get("COURSE_FALLBACK_NOTICE") != "0":
        _ANNOUNCED.add(world_size)
        print(runtime.describe(world_size, world_size), file=sys.stderr, flush=True)
    ctx = _context()
    store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=_td(timeout))
    payload = cloudpickle.dumps((fn, args, kwargs))
    q, release = ctx.Queue(), ctx.Event()
    stack_dir = tempfile.mkdtemp(prefix="course_launch_")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, store.port, payload, q, release, stack_dir, timeout))
        for r in range(world_size)
    ]
    results: dict[int, Any] = {}
    output: dict[int, list[tuple[str, str]]] = {r: [] for r in range(world_size)}
    error: tuple[int, str] | None = None
    started: dict[int, float] = {}  # rank -> when it started fn
    deadline = time.monotonic() + STARTUP_S + timeout
    try:
        for p in procs:
            p.start()
        while len(results) < world_size and error is None:
            try:
                error = _receive(q, results, output, started, wait=0.05)
                if len(started) == world_size:
                    deadline = min(started.values()) + timeout
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:
                    _drain(q, results, output)  # it may have reported just before exiting
                    dead = [r for r in dead if r not in results]
                if dead:
                    error = (
                        dead[0],
                        f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                        "without returning (killed, or the interpreter crashed; a script that "
                        'calls launch() must do so under `if __name__ == "__main__":`)\n',
                    )
                elif time.monotonic() > deadline:
                    unfinished = [r for r in range(world_size) if r not in results]
                    raise LaunchTimeout(unfinished, timeout, _where(procs, unfinished, stack_dir)) from None
        if error is not None:
            # Give the others a moment to finish, or to reach the line they will block on, so
            # the stacks quoted below show where they wait rather than where they happened to be.
            # A rank that raised too has finished (every rank of an unimplemented exercise raises
            # the same NotImplementedError): waiting the whole grace for it cost a grading 1.5 s a check.
            grace = time.monotonic() + min(1.0, max(0.0, deadline - time.monotonic()))
            raised = {error[0]}
            while len(results) + len(raised) < world_size and time.monotonic() < grace:
                try:
                    other = _receive(q, results, output, started, wait=0.05)
                except queue_mod.Empty:
                    continue
                if other is not None:
                    raised.add(other[0])
            unfinished = [r for r in range(world_size) if r not in results and r not in raised]
            extra = ""
            if unfinished:
                extra = f"\n--- ranks {unfinished} had not finished; where each was ---\n"
                extra += _where(procs, unfinished, stack_dir)
            raise RankError(error[0], error[1], extra)
        return [results[r] for r in range(world_size)]
    finally:
        release.set()
        _kill_all(procs)
        _drain(q, results, output)
        _replay(output)
        q.close()
        del store
        shutil.rmtree(stack_dir, ignore_errors=True)  # leave nothing behind in the temp folder


def _receive(q, results: dict, output: dict, started: dict, wait: float | None) -> tuple[int, str] | None:
    """File one message from the ranks (printed text, a rank that started ``fn``, a result); a rank's error is returned.

    Raises ``queue.Empty`` when nothing arrives within ``wait`` seconds (``None``: do not wait).
    """
    kind, rank, body = q.get(timeout=wait) if wait else q.get_nowait()
    if kind == "out":
        output[rank].append(body)
    elif kind == "started":
        started[rank] = body
    elif kind == "ok":
        results[rank] = pickle.loads(body)
    else:
        return rank, body
    return None


def _drain(q, results: dict, output: dict) -> None:
    """Everything still queued (after the ranks stopped): their last prints and results."""
    while True:
        try:
            _receive(q, results, output, {}, wait=None)  # start times no longer matter
        except (queue_mod.Empty, OSError, ValueError):
            return


def _replay(output: dict) -> None:
    """Show each rank's printed text in rank order (deterministic, unlike live interleaving)."""
    for rank in sorted(output):
        for stream, text in _join(output[rank]):
            target = sys.stdout if stream == "stdout" else sys.stderr
            for line in text.splitlines():
                print(f"[rank {rank}] {line}", file=target)


def _join(chunks: list[tuple[str, str]]) -> list[tuple[str, str]]:
    joined: list[tuple[str, str]] = []
    for stream, text in chunks:
        if joined and joined[-1][0] == stream:
            joined[-1] = (stream, joined[-1][1] + text)
        else:
            joined.append((stream, text))
    return joined


def _where(procs, ranks: list[int], stack_dir: str) -> str:
    """Ask the given ranks to dump their stacks, and quote the innermost frames of each."""
    for r in ranks:
        if procs[r].exitcode is None:
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.5)
    lines = []
    for r in ranks:
        path = Path(stack_dir) / f"rank{r}.txt"
        dump = path.read_text() if path.exists() else ""
        frames = [_frame(line) for line in dump.splitlines() if line.strip().startswith("File")]
        frames = [f for f in frames if f is not None][:3]
        shown = "\n      ".join(frames) if frames else "(no stack: the rank did not answer)"
        lines.append(f"  rank {r}, innermost frame first:\n      {shown}")
    return "\n".join(lines) + "\n"


def _frame(line: str) -> str | None:
    """'File "x.py", line 6 in f' -> 'x.py:6 in f: <source line>', skipping the runtime's frames."""
    m = re.match(r'\s*File "(.+)", line (\d+) in (\S+)', line)
    if not m or "multiprocessing" in m[1] or m[1].startswith("<") or m[1].endswith("course_lib/dist/launch.py"):
        return None
    source = linecache.getline(m[1], int(m[2])).strip()
    return f"{m[1]}:{m[2]} in {m[3]}: {source}"


def _kill_all(procs) -> None:
    """SIGKILL every rank's whole process group, then reap them: nothing outlives a launch."""
    for p in procs:
        if p.pid is None:
            continue  # never started
        if p.exitcode is None:
            p.join(timeout=0.2)  # a rank that has returned exits by itself in a moment
        try:  # the group too: a rank that returned may still have left a child of its own
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if p.exitcode is None:
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5)
