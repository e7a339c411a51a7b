"""Megatron sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", §4.2.2): the communication that turns tensor parallelism into TP+SP.

Tensor parallelism (:mod:`course_lib.tensor_parallel`) splits the matmuls, but everything between
them — the RMSNorms, the residual adds — runs on the full [b, s, h] activation on every rank of the
TP group, and the activations those pieces save are replicated t times. Sequence parallelism splits
that part along the *sequence*: between two parallel regions each rank holds s/t positions.

The all-reduce of Megatron's g is a reduce-scatter followed by an all-gather, so TP+SP just moves
the two halves apart (Korthikanti, Fig. 5, operators g and ḡ):

    TP:      f: identity fwd / all-reduce bwd            g: all-reduce fwd / identity bwd
    TP+SP:   ḡ: all-gather fwd / reduce-scatter bwd      ḡ*: reduce-scatter fwd / all-gather bwd

A ring all-reduce of S bytes sends 2(t-1)/t·S per rank; a reduce-scatter plus an all-gather send
(t-1)/t·S each: the same volume, so SP's memory saving costs no extra bandwidth. Two details:

* Norm weights now see only s/t tokens on each rank, so their gradients are partial sums and must
  be all-reduced over the TP group (:func:`sync_sequence_parallel_grads`, Megatron does the same
  in its ``finalize_model_grads``).
* To store only the s/t shard of a column-parallel layer's input (and not the gathered [b, s, h]
  tensor its matmul needs for the weight gradient), :class:`GatherColumnLinear` re-gathers it in
  the backward pass: one more all-gather per region, which Megatron overlaps with the input-
  gradient matmul (Korthikanti §4.2.2, last paragraph). That is what makes every term of the
  activation model of :mod:`course_lib.activation_memory` scale as 1/t under TP+SP.

Layout: the course model keeps activations as [batch, seq, hidden], so the sequence is dim 1, and
``all_gather_single`` / ``reduce_scatter_single`` work along dim 0: each op costs one extra
copy to move the rank axis. Megatron keeps [seq, batch, hidden] precisely to make this free.
Rank r holds positions [r·s/t, (r+1)·s/t).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _size(group) -> int:
    return dist.get_world_size(group)


def check_sequence_divisible(seq_len: int, tp: int) -> None:
    if seq_len % tp:
        raise ValueError(
            f"sequence parallel size {tp} does not divide the sequence length {seq_len}: every rank must hold "
            f"the same number of positions; pad or crop the sequence to a multiple of {tp}, or use plain "
            f"tensor parallelism (sequence_parallel=False)"
        )


def shard_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of the sequence (dim 1): positions [r·s/t, (r+1)·s/t). No communication."""
    t = _size(group)
    check_sequence_divisible(x.shape[1], t)
    return x.chunk(t, dim=1)[dist.get_rank(group)]


