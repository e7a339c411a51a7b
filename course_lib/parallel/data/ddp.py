"""Distributed data parallel, by hand: first naive, then bucketed and overlapped (lecture 02, lab 02).

Every rank holds a full replica of the model and a different shard of each global batch. After
backward every rank must hold the same gradient, the average over the world_size ranks of their
local gradients of the shard losses L_r (W = world_size below):

    g = (1/W) · Σ_r ∇L_r          (one all-reduce of every gradient, summing over ranks)

which, for equal shards and a mean loss, is the gradient of the loss on the whole global batch.
With equal parameters and equal gradients every replica takes the same optimizer step, so the
replicas never drift apart.

**The naive version** (:class:`NaiveDataParallel`, the first step of picotron's and of most
courses' DDP): after ``loss.backward()`` returns, all-reduce each parameter's gradient, one
collective per parameter. It is correct, and slow twice over: it pays the latency α of a
collective once per parameter (hundreds of times a step), and the network idles during the whole
backward pass, then the compute idles during the whole communication.

**The bucketed, overlapped version** (:class:`DistributedDataParallel`) fixes both, as torch's DDP
does (Li et al., "PyTorch Distributed", VLDB 2020, §3.2 — the design followed here):

1. **Same start.** Rank 0's parameters and buffers are broadcast to every rank at construction.
2. **Buckets.** Gradients are packed into flat buckets of about ``bucket_cap_mb``, so one
   all-reduce carries many parameters (one bucket of everything could not start before the last
   gradient exists); in *reverse registration order*, because backward produces gradients roughly
   in the reverse of the order the forward used the layers, so the output layer's bucket fills first.
3. **Hooks and overlap.** A post-accumulate-grad hook on every parameter copies its gradient into
   its bucket; when a bucket is full, an asynchronous all-reduce (``async_op=True``) is launched
   at once and runs while autograd is still computing the gradients of earlier layers.
4. **Finish.** At the end of backward (a callback queued on the autograd engine, as torch does)
   we wait for every bucket and copy the averaged values back into ``param.grad``.
5. **no_sync.** For gradient accumulation, micro-batches run inside ``no_sync()``: the hooks do
   nothing, gradients accumulate locally in ``param.grad``, and only the last micro-batch (outside
   ``no_sync``) communicates — once, for the sum of all micro-batches.
6. **Communication hooks.** ``register_comm_hook(state, hook)`` replaces each bucket's all-reduce
   by ``hook(state, bucket) -> Future``, torch's interface (gradient compression:
   :mod:`course_lib.optim.compression`). As in torch, the hook gets the raw local gradients (no
   pre-division) and returns the averaged bucket; finish() waits on the Future and copies it back.

Averaging: each gradient is multiplied by 1/W while it is copied into its bucket, then the bucket
is all-reduced with SUM. This is what torch's Reducer does, and doing it the same way (same
buckets, same layout, same pre-division) makes our gradients *bit-equal* to
``torch.nn.parallel.DistributedDataParallel``. Two details matter: (a) the result of a 4-rank
gloo all-reduce depends on where an element sits in the buffer (the ring adds the ranks' values
in an order that depends on the element's segment), so the bucket layout must be torch's; (b)
``g·(1/W)`` summed is not ``(Σ g)/W`` in floating point unless W is a power of two, so "divide
after the sum" differs from torch by rounding at W = 3 (tests/parallel/data/test_ddp.py checks both facts).

Limits, said once: every parameter must receive a gradient in every synchronised backward (no
``find_unused_parameters``), all parameters share one dtype and device, and buffers are broadcast
only at construction (the course model's buffers are constant; torch by default re-broadcasts
them before every forward, which BatchNorm statistics would need). Torch DDP also re-orders its
buckets after the first iteration by the order gradients actually arrived; for the course model
that order *is* reverse registration order, so our fixed buckets match torch's from the second
iteration on. Lecture 02's traced DDP step: :mod:`course_lib.experiments.lecture02.ddp_trace`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.dist import trace
from course_lib.dist.runtime import require_on_device
from course_lib.parallel.data.comm_hook import GradBucket

MB = 1024 * 1024  # torch counts bucket_cap_mb in MiB: cap_bytes = int(bucket_cap_mb * 2**20)


# ----------------------------------------------------------------------------------------------
# Splitting a global batch over the data-parallel ranks
# ----------------------------------------------------------------------------------------------


def split_batch(global_batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of rows of ``global_batch`` (rows = first dimension).

    Equal shards are what make the average of the world_size shard-mean losses equal the mean loss
    of the global batch; unequal ones would weight some samples more than others.
    """
    rows = global_batch.shape[0]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..world_size-1 for world_size={world_size}")
    if rows % world_size:
        raise ValueError(
            f"a global batch of {rows} rows does not split evenly over {world_size} data-parallel ranks "
            f"({rows} mod {world_size} = {rows % world_size}): choose a global batch that is a multiple of "
            f"{world_size}, e.g. {rows - rows % world_size} or {rows + world_size - rows % world_size}"
        )
    per_rank = rows // world_size
    return global_batch[rank * per_rank : (rank + 1) * per_rank]


