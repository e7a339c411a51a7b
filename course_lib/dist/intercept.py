"""Intercept ``torch.distributed``'s communication calls, for whoever observes them.

While at least one observer is active, the functions of ``torch.distributed`` (and of
``torch.distributed.distributed_c10d``, so torch's own identity checks such as
``P2POp(dist.isend, ...)`` keep working) are replaced by thin wrappers. Each call is reported to
every observer with its operation name, its group's name and its payload bytes, then the original
runs. Two observers use this: :mod:`~course_lib.dist.counter` (calls and bytes) and
:mod:`~course_lib.dist.trace` (comm spans on a timeline). Neither imports the other.

Code must call collectives through the module (``dist.all_reduce(...)``), as all course code does:
``from torch.distributed import all_reduce`` taken before the interception started bypasses it.

An observer is a callable ``observer(op, group, nbytes, **info)`` that may return a *finisher*: a
callable run when the operation has returned and, for an asynchronous one, again when its ``wait()``
returns (a timeline uses it to end the span when the rank knows the data arrived). ``info`` holds
the ``peer`` (the other rank, as the call names it) and ``tag`` of a point-to-point call, from which
a trace draws an arrow from each send to its receive; it is empty for collectives.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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

# point-to-point calls: (the argument naming the other rank, its position), the tag's position
_P2P = {"send": ("dst", 1), "isend": ("dst", 1), "recv": ("src", 1), "irecv": ("src", 1)}
_TAG_POSITION = 3

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


def _peer(name: str, group, args, kwargs) -> int | None:
    """The other rank, as a global rank. ``batch_isend_irecv`` (``course_lib.dist.p2p``) names it by
    its rank in the group (``group_dst=`` / ``group_src=``) rather than by ``dst`` / ``src``."""
    key, position = _P2P[name]
    peer = _arg(args, kwargs, position, key)
    if peer is None:
        local = kwargs.get("group_dst" if key == "dst" else "group_src")
        if local is not None:
            peer = local if group is None else dist.get_global_rank(group, local)
    return peer


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class _WaitHook:
    """Wraps an async Work so the finishers run again when ``wait()`` returns."""

    def __init__(self, work, finishers):
        self._work, self._finishers = work, finishers

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        for finish in self._finishers:
            finish()
        self._finishers = []
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


_OBSERVERS: list = []
_ORIGINALS: dict[str, object] = {}
_INSIDE = threading.local()  # torch implements some collectives with others: report only the outermost


def _wrap(name: str, original):
    @functools.wraps(original)
    def intercepted(*args, **kwargs):
        if getattr(_INSIDE, "depth", 0):
            return original(*args, **kwargs)
        _INSIDE.depth = 1
        try:
            return _observed_call(name, original, args, kwargs)
        finally:
            _INSIDE.depth = 0

    return intercepted


def _observed_call(name: str, original, args, kwargs):
    nbytes, group = _PAYLOAD[name](args, kwargs)
    gname = group_name(group)
    info = {}
    if name in _P2P:
        info["peer"] = _peer(name, group, args, kwargs)
        info["tag"] = _arg(args, kwargs, _TAG_POSITION, "tag") or 0
    observers = list(_OBSERVERS)
    finishers = [f for f in (observer(name, gname, nbytes, **info) for observer in observers) if f is not None]
    work = original(*args, **kwargs)
    for finish in finishers:
        finish()
    if finishers and work is not None and hasattr(work, "wait"):
        return _WaitHook(work, finishers)
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
def observe(observer):
    """Report every communication call of this process to ``observer`` until the block ends."""
    if not _OBSERVERS:
        _install()
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)
        if not _OBSERVERS:
            _uninstall()
