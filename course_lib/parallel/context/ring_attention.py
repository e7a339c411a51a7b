"""Ring attention with causal load balancing — context parallelism, lecture 03 and lab 06.

Each of the N ranks of a context-parallel group holds 1/N of the sequence: its queries, keys and
values. Attention needs every query to meet every earlier key, so the K/V blocks travel round a
ring: at step t rank r holds the block of rank (r - t) mod N, attends its queries to it, and passes
it on to rank r + 1 while it computes (Liu, Zaharia & Abbeel 2023, *Ring Attention with Blockwise
Transformers for Near-Infinite Context*). After N - 1 transfers every query has met every key.

The partial results are merged exactly with the log-sum-exp of each query row (the online softmax
of Milakov & Gimelshein 2018, used by FlashAttention, Dao et al. 2022, §3.1). For a row with
partial outputs o_a, o_b over disjoint key sets and their log-sum-exps l_a, l_b:

    l = log(e^l_a + e^l_b),      o = e^(l_a - l) · o_a + e^(l_b - l) · o_b            (merge_partials)

The merge runs in fp32 whatever the input dtype: the weights e^(l_a - l) are where bf16 loses digits.

Causal load balance ("zigzag", the head-tail split of Megatron-LM's context parallelism; Llama 3,
Dubey et al. 2024, §3.3.2, splits the same way but all-gathers K/V instead of passing a ring): with
a causal mask, the rank holding the *last* contiguous 1/N of the sequence attends to everything,
the first rank to almost nothing. Instead cut the sequence into 2N chunks and give rank r chunks r
and 2N-1-r, one early and one late. Then at every step after the first a rank needs exactly half
of the pairs it holds — all its queries against the received block's first chunk (the sender is
an earlier rank), or its late chunk of queries against the whole block (a later rank) — and every
rank does the same work: 2 causal diagonal chunk pairs + (2N - 1) full ones. ``stats`` counts it.

Backward is a ring too (the schedule of ring-flash-attn and Megatron-CP): K/V travel the same way
again, and the gradients dK/dV of each block travel *with* it, each rank adding its share, until
after N hops they arrive home complete. Nothing quadratic is kept for the backward: score blocks are
recomputed from q, k, v and the saved log-sum-exp (FlashAttention-2's backward, Dao 2023, Alg. 2).

Constraints: the sequence must split into 2N equal chunks (:func:`shard` says so if not);
every rank must hold the same local length; batch and heads are free (any micro-batch size works
here, since every sample is cut the same way; production setups packing variable-length samples
into one row use micro-batch 1, so that one row's boundaries decide the cuts).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.dist import trace
from course_lib.dist.p2p import exchange

LAYOUTS = ("zigzag", "contiguous")

# ------------------------------------------------------------------------------------- layout


def zigzag_chunks(rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the 2N sequence chunks that rank ``rank`` holds: (rank, 2N-1-rank)."""
    return rank, 2 * cp_size - 1 - rank


def _check_seq(seq_len: int, cp_size: int, layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: use one of {LAYOUTS}")
    parts = 2 * cp_size if layout == "zigzag" else cp_size
    if seq_len % parts:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {parts} = {'2 x ' if layout == 'zigzag' else ''}"
            f"the context-parallel degree {cp_size}: the {layout} layout cuts the sequence into {parts} equal "
            f"chunks; pad the sequence to a multiple of {parts} (or choose a degree whose "
            f"{'double ' if layout == 'zigzag' else ''}divides {seq_len})"
        )
    return seq_len // parts