# ----------------------------------------------------------------------------------------------
# The naive version: one all-reduce per parameter, after backward
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, group=None) -> None:
    """Every replica starts from group rank 0's parameters and buffers."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=src, group=group)


class NaiveDataParallel(nn.Module):
    """Wrap ``module``; after ``loss.backward()`` call :meth:`all_reduce_gradients`, then step.

        model = NaiveDataParallel(Transformer(cfg).to(device()))
        next_token_loss(model(x), y).backward()
        model.all_reduce_gradients()     # one blocking all-reduce per parameter
        optimizer.step()

    The same average as :class:`DistributedDataParallel` (each gradient times 1/W, then summed),
    with none of its speed: see the module docstring.
    """

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        require_on_device(module, "NaiveDataParallel")
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        broadcast_from_rank0(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def all_reduce_gradients(self) -> None:
        """g ← Σ_r g_r·(1/W) for every parameter, one collective each, in registration order."""
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / self.world_size)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group)


# ----------------------------------------------------------------------------------------------
# Bucket assignment
# ----------------------------------------------------------------------------------------------


def assign_buckets(nbytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Group tensors, taken in the given order, into buckets: indices into ``nbytes``.

    A bucket takes tensors until its size reaches ``cap_bytes``, then closes; so a bucket can end
    one tensor over the cap, and a tensor larger than the cap gets a bucket of its own. This is
    the rule of torch's ``_compute_bucket_assignment_by_size`` (tests check it against it).
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap of {cap_bytes} bytes must be > 0")
    buckets, current, size = [], [], 0
    for i, b in enumerate(nbytes):
        current.append(i)
        size += b
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass
class Bucket:
    """A flat buffer holding the gradients of ``params`` back to back, in that order."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    buffer: torch.Tensor
    views: list[torch.Tensor]  # views[i]: params[i]'s slice of buffer, shaped like the parameter
    pending: int = 0  # gradients still missing in this backward
    work: object = None  # the async all-reduce in flight, if any
    ready: set = field(default_factory=set)  # ids of params whose gradient is in the buffer


