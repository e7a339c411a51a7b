"""Expert parallelism: each of the ``ep`` ranks holds E/ep of the experts; tokens travel to them and back.

GShard (Lepikhin et al. 2020, §2.2) and every MoE system since: after routing, each rank

  1. **dispatch** — sorts its kept (token, expert) assignments by the rank that holds the expert,
     tells every rank how many it will send (an all-to-all of counts), and sends the token rows
     (``all_to_all_single`` with uneven splits), with their expert ids beside them;
  2. runs its local experts on what it received;
  3. **combine** — sends each result back where it came from (the reverse all-to-all) and adds it,
     times its gate, to its token.

Payload per rank and layer: its kept assignments x d_model x bytes per element out, as many rows
back as it received, plus the expert ids and the counts (tests/parallel/expert/test_expert_parallel.py counts them).
The token all-to-alls go through :class:`AllToAllRows`, a small autograd Function whose backward is
the reverse all-to-all (an all-to-all only permutes rows across ranks, and a permutation's transpose
is its inverse), so gradients reach the experts' weights on their ranks and the tokens on theirs.
(``torch.distributed.nn.functional.all_to_all_single`` does the same and is deprecated in torch 2.13;
written out, the backward is on the page, as in :mod:`course_lib.parallel.context.ulysses`.)

**FP8 dispatch** (DeepSeek-V3 report, §3.3.3 "low-precision communication", with the fine-grained
1 x 128 activation tiles of §3.3.2): ``dispatch(..., fp8=True)`` sends each row as float8 e4m3
values plus one fp32 scale per ``fp8_block`` channels, 1 + 4/block bytes per element instead of 4
(:func:`course_lib.cost.expert_dispatch.fp8_bytes_per_element`); the combine stays in full precision, as in
the report (its BF16). See :class:`FP8AllToAll` for the rounding and the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.model.moe import Routing
from course_lib.precision import fp8_scaling


@dataclass
class Dispatched:
    """What a rank received: ``tokens`` [R, d] and their ``experts`` (local index) [R]; and what it
    needs to send the results back: the split sizes both ways and where each sent row came from."""

    tokens: torch.Tensor
    experts: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    token: torch.Tensor  # [S] token index of each row this rank sent, in send order
    slot: torch.Tensor  # [S] which of the token's k choices it was


def owner(expert: torch.Tensor, n_experts: int, ep_size: int) -> torch.Tensor:
    """The rank holding each expert: experts are dealt out in contiguous blocks of E/ep."""
    return expert // (n_experts // ep_size)


def dispatch(
    x: torch.Tensor, routing: Routing, n_experts: int, group=None, fp8: bool = False, fp8_block: int = 128
) -> Dispatched:
    """Send each kept assignment's token row to the rank of its expert (x [T, d]); ``fp8``: as float8
    e4m3 with an fp32 scale per ``min(fp8_block, d)`` channels (:class:`FP8AllToAll`)."""
    ep_size = dist.get_world_size(group)
    if n_experts % ep_size:
        raise ValueError(
            f"{n_experts} experts do not split over ep={ep_size} ranks: ep_size must divide the number of experts"
        )
    token, slot = torch.nonzero(routing.kept, as_tuple=True)
    expert = routing.experts[token, slot]
    order = torch.argsort(expert, stable=True)  # by expert, hence by owner rank; token order within one
    token, slot, expert = token[order], slot[order], expert[order]
    send = torch.bincount(owner(expert, n_experts, ep_size), minlength=ep_size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    if fp8:
        rows = FP8AllToAll.apply(x[token], recv_counts, send_counts, group, min(fp8_block, x.shape[-1]))
    else:
        rows = AllToAllRows.apply(x[token], recv_counts, send_counts, group)
    ids = torch.empty(sum(recv_counts), dtype=torch.long, device=x.device)
    dist.all_to_all_single(ids, expert, recv_counts, send_counts, group=group)
    local = ids - dist.get_rank(group) * (n_experts // ep_size)
    return Dispatched(rows, local, send_counts, recv_counts, token, slot)


def local_experts(d: Dispatched, experts: nn.ModuleList) -> torch.Tensor:
    """Run this rank's experts on the rows it received; results in the same row order."""
    # 0 · tokens, not zeros_like: the result must hang off the received rows in the autograd graph
    # even on a rank whose experts got no rows, or its backward would skip the two all-to-alls that
    # the other ranks enter (gloo: "Received data size doesn't match expected size").
    out = d.tokens * 0
    for e, expert in enumerate(experts):
        rows = torch.nonzero(d.experts == e, as_tuple=True)[0]
        if len(rows):
            out = out.index_put((rows,), expert(d.tokens[rows]))
    return out


