"""The communication of tensor parallelism, as autograd functions: the leaf of ``parallel/tensor``.

Megatron's conjugate operators (Shoeybi et al. 2019, §3, Fig. 3) and their sequence-parallel
halves (Korthikanti et al. 2022, §4.2.2, Fig. 5, operators g and ḡ):

    f    identity forward,   all-reduce backward      copy_to_tensor_parallel_region
    g    all-reduce forward, identity backward        reduce_from_tensor_parallel_region
    ḡ    all-gather forward, reduce-scatter backward  gather_from_sequence_parallel
    ḡ*   reduce-scatter forward, all-gather backward  reduce_scatter_to_sequence_parallel

plus :class:`GatherColumnLinear`, the all-gather fused with a column-parallel matmul that
re-gathers its input in backward instead of saving it. Layers (:mod:`.sharded_layers`), sequence
parallelism (:mod:`.sequence`) and the TP model (:mod:`.model`) are built on these.

Shapes write t for tp_size (Korthikanti et al.'s symbol): a sequence shard is [b, s/t, h].
Layout: activations are [batch, seq, hidden], so the sequence is dim 1, and
``all_gather_single`` / ``reduce_scatter_single`` work along dim 0: each op costs one extra
copy to move the rank axis. Megatron keeps [seq, batch, hidden] precisely to make this free.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.dist import Mesh


def check_divisible(what: str, count: int, tp_size: int, fix: str) -> None:
    """Every split in TP must be even: a clear error naming the constraint and a way out."""
    if count % tp_size:
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        raise ValueError(
            f"tensor parallel size {tp_size} does not divide {count} {what}: choose a tensor parallel size "
            f"among {divisors}, or {fix}"
        )


def tp_group(group_or_mesh):
    """Accept a process group or a course_lib Mesh (its "tp" axis)."""
    return group_or_mesh.group("tp") if isinstance(group_or_mesh, Mesh) else group_or_mesh


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron-LM's f (Shoeybi et al. 2019, §3, Fig. 3a): identity forward, all-reduce backward.

    X enters a parallel region replicated; rank i uses it for its slice Y_i = X·A_i only, so rank i's
    ∂L/∂X = ∂L/∂Y_i·A_iᵀ is a partial sum and the full gradient is Σ_i of them: an all-reduce.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # a fresh buffer produced for this node alone: reduce it in place
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron-LM's g (Shoeybi et al. 2019, §3, Fig. 3a): all-reduce forward, identity backward.

    A row-parallel layer leaves partial products X_i·A_i on each rank; g sums them. The sum's
    gradient with respect to each summand is the identity, so backward passes ∂L/∂Y through.
    """

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()  # leave the caller's tensor as it was
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel_region(x, group):
    """f: identity forward, all-reduce backward."""
    return CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    """g: all-reduce forward, identity backward."""
    return ReduceFromTensorParallelRegion.apply(x, group)


def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s/t, ...] shards of all ranks -> [b, s, ...] (plain tensors, no autograd)."""
    tp_size = dist.get_world_size(group)
    if tp_size == 1:
        return x
    x = x.contiguous()
    # gloo wants the concatenated form [t·b, s/t, ...]: rank r's shard is rows r·b .. (r+1)·b
    gathered = x.new_empty((tp_size * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(gathered, x, group=group)
    return gathered.unflatten(0, (tp_size, x.shape[0])).movedim(0, 1).flatten(1, 2)  # -> [b, t·s/t, ...], one copy


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, ...] partial sums on every rank -> this rank's [b, s/t, ...] slice of their sum."""
    tp_size = dist.get_world_size(group)
    if tp_size == 1:
        return x
    check_sequence_divisible(x.shape[1], tp_size)
    stacked = x.unflatten(1, (tp_size, x.shape[1] // tp_size)).movedim(1, 0).contiguous()  # [t, b, s/t, ...]
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


def check_sequence_divisible(seq_len: int, tp_size: int) -> None:
    if seq_len % tp_size:
        raise ValueError(
            f"sequence parallel size {tp_size} does not divide the sequence length {seq_len}: every rank must hold "
            f"the same number of positions; pad or crop the sequence to a multiple of {tp_size}, or use plain "
            f"tensor parallelism (sequence_parallel=False)"
        )
