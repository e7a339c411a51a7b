"""Measured activation memory: what autograd actually keeps for the backward of one layer, set
beside the model of :mod:`course_lib.cost.activations` (lecture 02, tests/test_activation_memory.py);
and :class:`LiveTensorMeter`, the bytes of tensors alive after every op of a forward and backward
pass, which sees what saved-tensor hooks cannot (lecture 06, :mod:`course_lib.measure.recompute`).

The model counts what the CPU kernels save. On another device ``F.scaled_dot_product_attention``
runs another kernel, which saves other statistics: ``cost.activations.sdpa_saved_statistics`` gives
them per device type, and ``cost.activations.sdpa_extra_bytes`` the difference the measurement then
shows (:func:`model_vs_measurement` adds it to the model of the device that measured).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from course_lib.cost.activations import ATTENTION_KERNELS, activation_bytes_per_layer, sdpa_extra_bytes
from course_lib.dist import Mesh, device, launch
from course_lib.model.config import ModelConfig
from course_lib.model.transformer import Transformer
from course_lib.parallel.tensor.model import TPBlock
from course_lib.parallel.tensor.sequence import shard_sequence


class SavedTensorMeter:
    """Counts the bytes of distinct storages that autograd saves for backward while active.

        with SavedTensorMeter(exclude=model) as meter:
            y = model(x)
        meter.bytes

    Tensors are kept alive by the graph until backward, so a storage seen once cannot be freed and
    replaced by another saved tensor's during the forward pass: counting storages (by the storage
    object, ``_cdata``, which works on any device, meta included, where every address is 0) is
    counting tensors. Storages of ``exclude``'s parameters and buffers are left out (weights are not
    activations, and ``w.t()`` saved by a linear is a view of the weight), and so are the storages
    of ``constants`` (the RoPE tables passed to a block). Those are recognised by the storage object
    itself (``_cdata``), not by its address: ZeRO-3 frees a parameter's storage and re-allocates it
    at a new address for every gather.
    """

    def __init__(self, exclude: torch.nn.Module | None = None, constants: tuple = ()):
        tensors = list(exclude.parameters()) + list(exclude.buffers()) if exclude is not None else []
        tensors += list(constants)
        self._excluded = {t.untyped_storage()._cdata for t in tensors}
        self.storages: dict[int, int] = {}
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in self._excluded and storage.nbytes() > 0:
            self.storages[storage._cdata] = storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


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


def sdpa_kernel(attention: str):
    """A context that makes ``F.scaled_dot_product_attention`` run the named kernel."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as choose

    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION_KERNELS}")
    return choose(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()


def measure_block(
    block: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: str = "flash"
) -> int:
    """Bytes of activations ``block(x, cos, sin)`` saves for backward on this rank (x counts: it is saved).

    Measured on ``x``'s device, where ``block``, ``cos`` and ``sin`` must be too: what SDPA saves
    depends on the device's kernel (:func:`~course_lib.cost.activations.sdpa_saved_statistics`).
    ``x`` is copied first: a slice of a larger tensor would be counted with its whole storage.
    """
    where = {t.device for t in (*block.parameters(), cos, sin)}
    if where != {x.device}:
        raise ValueError(f"x is on {x.device}, the block and the RoPE tables on {where}: put them on one device")
    x = x.detach().clone().requires_grad_(True)
    with sdpa_kernel(attention), SavedTensorMeter(exclude=block, constants=(cos, sin)) as meter:
        block(x, cos, sin)
    return meter.bytes


def _measure_rank(cfg, batch, seq_lens, settings, attention, seed):
    """On each rank of a TP group: measured bytes for every (seq_len, sequence_parallel) asked for,
    and the type of the rank's device."""

    mesh = Mesh(tp=dist.get_world_size())
    torch.manual_seed(seed)
    dev = device()
    dense = Transformer(cfg).to(dev)
    out = {}
    for sp in settings:
        block = TPBlock(dense.layers[0], mesh, sequence_parallel=sp)
        for s in seq_lens:
            # host: drawn on the CPU generator so that every rank (and every machine) holds the same x
            x = torch.randn(batch, s, cfg.d_model, generator=torch.Generator().manual_seed(seed + s)).to(dev)
            x = shard_sequence(x, mesh.group("tp")) if sp else x
            out[(s, sp)] = measure_block(block, x, dense.rope_cos[:s], dense.rope_sin[:s], attention)
    return out, dev.type


def _measure(cfg, batch, seq_lens, tp_size, settings, attention, seed, on) -> tuple[dict, str]:
    """:func:`measure_layer_bytes`'s numbers and the type of the device that measured them."""
    seq_lens = list(seq_lens)
    if tp_size > 1:
        if on is not None:
            raise ValueError(f"device={on!r} with tp_size={tp_size}: the ranks measure on their own device()")
        return launch(_measure_rank, tp_size, cfg, batch, seq_lens, tuple(settings), attention, seed, timeout=120)[0]
    dev = torch.device(on) if on is not None else device()
    torch.manual_seed(seed)
    dense = Transformer(cfg).to(dev)
    out = {}
    for s in seq_lens:
        x = torch.randn(batch, s, cfg.d_model, device=dev)
        out[(s, False)] = measure_block(dense.layers[0], x, dense.rope_cos[:s], dense.rope_sin[:s], attention)
    return out, dev.type


def measure_layer_bytes(
    cfg: ModelConfig,
    batch: int,
    seq_lens,
    tp_size: int = 1,
    settings=(False,),
    attention: str = "flash",
    seed: int = 0,
    device: torch.device | str | None = None,
) -> dict:
    """Measured bytes per rank for one layer: {(seq_len, sequence_parallel): bytes}.

    tp_size = 1 measures ``course_lib.model.transformer.Block`` in this process, on ``device``
    (default :func:`course_lib.dist.device`: in a process no launcher started, a notebook kernel or
    pytest, that is cuda:0 on a GPU machine; pass ``device="cpu"`` for the CPU kernels' bytes that
    :mod:`course_lib.cost.activations` counts). More launches tp_size ranks that each measure their
    ``TPBlock`` on their own device (one launch for all seq_lens and settings; rank 0's numbers,
    since every rank holds the same shapes). On CUDA the bytes differ from the model by
    :func:`~course_lib.cost.activations.sdpa_extra_bytes`.
    """
    return _measure(cfg, batch, seq_lens, tp_size, settings, attention, seed, device)[0]


def model_vs_measurement(
    cfg: ModelConfig, seq_lens, batch: int = 1, tp_size: int = 2, attention: str = "flash"
) -> list[dict]:
    """For the lecture: one row per (layout, seq_len) with the model's and the measured bytes per rank.

    Layouts: "dense" (t = 1), "TP" and "TP+SP" (t = ``tp_size``). Two launches at most in all.
    Each row's model is that of the device which measured it (``"device"``: the dense layer here,
    the TP layouts on the ranks): :func:`activation_bytes_per_layer` plus ``sdpa_extra_bytes``,
    which is 0 on CPU.
    """
    dense, dense_on = _measure(cfg, batch, seq_lens, 1, (False,), attention, 0, None)
    measured = {("dense", s): (v, dense_on) for (s, _), v in dense.items()}
    split, split_on = _measure(cfg, batch, seq_lens, tp_size, (False, True), attention, 0, None)
    for (s, sp), v in split.items():
        measured[("TP+SP" if sp else "TP", s)] = (v, split_on)
    rows = []
    for (layout, s), (got, on) in sorted(measured.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        t = 1 if layout == "dense" else tp_size
        model = activation_bytes_per_layer(cfg, batch, s, t, layout == "TP+SP", attention)
        model += sdpa_extra_bytes(cfg, batch, s, attention, on, t)
        rows.append(
            {
                "layout": layout,
                "tp": t,
                "seq_len": s,
                "device": on,
                "model_bytes": model,
                "measured_bytes": got,
                "rel_error": (got - model) / model,
            }
        )
    return rows