# ----------------------------------------------------------------------------------------------
# The wrapper
# ----------------------------------------------------------------------------------------------


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves rank-averaged gradients in ``param.grad``.

        model = DistributedDataParallel(Transformer(cfg).to(device()), bucket_cap_mb=25)
        loss = model.module.loss(x, y)   or   next_token_loss(model(x), y)
        loss.backward()                  # hooks all-reduce buckets while backward runs
        optimizer.step()

    ``module`` must already be on the rank's device (``course_lib.dist.device()``), as torch's DDP
    expects: the wrapper broadcasts and reduces its tensors where they are and moves nothing.
    ``group``: the data-parallel process group (``None``: the world; ``mesh.group("dp")`` when
    data parallelism is one axis of a device mesh).
    """

    def __init__(self, module: nn.Module, group=None, bucket_cap_mb: float = 25.0):
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb={bucket_cap_mb!r} must be > 0: it is the size (MiB) at which a bucket of "
                "gradients is closed and its all-reduce launched; torch's default is 25"
            )
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        self.cap_bytes = int(bucket_cap_mb * MB)
        self.require_sync = True  # no_sync() turns it off
        self._syncing = False  # a synchronised backward is under way (its finish() is queued)
        self._next_bucket = 0  # buckets are launched strictly in order, the same on every rank
        self._comm_hook = None  # (state, hook) once register_comm_hook is called

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameters that require gradients: nothing to synchronise")
        require_on_device(module, "DistributedDataParallel")  # NCCL broadcasts and reduces device tensors only
        kinds = {(p.dtype, p.device) for _, p in named}
        if len(kinds) > 1:
            raise ValueError(
                f"parameters have several dtypes/devices {sorted(map(str, kinds))}: this DDP keeps "
                "one flat buffer per bucket, so cast the module to one dtype and device first"
            )

        broadcast_from_rank0(module, group)
        self.buckets = self._build_buckets(named[::-1])  # reverse registration order: output layer first
        # where each parameter's gradient goes: (its bucket, its position in the bucket)
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in named]

    # -- 1. same start: broadcast_from_rank0 in the constructor -- 2. buckets -----------------------

    def _build_buckets(self, named: list[tuple[str, nn.Parameter]]) -> list[Bucket]:
        sizes = [p.numel() * p.element_size() for _, p in named]
        buckets = []
        for index, members in enumerate(assign_buckets(sizes, self.cap_bytes)):
            params = [named[i][1] for i in members]
            buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            views, offset = [], 0
            for p in params:
                views.append(buffer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            buckets.append(Bucket(index, params, [named[i][0] for i in members], buffer, views, pending=len(params)))
        return buckets

    # -- 3. hooks and overlap ------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Runs inside backward right after ``param.grad`` was accumulated."""
        if not self.require_sync:
            return  # inside no_sync: the gradient stays (accumulates) in param.grad, nothing is sent
        if not self._syncing:
            # The first gradient of this backward: have the autograd engine call finish() when the
            # whole backward pass is done, so loss.backward() returns with averaged gradients
            # (a private hook of torch's engine; torch's FSDP ends its backward the same way).
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._syncing = True
        bucket, i = self._slot[id(param)]
        if id(param) in bucket.ready:
            raise RuntimeError(
                f"{bucket.names[i]} received its gradient twice in one "
                "backward (a parameter reused across reentrant backward passes?); this DDP "
                "expects one gradient per parameter per backward"
            )
        bucket.ready.add(id(param))
        if self._comm_hook is None:  # pre-divide while copying, as torch's Reducer does (g·(1/W), then SUM)
            torch.mul(param.grad, 1.0 / self.world_size, out=bucket.views[i])
        else:  # a hook gets the raw local gradient and averages itself (torch's convention)
            bucket.views[i].copy_(param.grad)
        bucket.pending -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch, in bucket order, every full bucket whose predecessors are all launched.

        Collectives must be issued in the same order on every rank (they are matched by order);
        launching strictly in index order guarantees it even if gradients arrive in another order.
        """
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            bucket = self.buckets[self._next_bucket]
            if self._comm_hook is None:
                bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                _annotate_comm_span(bucket)
            else:  # a Future of the averaged bucket
                state, hook = self._comm_hook
                is_last = bucket.index == len(self.buckets) - 1
                bucket.work = hook(state, GradBucket(bucket.index, bucket.buffer, bucket.params, is_last))
            self._next_bucket += 1

    # -- 4. finish -----------------------------------------------------------------------------

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every bucket's all-reduce and copy the averages back into ``param.grad``.

        Called automatically at the end of a synchronised backward; calling it again is harmless.
        """
        if not self._syncing:
            return
        missing = [n for b in self.buckets for n, p in zip(b.names, b.params) if id(p) not in b.ready]
        if missing:
            self._reset()
            raise RuntimeError(
                f"backward finished but {len(missing)} parameters got no gradient ({', '.join(missing[:4])}"
                f"{', ...' if len(missing) > 4 else ''}): their buckets were never all-reduced. Every "
                "parameter must take part in the loss (this DDP has no find_unused_parameters)"
            )
        with trace.span("ddp.wait"):
            for bucket in self.buckets:
                result = bucket.work.wait()  # a Work's wait() returns True, a hook's Future its tensor
                if self._comm_hook is not None:
                    bucket.buffer.copy_(result.view_as(bucket.buffer))
                for p, view in zip(bucket.params, bucket.views):
                    p.grad.copy_(view)
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending, bucket.work = len(bucket.params), None
            bucket.ready.clear()
        self._next_bucket, self._syncing = 0, False

    # -- 5. gradient accumulation ----------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block accumulate gradients locally, with no communication.

        What counts is where ``backward()`` runs (torch decides at the forward; running both inside
        the block, as below, behaves the same in both).

            with model.no_sync():
                for x, y in micro_batches[:-1]:
                    model.module.loss(x, y).backward()   # param.grad += local gradient
            model.module.loss(*micro_batches[-1]).backward()  # one all-reduce of the sum
        """
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    # -- 6. communication hooks ----------------------------------------------------------------

    def register_comm_hook(self, state: object, hook) -> None:
        """Call ``hook(state, bucket) -> torch.futures.Future[Tensor]`` for each full bucket instead of
        all-reducing it; the Future's tensor becomes the bucket's gradients. Torch's signature and
        convention: the same hook function works with ``torch.nn.parallel.DistributedDataParallel``."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once (as in torch's DDP)")
        self._comm_hook = (state, hook)

    # -- for lectures and graders ------------------------------------------------------------

    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [list(b.names) for b in self.buckets]


def _annotate_comm_span(bucket: Bucket) -> None:
    """For timelines: tag the comm span the counter just recorded for this bucket's all-reduce.

    The span itself ends when ``wait()`` returns (when the rank *uses* the result); ``meta["done"]``
    adds when the all-reduce actually completed, from a callback on its future.
    """
    for span in trace.last_comm_spans():  # every timeline being recorded (they nest)
        span.meta["bucket"] = bucket.index
        bucket.work.get_future().add_done_callback(lambda _, s=span: s.meta.__setitem__("done", trace.now()))