def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s/t, ...] shards of all ranks -> [b, s, ...] (plain tensors, no autograd)."""
    t = _size(group)
    if t == 1:
        return x
    x = x.contiguous()
    # gloo wants the concatenated form [t·b, s/t, ...]: rank r's shard is rows r·b .. (r+1)·b
    gathered = x.new_empty((t * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(gathered, x, group=group)
    return gathered.unflatten(0, (t, x.shape[0])).movedim(0, 1).flatten(1, 2)  # -> [b, t·s/t, ...], one copy


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, ...] partial sums on every rank -> this rank's [b, s/t, ...] slice of their sum."""
    t = _size(group)
    if t == 1:
        return x
    check_sequence_divisible(x.shape[1], t)
    stacked = x.unflatten(1, (t, x.shape[1] // t)).movedim(1, 0).contiguous()  # [t, b, s/t, ...]
    out = x.new_empty(stacked.shape[1:])
    dist.reduce_scatter_single(out, stacked.flatten(0, 1), group=group)  # gloo: the concatenated form
    return out


class GatherFromSequenceParallel(torch.autograd.Function):
    """ḡ of Korthikanti Fig. 5: all-gather along the sequence forward, reduce-scatter backward.

    Each rank's output is used for all s positions by this rank only; the gradient flowing back is a
    partial sum over the TP ranks, and each rank needs the sum for its own s/t positions.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """ḡ* of Korthikanti Fig. 5 (Megatron's g with SP): reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


def gather_from_sequence_parallel(x, group):
    return GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x, group):
    return ReduceScatterToSequenceParallel.apply(x, group)


class GatherColumnLinear(torch.autograd.Function):
    """Y_i = AllGather_seq(X_shard) · A_iᵀ for several column-parallel weights that read the same input
    (q, k, v; or SwiGLU's gate and up), saving only X_shard (Korthikanti §4.2.2).

    Forward: one all-gather. Backward: one all-gather again (to rebuild X for the weight gradients
    ∂A_i = ∂Y_iᵀ·X) and one reduce-scatter of ∂X = Σ_i ∂Y_i·A_i, the sequence-parallel form of f's
    all-reduce. Weights are [out_i/t, in] slices; returns one output per weight.
    """

    @staticmethod
    def forward(ctx, x_shard, group, *weights):
        ctx.group = group
        ctx.save_for_backward(x_shard, *weights)
        full = all_gather_sequence(x_shard, group)
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x_shard, *weights = ctx.saved_tensors
        full = all_gather_sequence(x_shard, ctx.group)  # recomputed, not stored: the 1/t of the memory model
        flat_x = full.flatten(0, -2)
        grad_weights = [g.flatten(0, -2).t().mm(flat_x) for g in grads]
        grad_full = grads[0].matmul(weights[0])
        for g, w in zip(grads[1:], weights[1:]):
            grad_full = grad_full + g.matmul(w)
        return (reduce_scatter_sequence(grad_full, ctx.group), None, *grad_weights)


def mark_sequence_parallel(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Tag a replicated parameter that runs on sequence shards (norm weights): its gradient is partial."""
    param.sequence_parallel = True
    return param


def sync_sequence_parallel_grads(module: torch.nn.Module, group) -> int:
    """All-reduce (sum) the gradients of every tagged parameter over the TP group, in ONE call.

    Call after backward, before the optimizer step. Norm weights on rank r saw only its s/t
    positions, so ∂L/∂g = Σ_r (∂L/∂g)_r. The gradients are flattened into one buffer because
    they are tiny (h floats each) and a call's latency, not its bytes, is their cost. Returns the
    number of gradients synchronised.
    """
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or _size(group) == 1:
        return len(grads)
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(grads)


def wire_bytes(counts: dict, t: int) -> float:
    """Ring wire bytes per rank of a ``CommCounter.as_dict()``: all-reduce 2(t-1)/t of its payload,
    reduce-scatter (t-1)/t of its input, all-gather (t-1) times its shard (:func:`course_lib.memory.ring_wire_bytes`)."""
    from course_lib.memory import ring_wire_bytes

    return ring_wire_bytes(counts, t)


def _count_block_rank(cfg, batch, seq_len, settings, seed):
    from course_lib.dist import Mesh, counter, device
    from course_lib.model import Transformer
    from course_lib.tp_model import TPBlock

    mesh = Mesh(tp=dist.get_world_size())
    torch.manual_seed(seed)
    dense = Transformer(cfg).to(device())
    cos, sin = dense.rope_cos[:seq_len], dense.rope_sin[:seq_len]
    results = {}
    for sp in settings:
        block = TPBlock(dense.layers[0], mesh, sequence_parallel=sp)
        x = torch.randn(batch, seq_len, cfg.d_model, generator=torch.Generator().manual_seed(seed)).to(device())
        x = (shard_sequence(x, mesh.group("tp")) if sp else x).clone().requires_grad_(True)
        with counter.count() as fwd:
            y = block(x, cos, sin)
        with counter.count() as bwd:
            y.sum().backward()
        with counter.count() as sync:
            sync_sequence_parallel_grads(block, mesh.group("tp")) if sp else None
        results["TP+SP" if sp else "TP"] = {"forward": fwd.as_dict(), "backward": bwd.as_dict(),
                                            "norm gradients": sync.as_dict()}
    return results


def collectives_per_layer(cfg, tp: int = 2, batch: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """For the lecture: collectives one rank issues in one ``TPBlock``, TP and TP+SP, from the counter.

    Returns {"TP": {"forward": {...}, "backward": {...}, "norm gradients": {...}}, "TP+SP": {...}},
    each a ``CommCounter.as_dict()`` ({"all_reduce@tp": {"calls": 2, "bytes": ...}, ...}); feed one to
    :func:`wire_bytes` for the ring traffic. One launch of ``tp`` ranks.
    """
    from course_lib.dist import launch

    return launch(_count_block_rank, tp, cfg, batch, seq_len, (False, True), seed, timeout=120)[0]
