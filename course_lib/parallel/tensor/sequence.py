"""Megatron sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", §4.2.2): the communication that turns tensor parallelism into TP+SP.

Tensor parallelism (:mod:`course_lib.parallel.tensor`) splits the matmuls, but everything between
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
  activation model of :mod:`course_lib.cost.activations` scale as 1/t under TP+SP.

Layout: the course model keeps activations as [batch, seq, hidden], so the sequence is dim 1, and
``all_gather_single`` / ``reduce_scatter_single`` work along dim 0: each op costs one extra
copy to move the rank axis. Megatron keeps [seq, batch, hidden] precisely to make this free.
Rank r holds positions [r·s/t, (r+1)·s/t).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.parallel.tensor.comms import check_sequence_divisible


def shard_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of the sequence (dim 1): positions [r·s/t, (r+1)·s/t). No communication."""
    tp_size = dist.get_world_size(group)
    check_sequence_divisible(x.shape[1], tp_size)
    return x.chunk(tp_size, dim=1)[dist.get_rank(group)]


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
    if not grads or dist.get_world_size(group) == 1:
        return len(grads)
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(grads)
