"""DeepSpeed-Ulysses: sequence parallel attention by all-to-all — lecture 03 and lab 06 (extra credit).

Jacobs et al. 2023, *DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models*. Outside attention every rank of the group holds s/N tokens
with all h heads. Attention needs whole sequences, but heads are independent of one another, so
before attention one all-to-all *transposes* the sharding: afterwards each rank holds all s tokens
of h/N heads, runs ordinary causal attention on them, and a second all-to-all transposes back.

    [b, h, s/N, d]  --all-to-all-->  [b, h/N, s, d]  --attention-->  [b, h/N, s, d]  --all-to-all-->  [b, h, s/N, d]

One all-to-all each for q, k and v, one for the output: four per layer forward, four in backward.

Autograd. An all-to-all only moves data: it is a permutation of the concatenated tensors of all
ranks, and the transpose of a permutation is its inverse. So the gradient of "scatter along dim
a, gather along dim b" is "scatter along b, gather along a" — the other all-to-all. We write that
as a five-line autograd Function (:class:`_AllToAll`, as DeepSpeed's ``_SeqAllToAll`` does) rather
than call ``torch.distributed.nn.functional.all_to_all_single`` (which also works on gloo): the
backward is then on the page, and the test that counts the backward's all-to-alls checks it.

Constraints: the degree N must divide the query heads and the key/value heads (a rank attends
with whole heads; for grouped-query attention each rank needs whole K/V groups too), and the
sequence (every rank the same s/N). So Ulysses alone stops at N = h_kv (N = h if K/V heads are
repeated); ring attention, or both combined (Fang & Zhao 2024, USP), go further.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.cost.collective_bytes import check_ulysses_divisible


def split(x: torch.Tensor, rank: int, cp_size: int, dim: int = -2) -> torch.Tensor:
    """This rank's contiguous 1/N of the sequence (Ulysses' layout: rank r holds tokens r·s/N ...)."""
    if x.shape[dim] % cp_size:
        raise ValueError(
            f"sequence length {x.shape[dim]} is not divisible by the Ulysses degree {cp_size}: every rank must "
            f"hold s/N tokens; pad the sequence to a multiple of {cp_size}"
        )
    return x.chunk(cp_size, dim=dim)[rank]


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Cut ``x`` into N pieces along ``scatter_dim``, send piece i to rank i, and concatenate the
    pieces received (in rank order) along ``gather_dim``. One ``dist.all_to_all_single`` call."""
    cp_size = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp_size, dim=scatter_dim))  # [N, ...piece]: piece i goes to rank i
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """y = all_to_all(x, a, b); its backward is all_to_all(dy, b, a), the inverse permutation."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, dy):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(dy.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """[b, h, s/N, d] (a sequence shard, all heads) -> [b, h/N, s, d] (all tokens, a head shard)."""
    return _AllToAll.apply(x, 1, 2, group)


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """[b, h/N, s, d] -> [b, h, s/N, d]: the inverse of :func:`seq_to_heads`."""
    return _AllToAll.apply(x, 2, 1, group)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None) -> torch.Tensor:
    """Causal attention of a sequence split contiguously over ``group`` (this rank's shard in, out).

    q: [b, h, s/N, d]; k, v: [b, h_kv, s/N, d]. Query head i reads K/V head i // (h/h_kv); since N
    divides both h and h_kv, rank r's query heads r·h/N ... exactly read its K/V heads r·h_kv/N ...
    """
    cp_size = dist.get_world_size(group)
    check_ulysses_divisible(q.shape[1], k.shape[1], cp_size)
    qh, kh, vh = (seq_to_heads(t, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=kh.shape[1] != qh.shape[1])
    return heads_to_seq(out, group)
