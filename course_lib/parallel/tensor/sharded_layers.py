"""Megatron-LM 1D tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", §3) for the course model.

A linear layer Y = X·A can be split two ways over the t = tp_size ranks of a tensor-parallel (TP) group:

    column parallel   A = [A_1 ... A_t]   (split the outputs)   Y_i = X·A_i       X replicated, Y split
    row parallel      A = [A_1; ...; A_t] (split the inputs)    Y = Σ_i X_i·A_i   X split, Y summed

A column-parallel layer followed by a row-parallel one needs no communication in between (each rank
feeds its own slice of Y straight into its rows of the next matrix), so a whole sub-layer —
attention (heads split) or the MLP (hidden units split) — costs two collectives, placed by two
conjugate operators (§3, Fig. 3):

    f   identity forward,  all-reduce backward   (enters a parallel region: X is replicated)
    g   all-reduce forward, identity backward    (leaves it: sums the row-parallel partial results)

One f and one g per sub-layer, so per transformer block: 2 all-reduces forward, 2 backward. q, k and
v (and SwiGLU's gate and up) read the same input, so they share ONE f (:func:`column_region`): one
all-reduce for their summed input gradient, not three. With ``sequence_parallel=True`` f and g become
all-gather / reduce-scatter along the sequence (:mod:`course_lib.parallel.tensor.sequence`).

The vocabulary is split too (§3, end): the embedding table by rows, the output layer by columns,
and the cross-entropy runs on vocabulary-sharded logits with three all-reduces of one float per
token instead of an all-gather of [tokens, vocabulary] logits.

Weights: a TP layer is made from a dense one with ``from_dense`` (build the dense model from a seed,
keep your slice), so a TP model and a dense model from the same seed hold the same numbers —
Megatron's CPU initialisation does the same. Each sharded parameter carries ``partition_dim`` (the
dimension that was split) so :func:`shard_of` can cut the matching slice of a dense tensor.

Every layer takes ``group``: a process group, or a ``course_lib.dist.Mesh`` (its "tp" axis is used).

Reading order: f and g -> column/row linear -> vocab-parallel embedding and cross-entropy.
The course model's attention, MLP, block and whole model built from these are in
:mod:`course_lib.parallel.tensor.model`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.parallel.tensor.comms import (
    GatherColumnLinear,
    check_divisible,
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel,
    tp_group,
)

# ------------------------------------------------------------------------------------- f and g


def column_region(x, weights, group, sequence_parallel: bool = False) -> list[torch.Tensor]:
    """Enter a parallel region once and apply every column-parallel weight that reads ``x``.

    TP: f(x), then X·A_iᵀ for each local slice. TP+SP: ``x`` is this rank's sequence shard; all-gather
    it, multiply, and keep only the shard for backward (Korthikanti et al. 2022, §4.2.2).
    """
    if sequence_parallel:
        return list(GatherColumnLinear.apply(x, group, *weights))
    x = copy_to_tensor_parallel_region(x, group)
    return [F.linear(x, w) for w in weights]


def shard_of(tensor: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """The slice of a dense ``tensor`` (a weight or its gradient) that this rank's ``param`` holds."""
    dim = getattr(param, "partition_dim", None)
    if dim is None:
        return tensor  # replicated
    return tensor.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


def _sharded(weight: torch.Tensor, dim: int, group) -> nn.Parameter:
    p = nn.Parameter(weight.detach().chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].clone())
    p.partition_dim = dim
    return p


# ----------------------------------------------------------------------------------- the layers


class _ShardedLinear(nn.Module):
    """A bias-free linear whose weight [out, in] is split along ``partition_dim`` over the TP group.

    The two subclasses differ only in that dimension (0: output rows, 1: input columns) and in the
    collective their forward needs.
    """

    partition_dim: int
    split: str  # what the split divides, for the error message

    def __init__(self, in_features: int, out_features: int, group, sequence_parallel: bool = False):
        super().__init__()
        group = tp_group(group)
        tp_size = dist.get_world_size(group)
        shape = [out_features, in_features]
        check_divisible(
            f"{self.split} of a {type(self).__name__} ({in_features} -> {out_features})",
            shape[self.partition_dim],
            tp_size,
            "choose a layer width that is a multiple of it",
        )
        shape[self.partition_dim] //= tp_size
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel = group, sequence_parallel
        # host: a placeholder on the default device like nn.Linear's; from_dense replaces it by a slice where the dense weight is
        self.weight = nn.Parameter(torch.empty(shape))
        self.weight.partition_dim = self.partition_dim

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, sequence_parallel: bool = False):
        """This rank's slice of a dense ``linear`` (same seed, same numbers: see the module doc)."""
        if linear.bias is not None:
            raise ValueError(f"the course model's linears have no bias; {cls.__name__} does not shard one")
        layer = cls(linear.in_features, linear.out_features, group, sequence_parallel)
        layer.weight = _sharded(linear.weight, cls.partition_dim, layer.group)
        return layer


