"""Expert parallelism: each of the ``ep`` ranks holds E/ep of the experts; tokens travel to them and back.

GShard (Lepikhin et al. 2020, §2.2) and every MoE system since: after routing, each rank

  1. **dispatch** — sorts its kept (token, expert) assignments by the rank that holds the expert,
     tells every rank how many it will send (an all-to-all of counts), and sends the token rows
     (``all_to_all_single`` with uneven splits), with their expert ids beside them;
  2. runs its local experts on what it received;
  3. **combine** — sends each result back where it came from (the reverse all-to-all) and adds it,
     times its gate, to its token.

Payload per rank and layer: its kept assignments x d_model x bytes per element out, as many rows
back as it received, plus the expert ids and the counts (tests/test_expert_parallel.py counts them).
The token all-to-alls go through
``torch.distributed.nn.functional.all_to_all_single``, whose backward is the reverse all-to-all,
so gradients reach the experts' weights on their ranks and the tokens on theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn

from course_lib.model.moe import Routing


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


def owner(expert: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """The rank holding each expert: experts are dealt out in contiguous blocks of E/ep."""
    return expert // (n_experts // ep)


def dispatch(x: torch.Tensor, routing: Routing, n_experts: int, group=None) -> Dispatched:
    """Send each kept assignment's token row to the rank of its expert (x [T, d])."""
    ep = dist.get_world_size(group)
    if n_experts % ep:
        raise ValueError(f"{n_experts} experts do not split over ep={ep} ranks: ep must divide the number of experts")
    token, slot = torch.nonzero(routing.kept, as_tuple=True)
    expert = routing.experts[token, slot]
    order = torch.argsort(expert, stable=True)  # by expert, hence by owner rank; token order within one
    token, slot, expert = token[order], slot[order], expert[order]
    send = torch.bincount(owner(expert, n_experts, ep), minlength=ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    rows = x.new_empty(sum(recv_counts), x.shape[-1])
    rows = dist_fn.all_to_all_single(rows, x[token], recv_counts, send_counts, group=group)
    ids = torch.empty(sum(recv_counts), dtype=torch.long, device=x.device)
    dist.all_to_all_single(ids, expert, recv_counts, send_counts, group=group)
    local = ids - dist.get_rank(group) * (n_experts // ep)
    return Dispatched(rows, local, send_counts, recv_counts, token, slot)


def local_experts(d: Dispatched, experts: nn.ModuleList) -> torch.Tensor:
    """Run this rank's experts on the rows it received; results in the same row order."""
    out = torch.zeros_like(d.tokens)
    for e, expert in enumerate(experts):
        rows = torch.nonzero(d.experts == e, as_tuple=True)[0]
        if len(rows):
            out = out.index_put((rows,), expert(d.tokens[rows]))
    return out


def combine(results: torch.Tensor, d: Dispatched, routing: Routing, n_tokens: int, group=None) -> torch.Tensor:
    """Send the results home and add gate x result to each token: [T, d]."""
    back = results.new_empty(sum(d.send_counts), results.shape[-1])
    back = dist_fn.all_to_all_single(back, results, d.send_counts, d.recv_counts, group=group)
    out = back.new_zeros(n_tokens, back.shape[-1])
    return out.index_add(0, d.token, routing.weights[d.token, d.slot, None] * back)
