"""Count what each rank communicates: calls and bytes per collective type and process group.

    with counter.count() as c:
        dist.all_reduce(t, group=mesh.group("dp"))
    c.calls("all_reduce", "dp"), c.bytes("all_reduce")      # -> 1, t.numel() * t.element_size()

The formula-versus-measurement checks of the course (ring all-reduce sends 2(N-1)/N·S bytes per
rank, ZeRO-3 moves 3Ψ, a vocab-parallel cross-entropy needs exactly three all-reduces) rest on
these counts.

What "bytes" means, per call on this rank: the payload this rank hands to the operation —
the tensor of ``all_reduce``/``broadcast``/``send``/``recv``, the input of ``reduce_scatter*``,
``all_gather*`` (this rank's shard) and ``all_to_all*``. It is *not* the traffic on the wire, which
depends on the algorithm the backend picks (ring, tree, ...); lecture 02 and lab 01 derive wire
traffic from these payloads, or measure it by building the algorithm from send/recv.

How: while a count is active, the functions of ``torch.distributed`` are replaced by thin wrappers
that record, then call the original. Code must therefore call them through the module
(``dist.all_reduce(...)``), as all course code does; ``from torch.distributed import all_reduce``
taken before the count started would bypass it. Both ``torch.distributed`` and
``torch.distributed.distributed_c10d`` are patched, so torch's own identity checks
(``P2POp(dist.isend, ...)``) keep working. Each call also becomes a "comm" span on the active
:mod:`~course_lib.dist.trace` timeline.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_lib.dist import trace

# name -> function(args, kwargs) returning (payload bytes, group)
_PAYLOAD = {
    "all_reduce": lambda a, k: (_nbytes(_arg(a, k, 0, "tensor")), _arg(a, k, 2, "group")),
    "broadcast": lambda a, k: (_nbytes(_arg(a, k, 0, "tensor")), _arg(a, k, 2, "group")),
    "reduce": lambda a, k: (_nbytes(_arg(a, k, 0, "tensor")), _arg(a, k, 3, "group")),
    "all_gather": lambda a, k: (_nbytes(_arg(a, k, 1, "tensor")), _arg(a, k, 2, "group")),
    "all_gather_into_tensor": lambda a, k: (_nbytes(_arg(a, k, 1, "input_tensor")), _arg(a, k, 2, "group")),
    "all_gather_single": lambda a, k: (_nbytes(_arg(a, k, 1, "input_tensor")), _arg(a, k, 2, "group")),
    "reduce_scatter_single": lambda a, k: (_nbytes(_arg(a, k, 1, "input")), _arg(a, k, 3, "group")),
    "reduce_scatter": lambda a, k: (_nbytes(_arg(a, k, 1, "input_list")), _arg(a, k, 3, "group")),
    "reduce_scatter_tensor": lambda a, k: (_nbytes(_arg(a, k, 1, "input")), _arg(a, k, 3, "group")),
    "all_to_all": lambda a, k: (_nbytes(_arg(a, k, 1, "input_tensor_list")), _arg(a, k, 2, "group")),
    "all_to_all_single": lambda a, k: (_nbytes(_arg(a, k, 1, "input")), _arg(a, k, 4, "group")),
    "send": lambda a, k: (_nbytes(_arg(a, k, 0, "tensor")), _arg(a, k, 2, "group")),
    "isend": lambda a, k: (_nbytes(_arg(a, k, 0, "tensor")), _arg(a, k, 2, "group")),
    "recv": lambda a, k: (_nbytes(_arg(a, k, 0, "tensor")), _arg(a, k, 2, "group")),
    "irecv": lambda a, k: (_nbytes(_arg(a, k, 0, "tensor")), _arg(a, k, 2, "group")),
    "barrier": lambda a, k: (0, _arg(a, k, 0, "group")),
}

_GROUP_NAMES: dict = {}


def name_group(group, name: str) -> None:
    """Give a process group a readable name for the counts (the device mesh names its groups)."""
    _GROUP_NAMES[group] = name


def group_name(group) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    if group in _GROUP_NAMES:
        return _GROUP_NAMES[group]
    return "ranks" + str(dist.get_process_group_ranks(group)).replace(" ", "")


def _arg(args, kwargs, i, name):
    return kwargs[name] if name in kwargs else (args[i] if len(args) > i else None)


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommCounter:
    """Calls and bytes per (operation, group) on this rank."""

    def __init__(self):
        self.counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(self, op: str, group: str, nbytes: int) -> None:
        entry = self.counts[(op, group)]
        entry[0] += 1
        entry[1] += nbytes

    def calls(self, op: str | None = None, group: str | None = None) -> int:
        return sum(c for (o, g), (c, _) in self.counts.items() if op in (None, o) and group in (None, g))

    def bytes(self, op: str | None = None, group: str | None = None) -> int:
        return sum(b for (o, g), (_, b) in self.counts.items() if op in (None, o) and group in (None, g))

    def as_dict(self) -> dict[str, dict[str, int]]:
        """{"all_reduce@dp": {"calls": 2, "bytes": 4096}, ...} — picklable, for launch() results."""
        return {f"{o}@{g}": {"calls": c, "bytes": b} for (o, g), (c, b) in sorted(self.counts.items())}


class _TimedWork:
    """Wraps an async Work so the comm span ends when ``wait()`` returns."""

    def __init__(self, work, span):
        self._work, self._span = work, span

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if self._span is not None:
            self._span.end = trace.now()
            self._span = None
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


_ACTIVE: list[CommCounter] = []
_ORIGINALS: dict[str, object] = {}


_INSIDE = threading.local()  # torch implements some collectives with others: count only the outermost


def _wrap(name: str, original):
    @functools.wraps(original)
    def counted(*args, **kwargs):
        if getattr(_INSIDE, "depth", 0):
            return original(*args, **kwargs)
        _INSIDE.depth = 1
        try:
            return _counted_call(name, original, args, kwargs)
        finally:
            _INSIDE.depth = 0

    return counted


def _counted_call(name: str, original, args, kwargs):
    nbytes, group = _PAYLOAD[name](args, kwargs)
    gname = group_name(group)
    for c in _ACTIVE:
        c.add(name, gname, nbytes)
    tl = trace.active()
    start = trace.now()
    work = original(*args, **kwargs)
    if tl is None:
        return work
    span = tl.add(name, "comm", start, trace.now(), group=gname, bytes=nbytes)
    if work is not None and hasattr(work, "wait"):
        return _TimedWork(work, span)
    return work


def _install() -> None:
    for name in _PAYLOAD:
        _ORIGINALS[name] = getattr(c10d, name)
        wrapper = _wrap(name, _ORIGINALS[name])
        setattr(c10d, name, wrapper)
        setattr(dist, name, wrapper)


def _uninstall() -> None:
    for name, original in _ORIGINALS.items():
        setattr(c10d, name, original)
        setattr(dist, name, original)
    _ORIGINALS.clear()


@contextlib.contextmanager
def count():
    """Count this rank's communication until the block ends; yields the :class:`CommCounter`.

    Counts nest: an outer count sees everything an inner one sees.
    """
    c = CommCounter()
    if not _ACTIVE:
        _install()
    _ACTIVE.append(c)
    try:
        yield c
    finally:
        _ACTIVE.remove(c)
        if not _ACTIVE:
            _uninstall()