def positions(seq_len: int, rank: int, cp_size: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global positions of the tokens rank ``rank`` holds, in its local order (RoPE needs them), on
    ``device`` (the default device when None; :func:`shard` asks for the sharded tensor's)."""
    c = _check_seq(seq_len, cp_size, layout)
    if layout == "contiguous":
        return torch.arange(rank * c, (rank + 1) * c, device=device)
    a, b = zigzag_chunks(rank, cp_size)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def chunk_owners(cp_size: int, layout: str = "zigzag") -> list[int]:
    """Owner rank of each of the 2N sequence chunks (queries stay on their owner in ring attention).

    Read from :func:`positions` with one token per chunk: contiguous gives rank r chunks 2r and 2r+1,
    zigzag gives it chunks r and 2N-1-r.
    """
    owners = [0] * (2 * cp_size)
    for rank in range(cp_size):
        for chunk in positions(2 * cp_size, rank, cp_size, layout).tolist():
            owners[chunk] = rank
    return owners


def shard(x: torch.Tensor, rank: int, cp_size: int, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """This rank's part of a full-sequence tensor (sequence along ``dim``)."""
    return x.index_select(dim, positions(x.shape[dim], rank, cp_size, layout, device=x.device))


def unshard(shards: list[torch.Tensor], layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's shard, in rank order (the inverse of :func:`shard`)."""
    cp_size = len(shards)
    seq_len = shards[0].shape[dim] * cp_size
    full = torch.cat(shards, dim=dim)
    order = torch.cat([positions(seq_len, r, cp_size, layout, device=full.device) for r in range(cp_size)])
    return full.index_select(dim, torch.argsort(order))


# ------------------------------------------------------------------- attention on one block pair


def block_attention(q, k, v, causal: bool):
    """softmax(q kᵀ/√d + M) v for one (query block, key block) pair, and each row's log-sum-exp.

    q: [b, h, m, d]; k, v: [b, h_kv, n, d] with h a multiple of h_kv (grouped-query attention:
    query head i reads K/V head i // (h/h_kv)). ``causal`` masks key j > query i (needs m == n: the
    diagonal block). Returns (out [b, h, m, d], lse [b, h, m]), both fp32.
    """
    b, h, m, d = q.shape
    hk = k.shape[1]
    # [b, h_kv, group, m, d] against [b, h_kv, 1, n, d]: the broadcast shares each K/V head, no copies
    qg = q.float().reshape(b, hk, h // hk, m, d)
    s = qg @ k.float().unsqueeze(2).transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(m, m, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.float().unsqueeze(2)
    return out.reshape(b, h, m, d), lse.reshape(b, h, m)


def block_attention_backward(dout, q, k, v, out, lse, causal: bool):
    """Gradients of one block pair given the *final* out and lse of the rows (FlashAttention-2, Alg. 2).

    With P = exp(S - lse) (the block's share of the full softmax), D = rowsum(dO ∘ O):
        dV = Pᵀ dO,   dS = P ∘ (dO Vᵀ - D),   dQ = dS K / √d,   dK = dSᵀ Q / √d.
    Summed over the blocks a row meets, these are the exact gradients of full attention.
    Returns fp32 (dq [b, h, m, d], dk [b, h_kv, n, d], dv [b, h_kv, n, d]).
    """
    b, h, m, d = q.shape
    hk = k.shape[1]
    g = h // hk
    qg, dog = q.float().reshape(b, hk, g, m, d), dout.float().reshape(b, hk, g, m, d)
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
    s = qg @ kf.transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(m, m, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.exp(s - lse.reshape(b, hk, g, m, 1))
    delta = (dout.float() * out.float()).sum(-1).reshape(b, hk, g, m, 1)
    dv = (p.transpose(-1, -2) @ dog).sum(2)  # a K/V head's gradient sums over its query group
    ds = p * (dog @ vf.transpose(-1, -2) - delta)
    dq = (ds @ kf).reshape(b, h, m, d) / math.sqrt(d)
    dk = (ds.transpose(-1, -2) @ qg).sum(2) / math.sqrt(d)
    return dq, dk, dv


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions over disjoint key sets (module docstring); fp32 in, fp32 out.

    A row not computed yet carries lse = -inf and merges to the other side exactly (e^-inf = 0).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


# ------------------------------------------------------------------------------- the schedule


def step_plan(rank: int, src: int, cp_size: int, length: int, layout: str):
    """Which local query rows meet which rows of rank ``src``'s K/V block, and whether causally.

    Returns (q_start, q_len, kv_start, kv_len, causal), or None when the whole block is masked.
    """
    if src == rank:  # own block: local order is global order, so the local causal mask is right
        return 0, length, 0, length, True
    if layout == "contiguous":  # an earlier rank's block is wholly visible, a later one's wholly masked
        return (0, length, 0, length, False) if src < rank else None
    half = length // 2
    if src < rank:  # chunks {src, 2N-1-src}: only chunk src precedes both of mine
        return 0, length, 0, half, False
    return half, half, 0, length, False  # a later rank: only my late chunk 2N-1-rank sees it, all of it


def _count(stats, plan, chunk: int) -> None:
    """Add one step's work: unmasked scores per (batch row, head), and pairs of s/2N chunks touched."""
    if stats is None or plan is None:
        return
    _, m, _, n, causal = plan
    stats["steps_computed"] = stats.get("steps_computed", 0) + 1
    stats["scores"] = stats.get("scores", 0) + (m * (m + 1) // 2 if causal else m * n)
    if chunk:  # a causal block of c chunks has c(c+1)/2 chunk pairs with something unmasked
        cm, cn = m // chunk, n // chunk
        stats["blocks"] = stats.get("blocks", 0) + (cm * (cm + 1) // 2 if causal else cm * cn)


class _Ring:
    """This rank's place on the ring of ``group``: send to the right, receive from the left."""

    def __init__(self, group):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.right, self.left = to_global((self.rank + 1) % self.size), to_global((self.rank - 1) % self.size)

    def start(self, tensors, tag: int = 0):
        """Post sends of ``tensors`` to the right and receives of as many from the left; return a
        function that waits and hands back what arrived. Non-blocking, so the caller computes on
        one block while the next travels: the overlap ring attention relies on. The tag keeps the
        backward's two streams (K/V, and dK/dV) apart.

        Sends and receives are posted as one batch (:func:`course_lib.dist.p2p.exchange`): on a ring
        of two, right and left are the same rank, and a send posted before the receive on that link
        would cross the peer's own send, which deadlocks under NCCL once a block outgrows NCCL's
        eager buffer. The calls are still ``isend`` / ``irecv`` (the counter and the trace see them)."""
        received = [torch.empty_like(t) for t in tensors]
        sends = [(t.contiguous(), self.right) for t in tensors]
        works = exchange(sends=sends, recvs=[(r, self.left) for r in received], group=self.group, tag=tag)

        def wait():
            for w in works:
                w.wait()
            sends.clear()  # the contiguous copies stay alive until their sends have completed
            return received

        return wait


class RingAttention(torch.autograd.Function):
    """Causal ring attention; forward and backward are both rings (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, stats):
        ring, length = _Ring(group), q.shape[-2]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = ring.start(kv) if step < ring.size - 1 else None  # the next block travels now
            plan = step_plan(ring.rank, src, ring.size, length, layout)
            if plan is not None:
                qs, m, ks, n, causal = plan
                mine, theirs = (lambda t, qs=qs, m=m: t.narrow(-2, qs, m)), (lambda t, ks=ks, n=n: t.narrow(-2, ks, n))
                with trace.span("ring.forward block", step=step):  # for timelines; free unless recording
                    o, block_lse = block_attention(mine(q), theirs(kv[0]), theirs(kv[1]), causal)
                    o, block_lse = merge_partials(mine(out), lse.narrow(-1, qs, m), o, block_lse)
                    mine(out).copy_(o)
                    lse.narrow(-1, qs, m).copy_(block_lse)
            _count(stats, plan, length // 2 if length % 2 == 0 else 0)
            if pending is not None:
                kv = pending()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout = group, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, length = _Ring(ctx.group), q.shape[-2]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]  # block `rank`
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = ring.start(kv) if step < ring.size - 1 else None
            plan = step_plan(ring.rank, src, ring.size, length, ctx.layout)
            if plan is not None:
                qs, m, ks, n, causal = plan
                mine, theirs = (lambda t, qs=qs, m=m: t.narrow(-2, qs, m)), (lambda t, ks=ks, n=n: t.narrow(-2, ks, n))
                with trace.span("ring.backward block", step=step):
                    gq, gk, gv = block_attention_backward(
                        mine(dout), mine(q), theirs(kv[0]), theirs(kv[1]), mine(out), lse.narrow(-1, qs, m), causal
                    )
                    mine(dq).add_(gq)
                    theirs(dkv[0]).add_(gk)
                    theirs(dkv[1]).add_(gv)
            # Block src's gradient is complete only now, so this hop cannot overlap the compute above.
            if ring.size > 1:  # block src's gradient moves on with it; after the N-th hop it is home
                with trace.span("ring.dkv hop", kind="comm"):
                    dkv = ring.start(dkv, tag=1)()
            if pending is not None:
                kv = pending()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group=None, layout: str = "zigzag", stats: dict | None = None) -> torch.Tensor:
    """Causal attention over a sequence sharded across ``group`` (this rank's q, k, v in ``layout``).

    q: [b, h, L, d], k, v: [b, h_kv, L, d], L = this rank's length (s/N; the output has q's shape).
    ``stats``, a dict, receives the work this rank did: ``scores`` (unmasked scores per batch row
    and head), ``blocks`` (pairs of s/2N-long chunks touched, zigzag) and ``steps_computed``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: use one of {LAYOUTS}")
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(
            f"this rank holds {q.shape[-2]} tokens, an odd number, but the zigzag layout gives each rank two "
            f"equal chunks: the sequence must be divisible by 2 x the degree; cut it with ring_attention.shard()"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    return RingAttention.apply(q, k, v, group, layout, stats)


# ----------------------------------------------------------------------------- cost models
