"""Lab 06 — sequence parallel attention: ring attention (and Ulysses for extra credit).

N ranks each hold 1/N of a long sequence. You make them compute *causal* attention over the whole
sequence, and its gradients, without any rank ever holding all of it.

Shapes: q is [b, h, L, d], k and v are [b, h_kv, L, d] (grouped-query attention: query head i
reads K/V head i // (h / h_kv)), L = s/N tokens on this rank.

Layout for the ring ("zigzag", the causal load balancing of Megatron-LM's context parallelism):
the sequence is cut into 2N chunks of c = s/2N tokens and rank r holds chunks r and 2N-1-r, in
that order — L = 2c rows, first its early chunk, then its late one. (``shard`` and ``unshard``,
given, cut and reassemble.)

Given, from course_lib.parallel.context.ring_attention (read their docstrings):
    block_attention(q, k, v, causal)  -> (out, lse)   fp32 attention of one block pair + log-sum-exp
    block_attention_backward(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)   with the FINAL out, lse
``causal=True`` needs a square block whose rows and columns are the same positions (a diagonal).
Call ``block_attention`` and ``block_attention_backward`` by those names: the grader counts the work
you hand them, and records when they run against when your receives are posted and complete.

Also given, from course_lib.dist.p2p: ``exchange(sends=[(tensor, peer)], recvs=[(buffer, peer)],
group, tag)`` posts its ``dist.isend`` and ``dist.irecv`` calls as one batch and returns the works
to ``wait()`` on. Every rank sends right while it receives from the left; posted one by one, the
sends and receives of two neighbours cross (at N = 2 both neighbours are the same rank), which gloo
absorbs but NCCL can deadlock on once a block exceeds its internal buffer. NCCL's user guide
("Point-to-point communication") puts calls that must progress together in one group, which is
what ``exchange`` does (``dist.batch_isend_irecv``).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.dist.p2p import exchange
from course_lib.parallel.context.ring_attention import block_attention, block_attention_backward, shard, unshard  # noqa: F401


def neighbours(group=None) -> tuple[int, int, int, int]:
    """(my index in the group, group size, global rank of my right neighbour, of my left one)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    right, left = (rank + 1) % n, (rank - 1) % n
    if group is not None:
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    return rank, n, right, left


