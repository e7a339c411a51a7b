"""The bytes of tensors alive after every op of a forward and backward pass: :class:`LiveTensorMeter`.

It sees what saved-tensor hooks (:class:`course_lib.measure.saved_tensors.SavedTensorMeter`) cannot:
the temporaries of the backward pass, and the tensors activation checkpointing recomputes. Lecture 06
sets its peaks beside :func:`course_lib.cost.activations.recompute_peak_bytes`
(:mod:`course_lib.experiments.lecture06.recompute_memory`); lecture 08a catches a leak with it.
Tested in tests/model/test_recompute.py.
"""

from __future__ import annotations

import itertools

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorMeter(TorchDispatchMode):
    """Bytes of the tensors that ops create while active and that are still alive, after every op.

        with LiveTensorMeter() as meter:
            out = f(x)
            meter.mark("backward")
            out.backward(g)
        meter.peak(exclude=[p.grad for p in params]), meter.curve(), meter.bytes_at("backward")

    A ``TorchDispatchMode`` sees every ATen op that runs, in the forward pass, in the backward pass
    (the autograd engine carries the mode to the ops it runs) and inside checkpoint's recomputation.
    An output whose storage is not one of the op's inputs' is a new allocation: it is recorded
    with its size (``untyped_storage().nbytes()``) and a weak reference; after each op, references
    that have expired are counted as freed. So the curve is the sum of live storages at the moment
    each op returns: exact and deterministic, in any thread count and on any device, unlike the
    resident set (RSS) or an allocator's caching. What it leaves out: tensors created before the meter
    started (parameters, the inputs), a kernel's internal scratch buffers (allocated inside one op,
    below the dispatcher), and memory that ops of a compiled graph allocate outside ATen.

    ``exclude``: tensors still alive at the end (the parameters' ``.grad``) whose storages are left
    out of the whole curve: gradients are model state, not activations.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage id -> (weak ref, allocation number)
        self._sizes: list[int] = []  # bytes of allocation number i
        self._events: list[tuple[int, int, int]] = []  # (op index, allocation number, +bytes or -bytes)
        self._marks: dict[str, int] = {}
        self.ops = 0

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            n = self._live.pop(key)[1]
            self._events.append((self.ops, n, -self._sizes[n]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self._sweep()  # first: a freed storage's id may come back for a new one
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live or storage.nbytes() == 0:
                continue  # a view, an in-place op's result, or a second output on one storage
            self._live[key] = (StorageWeakRef(storage), len(self._sizes))
            self._events.append((self.ops, len(self._sizes), storage.nbytes()))
            self._sizes.append(storage.nbytes())
        return out

    def __exit__(self, *exc):
        self.ops += 1
        self._sweep()  # what the last op's caller dropped
        return super().__exit__(*exc)

    def mark(self, name: str) -> None:
        """Name the current point (e.g. "backward", before ``loss.backward()``) for :meth:`bytes_at`."""
        self.ops += 1
        self._sweep()
        self._marks[name] = self.ops

    def curve(self, exclude=()) -> list[int]:
        """Live bytes after each op (index 0: when the meter started), without the storages of ``exclude``."""
        excluded = {self._live[k][1] for t in exclude if (k := t.untyped_storage()._cdata) in self._live}
        delta = [0] * (self.ops + 1)
        for op, n, nbytes in self._events:
            if n not in excluded:
                delta[op] += nbytes
        return list(itertools.accumulate(delta))

    def peak(self, exclude=()) -> int:
        """The most bytes alive at once."""
        return max(self.curve(exclude))

    def bytes_at(self, name: str, exclude=()) -> int:
        """Bytes alive at the point :meth:`mark` named ``name``."""
        if name not in self._marks:
            raise KeyError(f"no mark {name!r}: call meter.mark({name!r}) there (marks so far: {list(self._marks)})")
        return self.curve(exclude)[self._marks[name]]