def combine(results: torch.Tensor, d: Dispatched, routing: Routing, n_tokens: int, group=None) -> torch.Tensor:
    """Send the results home and add gate x result to each token: [T, d]."""
    back = AllToAllRows.apply(results, d.send_counts, d.recv_counts, group)
    out = back.new_zeros(n_tokens, back.shape[-1])
    return out.index_add(0, d.token, routing.weights[d.token, d.slot, None] * back)


class AllToAllRows(torch.autograd.Function):
    """rows [S, d], sent in blocks of ``send_counts`` rows to ranks 0, 1, ...; returns the [R, d] rows
    received, in blocks of ``recv_counts``. Backward: the gradient rows go back the same way reversed."""

    @staticmethod
    def forward(ctx, rows, recv_counts, send_counts, group):
        ctx.counts, ctx.group = (recv_counts, send_counts), group
        out = rows.new_empty(sum(recv_counts), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv_counts, send_counts = ctx.counts
        out = grad.new_empty(sum(send_counts), grad.shape[1])
        dist.all_to_all_single(out, grad.contiguous(), send_counts, recv_counts, group=ctx.group)
        return (out,) + (None,) * (len(ctx.needs_input_grad) - 1)  # the counts and group take none


# ------------------------------------------------------------------------------ FP8 dispatch


class FP8AllToAll(AllToAllRows):
    """The dispatch all-to-all in FP8, its backward in full precision (DeepSeek-V3 §3.3.3).

    Forward: quantize the rows (:func:`course_lib.precision.fp8_scaling.quantize`, e4m3, one fp32 scale per
    1 × ``block`` tile: amax / 448), send the e4m3 bytes and the fp32 scales
    (two all-to-alls with the same splits), dequantize on receipt. Per element the receiver gets

        x̂ = x (1 + δ),  |δ| <= 2^-4        when |x|/scale >= 2^-6 (a normal e4m3 number: 3 mantissa
                                            bits, round to nearest: half an ulp is 2^-4 of the value)
        |x̂ - x| <= 2^-10 · scale            below it (subnormal e4m3: spacing 2^-9, half of it 2^-10)

    so |x̂ - x| <= 2^-4 |x| + 2^-10 · amax/448 over the block (tests/experiments/test_expert_training.py).

    Backward: the rounding is treated as the identity (a straight-through estimator: dx̂/dx = 1),
    and the gradient rows travel back by the reverse all-to-all in the gradient's own precision.
    The report does the same: what flows towards the tokens (the forward combine, and this
    dispatch's backward, its "backward combine") stays in BF16; only what flows towards the experts
    is FP8 (it also quantizes the gradient entering the down-projections, which this course leaves
    in full precision, and it uses power-of-2 scales where we use amax/448).
    """

    @staticmethod
    def forward(ctx, rows, recv_counts, send_counts, group, block):
        q, scale = fp8_scaling.quantize(rows, "e4m3", "tile", block=block)
        q_in = q.new_empty(sum(recv_counts), q.shape[1])
        s_in = scale.new_empty(sum(recv_counts), scale.shape[1])
        # gloo moves bytes, not float8: send the e4m3 codes as uint8 (1 byte each, the same payload)
        dist.all_to_all_single(q_in.view(torch.uint8), q.view(torch.uint8), recv_counts, send_counts, group=group)
        dist.all_to_all_single(s_in, scale, recv_counts, send_counts, group=group)
        ctx.counts, ctx.group = (recv_counts, send_counts), group  # AllToAllRows.backward: full precision
        return fp8_scaling.dequantize(q_in, s_in).to(rows.dtype)