class ColumnParallelLinear(_ShardedLinear):
    """Y_i = X·A_iᵀ with A split by output rows: weight [out/t, in]; input replicated, output split.

    Its forward applies f itself (or the SP all-gather), so it works alone; inside a block several
    column layers that read one input share one entry through :func:`column_region`.
    """

    partition_dim, split = 0, "output features"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_region(x, [self.weight], self.group, self.sequence_parallel)[0]


class RowParallelLinear(_ShardedLinear):
    """Y = g(X_i·A_iᵀ) with A split by input columns: weight [out, in/t]; input split, output summed.

    With sequence parallelism the sum is a reduce-scatter along the sequence instead of an all-reduce.
    """

    partition_dim, split = 1, "input features"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(partial, self.group)
        return reduce_from_tensor_parallel_region(partial, self.group)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (token ids): rank r holds ids [r·V/t, (r+1)·V/t).

    Each rank looks up the tokens it owns, writes zeros for the others, and g sums the t partial
    tables — every token has exactly one owner, so the sum is the dense lookup. Backward: g is the
    identity, each rank scatters ∂L/∂E into the rows it owns. With sequence parallelism the sum is a
    reduce-scatter, and the output is this rank's sequence shard.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group, sequence_parallel: bool = False):
        super().__init__()
        group = tp_group(group)
        tp_size, rank = dist.get_world_size(group), dist.get_rank(group)
        check_divisible(
            "vocabulary entries",
            num_embeddings,
            tp_size,
            "pad the vocabulary to a multiple of it (Megatron pads to a multiple of 128·t)",
        )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel = group, sequence_parallel
        per_rank = num_embeddings // tp_size
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        # host: a placeholder on the default device like nn.Linear's; from_dense replaces it by a slice where the dense weight is
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim))
        self.weight.partition_dim = 0

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group, sequence_parallel: bool = False) -> VocabParallelEmbedding:
        layer = cls(emb.num_embeddings, emb.embedding_dim, group, sequence_parallel)
        layer.weight = _sharded(emb.weight, 0, layer.group)
        return layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        foreign = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(foreign, 0)  # any valid row; zeroed just below
        partial = F.embedding(local, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(partial, self.group)
        return reduce_from_tensor_parallel_region(partial, self.group)


# -------------------------------------------------------------------- vocab-parallel cross-entropy


class VocabParallelCrossEntropy(torch.autograd.Function):
    """L_n = log Σ_v exp(z_nv) − z_{n,y_n} on logits split by vocabulary, with exactly 3 all-reduces.

    Rank r holds z[:, r·V/t : (r+1)·V/t]. Forward (Shoeybi et al. 2019, §3, end; Megatron-Core's
    ``vocab_parallel_cross_entropy``), each all-reduce over [N] floats, never [N, V]:
        1. m_n = max_v z_nv                  all-reduce MAX  (for a stable log-sum-exp)
        2. z_{n,y_n} − m_n                   all-reduce SUM  (only the owner of y_n contributes)
        3. S_n = Σ_v exp(z_nv − m_n)         all-reduce SUM
        L_n = log S_n − (z_{n,y_n} − m_n)
    Backward needs no communication: ∂L_n/∂z_nv = softmax_nv − [v = y_n], and both pieces are local.
    Targets equal to ``ignore_index`` contribute 0 (their loss and gradient are masked).
    """

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        z = logits.float()
        per_rank, r = z.shape[-1], dist.get_rank(group)
        start = r * per_rank
        logits_max = z.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)  # 1
        z = z - logits_max.unsqueeze(-1)
        mine = (targets >= start) & (targets < start + per_rank)
        local_t = (targets - start).masked_fill(~mine, 0)
        target_logit = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        dist.all_reduce(target_logit, group=group)  # 2
        exp = z.exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)  # 3
        valid = targets != ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, mine, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits, targets, group, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy from vocabulary-sharded logits [..., V/t]; = F.cross_entropy on the full logits."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: expected "
            f"targets of shape logits.shape[:-1]"
        )
    losses = VocabParallelCrossEntropy.apply(logits, targets, tp_group(group), ignore_index)
    return losses.sum() / (targets != ignore_index).sum().clamp_min(1)
