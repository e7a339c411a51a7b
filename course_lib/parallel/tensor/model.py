"""The course model under Megatron tensor parallelism: attention, MLP, block and whole model.

Built from the pieces of :mod:`course_lib.parallel.tensor` (f/g, column/row linear, vocab-parallel
embedding and cross-entropy), each layer made ``from_dense`` so that a TP model and a dense model
from the same seed hold the same numbers. Attention splits heads (wq/wk/wv column-parallel, wo
row-parallel), the MLP splits hidden units (w1/w3 column, w2 row): Shoeybi et al. 2019, §3, Fig. 3.
With ``sequence_parallel=True`` the regions between sub-layers are sequence-sharded instead of
replicated (Korthikanti et al. 2022, §4.2.2; :mod:`course_lib.parallel.tensor.sequence`).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.layers import apply_rope
from course_lib.parallel.tensor.comms import check_divisible, tp_group
from course_lib.parallel.tensor.sequence import (
    check_sequence_divisible,
    mark_sequence_parallel,
    sync_sequence_parallel_grads,
)
from course_lib.parallel.tensor.sharded_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_region,
    vocab_parallel_cross_entropy,
)


class TPAttention(nn.Module):
    """``course_lib.model.transformer.Attention`` with its heads split: rank r runs query heads [r·H/t, (r+1)·H/t)
    and K/V heads [r·Hkv/t, (r+1)·Hkv/t) — wq/wk/wv column-parallel, wo row-parallel (§3, Fig. 3b).

    GQA needs nothing more: query head h reads K/V head h // (H/Hkv), and when t divides both H and
    Hkv every query head finds its K/V head on its own rank. When t does not divide Hkv we refuse;
    Megatron instead replicates K/V heads, which this course leaves out to keep the split exact.
    """

    def __init__(self, dense, group, sequence_parallel: bool = False):
        super().__init__()
        group = tp_group(group)
        tp_size = dist.get_world_size(group)
        self.head_dim, self.group, self.sequence_parallel = dense.head_dim, group, sequence_parallel
        n_heads, n_kv_heads = dense.wq.out_features // self.head_dim, dense.wk.out_features // self.head_dim
        check_divisible("attention heads", n_heads, tp_size, "change n_heads: each rank computes whole heads")
        check_divisible(
            "key/value heads",
            n_kv_heads,
            tp_size,
            "raise n_kv_heads: each rank needs whole K/V heads for its query heads (GQA)",
        )
        self.wq = ColumnParallelLinear.from_dense(dense.wq, group, sequence_parallel)
        self.wk = ColumnParallelLinear.from_dense(dense.wk, group, sequence_parallel)
        self.wv = ColumnParallelLinear.from_dense(dense.wv, group, sequence_parallel)
        self.wo = RowParallelLinear.from_dense(dense.wo, group, sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # one f (or one all-gather) for the three projections: they read the same x
        q, k, v = column_region(x, [self.wq.weight, self.wk.weight, self.wv.weight], self.group, self.sequence_parallel)
        b, s = q.shape[:2]  # s is the full sequence, also under SP: the region gathered it
        q, k, v = (y.view(b, s, -1, self.head_dim).transpose(1, 2) for y in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class TPMLP(nn.Module):
    """SwiGLU w2(SiLU(w1·x) ⊙ w3·x) with hidden units split: w1, w3 column-parallel, w2 row-parallel.

    SiLU and ⊙ act on each hidden unit alone, so rank r can apply them to its slice: this is why the
    first matrix is split by columns (§3: splitting it by rows would need a sum before the GeLU).
    """

    def __init__(self, dense, group, sequence_parallel: bool = False):
        super().__init__()
        group = tp_group(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        check_divisible("MLP hidden units (d_ff)", dense.w1.out_features, dist.get_world_size(group), "change d_ff")
        self.w1 = ColumnParallelLinear.from_dense(dense.w1, group, sequence_parallel)
        self.w3 = ColumnParallelLinear.from_dense(dense.w3, group, sequence_parallel)
        self.w2 = RowParallelLinear.from_dense(dense.w2, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_region(x, [self.w1.weight, self.w3.weight], self.group, self.sequence_parallel)
        return self.w2(F.silu(gate) * up)


def _replicated_norm(norm, sequence_parallel: bool):
    norm = copy.deepcopy(norm)
    if sequence_parallel:  # it will see s/t tokens per rank: its gradient is partial
        mark_sequence_parallel(norm.weight)
    return norm


class TPBlock(nn.Module):
    """``course_lib.model.transformer.Block`` tensor-parallel: same names, same forward, sharded weights.

    Collectives per block: TP 2 all-reduces forward (the two g) and 2 backward (the two f).
    TP+SP: input and output are sequence shards [b, s/t, h]; 2 all-gathers + 2 reduce-scatters
    forward, 2 reduce-scatters + 4 all-gathers backward (two of them re-gather stored shards),
    plus the norm-gradient all-reduce of :func:`course_lib.parallel.tensor.sequence.sync_sequence_parallel_grads`.
    """

    def __init__(self, dense, group, sequence_parallel: bool = False):
        super().__init__()
        group = tp_group(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.attention_norm = _replicated_norm(dense.attention_norm, sequence_parallel)
        self.attention = TPAttention(dense.attention, group, sequence_parallel)
        self.ffn_norm = _replicated_norm(dense.ffn_norm, sequence_parallel)
        self.feed_forward = TPMLP(dense.feed_forward, group, sequence_parallel)

    @classmethod
    def from_dense(cls, block, group, sequence_parallel: bool = False) -> TPBlock:
        return cls(block, group, sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class TPTransformer(nn.Module):
    """``course_lib.model.transformer.Transformer`` sharded over a TP group; forward returns this rank's logits
    [b, s, V/t] (vocabulary slice), ``loss`` the vocab-parallel cross-entropy (equal on every rank).

    With ``sequence_parallel=True`` the embedding reduce-scatters to sequence shards, the blocks and
    the final norm run on them, and the output layer gathers them back. After ``backward()`` call
    :meth:`sync_grads` (a no-op without SP) before the optimizer step.
    """

    def __init__(self, dense, group, sequence_parallel: bool = False):
        super().__init__()
        group = tp_group(group)
        self.cfg, self.group, self.sequence_parallel = dense.cfg, group, sequence_parallel
        self.tok_embeddings = VocabParallelEmbedding.from_dense(dense.tok_embeddings, group, sequence_parallel)
        self.layers = nn.ModuleList(TPBlock(layer, group, sequence_parallel) for layer in dense.layers)
        self.norm = _replicated_norm(dense.norm, sequence_parallel)
        self.output = ColumnParallelLinear.from_dense(dense.output, group, sequence_parallel)
        if self.cfg.tie_embeddings:  # both are [V/t, d] row slices of one table
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", dense.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", dense.rope_sin.clone(), persistent=False)

    @classmethod
    def from_dense(cls, model, group, sequence_parallel: bool = False) -> TPTransformer:
        return cls(model, group, sequence_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if s > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len={self.cfg.max_seq_len}")
        if self.sequence_parallel:
            check_sequence_divisible(s, dist.get_world_size(self.group))
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self(tokens), targets, self.group)

    def sync_grads(self) -> None:
        """Under SP, all-reduce the norm gradients (partial sums over sequence shards); else nothing."""
        if self.sequence_parallel:
            sync_sequence_parallel_grads(self, self.group)