# ------------------------------------------------------------------------------ Task 1


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions of the same query rows over disjoint sets of keys.

    out_*: [..., m, d], lse_*: [..., m] (log of each row's softmax denominator). Return (out, lse):
        lse = log(e^lse_a + e^lse_b),   out = e^(lse_a - lse)·out_a + e^(lse_b - lse)·out_b
    It must be exact for a row that is still empty (lse_a = -inf, out_a = 0), and must not
    overflow when the lse are large (1000 and more): never compute e^lse itself.
    """
    # BEGIN SOLUTION Task 1: merge two partial softmax results by their log-sum-exp; returns (out, lse)
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse
    # END SOLUTION


# ------------------------------------------------------------------------------ Task 2


def ring_attention_forward(q, k, v, group=None):
    """Causal attention of this rank's zigzag shard; returns (out fp32 [b, h, L, d], lse [b, h, L]).

    Schedule: N steps; at step t you hold the K/V of rank src = (rank - t) mod N. Before computing
    on it, start sending it to the right neighbour and receiving the next one from the left
    (one ``exchange`` of dist.isend / dist.irecv), compute, and only then wait for the works: the
    transfer hides behind the compute (the grader checks that a block_attention runs between posting
    each receive and its completion). N-1 K/V transfers in all. Per step:
      * src == rank: all L query rows against all L keys, causal (local order is global order);
      * src <  rank: all query rows against the first c keys (src's early chunk), not causal;
      * src >  rank: only the last c query rows (my late chunk) against all L keys, not causal;
    and merge each result into (out, lse) with merge_partials. Everything else is masked: skip it.
    """
    # BEGIN SOLUTION Task 2: zigzag ring forward, next K/V in flight while computing; returns (out, lse), fp32
    rank, n, right, left = neighbours(group)
    length, c = q.shape[-2], q.shape[-2] // 2
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:  # the next block travels while this one is computed on
            nk, nv = torch.empty_like(k), torch.empty_like(v)
            works = exchange([(k.contiguous(), right), (v.contiguous(), right)], [(nk, left), (nv, left)], group)
        if src == rank:
            rows, keys, causal = slice(0, length), slice(0, length), True
        elif src < rank:
            rows, keys, causal = slice(0, length), slice(0, c), False
        else:
            rows, keys, causal = slice(c, length), slice(0, length), False
        o, block_lse = block_attention(q[..., rows, :], k[..., keys, :], v[..., keys, :], causal)
        out[..., rows, :], lse[..., rows] = merge_partials(out[..., rows, :], lse[..., rows], o, block_lse)
        if step < n - 1:
            for w in works:
                w.wait()
            k, v = nk, nv
    return out, lse
    # END SOLUTION


# ------------------------------------------------------------------------------ Task 3


def ring_attention_backward(dout, q, k, v, out, lse, group=None):
    """Gradients (dq, dk, dv) of this rank's shard, all fp32, from the forward's final out and lse.

    The same N steps and the same row/key choices as the forward, with block_attention_backward;
    the next K/V block travels while you compute, as in the forward (graded the same way).
    dq stays here. dk/dv of a block belong to the rank that owns it: let an accumulator travel
    *with* the K/V block — at each step add your share to it and pass it right, receiving the
    accumulator of the next block from the left. After N such hops the one you receive holds the
    complete dk, dv of your own block. (K/V make N-1 hops, dK/dV make N.)
    """
    # BEGIN SOLUTION Task 3: ring backward, dK/dV travelling with their block; returns (dq, dk, dv), fp32
    rank, n, right, left = neighbours(group)
    length, c = q.shape[-2], q.shape[-2] // 2
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:
            nk, nv = torch.empty_like(k), torch.empty_like(v)
            works = exchange([(k.contiguous(), right), (v.contiguous(), right)], [(nk, left), (nv, left)], group)
        if src == rank:
            rows, keys, causal = slice(0, length), slice(0, length), True
        elif src < rank:
            rows, keys, causal = slice(0, length), slice(0, c), False
        else:
            rows, keys, causal = slice(c, length), slice(0, length), False
        gq, gk, gv = block_attention_backward(
            dout[..., rows, :],
            q[..., rows, :],
            k[..., keys, :],
            v[..., keys, :],
            out[..., rows, :],
            lse[..., rows],
            causal,
        )
        dq[..., rows, :] += gq
        dk[..., keys, :] += gk
        dv[..., keys, :] += gv
        if n > 1:  # pass this block's gradient on; receive the next block's (after the last hop: mine)
            rk, rv = torch.empty_like(dk), torch.empty_like(dv)
            grads = exchange([(dk, right), (dv, right)], [(rk, left), (rv, left)], group, tag=1)
            for w in grads:
                w.wait()
            dk, dv = rk, rv
        if step < n - 1:
            for w in works:
                w.wait()
            k, v = nk, nv
    return dq, dk, dv
    # END SOLUTION


class RingAttention(torch.autograd.Function):
    """Given: ties your forward and backward together so that loss.backward() runs your ring."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        out, lse = ring_attention_forward(q, k, v, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, ctx.group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q, k, v, group=None):
    """Causal attention over a zigzag-sharded sequence (this rank's q, k, v in, its output out)."""
    return RingAttention.apply(q, k, v, group)


# --------------------------------------------------------------- Task 4 (extra credit): Ulysses


def seq_to_heads(x, group=None):
    """[b, h, s/N, d] -> [b, h/N, s, d] with ONE dist.all_to_all_single, differentiable.

    Rank r sends head group j (heads j·h/N ...) of its tokens to rank j, and receives from every
    rank i its tokens (i·s/N ...) of head group r. The gradient of an all-to-all is the inverse
    all-to-all: write a torch.autograd.Function whose backward does heads_to_seq.
    """
    # BEGIN SOLUTION Task 4: one differentiable all-to-all; returns x as [b, h/N, s, d] (head shard)
    return _AllToAll.apply(x, 1, 2, group)
    # END SOLUTION


def heads_to_seq(x, group=None):
    """[b, h/N, s, d] -> [b, h, s/N, d]: the inverse of seq_to_heads (and its backward)."""
    # BEGIN SOLUTION Task 4: the inverse all-to-all; returns x as [b, h, s/N, d] (sequence shard)
    return _AllToAll.apply(x, 2, 1, group)
    # END SOLUTION


def ulysses_attention(q, k, v, group=None):
    """Causal attention of a *contiguous* sequence shard (rank r holds tokens r·s/N ...) by Ulysses:
    seq_to_heads for q, k, v; F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True);
    heads_to_seq for the output. N must divide h and h_kv: raise a ValueError saying so if not."""
    # BEGIN SOLUTION Task 4: Ulysses causal attention (ValueError if N does not divide the heads); returns [b, h, s/N, d]
    n = dist.get_world_size(group)
    if q.shape[1] % n or k.shape[1] % n:
        raise ValueError(
            f"Ulysses needs the degree {n} to divide the {q.shape[1]} query heads and the "
            f"{k.shape[1]} key/value heads: each rank attends with whole heads"
        )
    qh, kh, vh = (seq_to_heads(t, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return heads_to_seq(out, group)
    # END SOLUTION


# BEGIN SOLUTION Task 4: helpers for seq_to_heads / heads_to_seq (an autograd Function); define what they call
# STUB: pass
def _all_to_all(x, scatter_dim, gather_dim, group):
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, dim=scatter_dim))
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x.contiguous(), scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_to_all(dy.contiguous(), ctx.dims[1], ctx.dims[0], ctx.group), None, None, None


# END SOLUTION
