"""Lab 07 — mixture of experts: a router with capacity, its balancing loss, and expert parallelism.

A mixture-of-experts layer replaces one feed-forward network by E of them (the experts) and a
router that sends each token to k of them (lecture 03, Part 3):

    y[t] = Σ_{j < k, kept} weights[t, j] · expert_{experts[t, j]}(x[t])

You write the three pieces a real MoE system needs beyond that formula:

1. ``Router.forward``: softmax scores, the top-k experts of each token and their gate weights, and
   the *capacity* of each expert — at most ⌈capacity_factor · T · k / E⌉ assignments, first come
   (token order) first served; the rest are dropped (Switch Transformer, Fedus et al. 2021, §2.2).
2. ``switch_aux_loss``: the Switch auxiliary load-balancing loss E · Σ_i f_i · P_i (§2.2, eq. 4),
   which the router's gradient follows towards an even load.
3. ``dispatch`` and ``combine``: expert parallelism (GShard, Lepikhin et al. 2020). Each of the N
   ranks holds E/N experts — rank r holds experts r·E/N ... (r+1)·E/N − 1 — and its own T tokens.
   Dispatch sends each kept assignment's token row to the rank of its expert (all-to-alls); the
   experts run there; combine sends the results back and adds them, times their gates, to their
   tokens.

Shapes: x is [T, d] (T tokens of this rank, already flattened), ``Routing`` (given, from
course_lib.model.moe) holds experts [T, k] (long), weights [T, k], kept [T, k] (bool), and the
scores and logits [T, E].
"""

# Your code goes in the fenced "Task N — your code" regions of this file:
#   line 50: Task 1: the capacity of one expert; returns ⌈capacity_factor·T·k/E⌉, an int rounded up
#   line 76: Task 1: top-k softmax routing, first-come capacity; returns Routing(experts, weights, kept, scores, logits)
#   line 92: Task 2: the Switch auxiliary loss; returns a scalar tensor E·Σ f_i·P_i, differentiable through P
#   line 132: Task 3: counts, then rows, over all-to-alls; returns Dispatched(tokens, experts, counts, token, slot)
#   line 156: Task 3: the reverse all-to-all and the gated sum; returns y [T, d]

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.moe import Routing

# ------------------------------------------------------------------------------ Task 1


def capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """The most assignments one expert accepts: ⌈capacity_factor · T · k / E⌉ (rounded *up*: 7.25 and
    7.5 both give 8 — neither ``round`` nor ``int`` does that for every fraction)."""
    # ━━ Task 1 — your code: the capacity of one expert; returns ⌈capacity_factor·T·k/E⌉, an int rounded up ━━
    raise NotImplementedError('Task 1: the capacity of one expert; returns ⌈capacity_factor·T·k/E⌉, an int rounded up')
    # ━━ end of Task 1 ━━


class Router(nn.Module):
    """Top-k softmax router with an optional capacity limit per expert."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, capacity_factor: float | None = None):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.gate = nn.Linear(d_model, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route x [T, d]; return ``Routing(experts, weights, kept, scores, logits)``.

        * logits = self.gate(x) [T, E]; scores = softmax over the experts.
        * experts: each token's k highest-scoring experts [T, k] (any order within a token).
        * weights: their scores; for k > 1 renormalised to sum to 1 over the k chosen (GShard,
          Mixtral); for k = 1 the score itself (Switch keeps p, so the router still gets a gradient).
          Keep them differentiable: the router learns through them.
        * kept: all True without a capacity_factor. With one, walk the T·k assignments in token
          order: an assignment is kept if fewer than ``capacity(T, k, E, capacity_factor)`` earlier
          assignments went to the same expert. (The position of each assignment among those of its
          expert is a cumulative count over a one-hot [T·k, E]; no Python loop over tokens needed.)
        """
        # ━━ Task 1 — your code: top-k softmax routing, first-come capacity; returns Routing(experts, weights, kept, scores, logits) ━━
        raise NotImplementedError('Task 1: top-k softmax routing, first-come capacity; returns Routing(experts, weights, kept, scores, logits)')
        # ━━ end of Task 1 ━━


# ------------------------------------------------------------------------------ Task 2


def switch_aux_loss(routing: Routing, n_experts: int) -> torch.Tensor:
    """The Switch load-balancing loss E · Σ_i f_i · P_i, a scalar (before its coefficient).

    f_i: the share of all T·k assignments that chose expert i (dropped ones included: the router
    chose them) — a count, with no gradient. P_i: the mean over the T tokens of the router's score
    for expert i — differentiable, the only path of the gradient. 1 at perfect balance (f_i = P_i =
    1/E), E when every token puts all its probability on one expert.
    """
    # ━━ Task 2 — your code: the Switch auxiliary loss; returns a scalar tensor E·Σ f_i·P_i, differentiable through P ━━
    raise NotImplementedError('Task 2: the Switch auxiliary loss; returns a scalar tensor E·Σ f_i·P_i, differentiable through P')
    # ━━ end of Task 2 ━━


# ------------------------------------------------------------------------------ Task 3


@dataclass
class Dispatched:
    """Given. What ``dispatch`` returns: the rows this rank received and how to send results back.

    tokens [R, d]: the token rows received, for this rank's experts; experts [R]: the *local* index
    (0 ... E/N − 1) of the expert each row is for; send_counts / recv_counts: rows sent to / received
    from each rank; token [S], slot [S]: the token index and the slot j < k of each row this rank sent,
    in the order it sent them (combine needs them to put each result back).
    """

    tokens: torch.Tensor
    experts: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    token: torch.Tensor
    slot: torch.Tensor


def dispatch(x: torch.Tensor, routing: Routing, n_experts: int, group=None) -> Dispatched:
    """Send the token row of each *kept* assignment to the rank that holds its expert.

    1. List the kept assignments (token, slot, expert) and sort them by expert (stable), hence by
       the rank that owns it: expert e lives on rank e // (E/N).
    2. Count the rows for each rank and exchange the counts: ``dist.all_to_all_single`` of an
       int64 tensor [N] tells every rank how many rows it will receive from each.
    3. Send the rows, x[token], with ``torch.distributed.nn.functional.all_to_all_single(out, in,
       output_split_sizes, input_split_sizes, group=group)`` — uneven splits, and differentiable
       (its backward is the reverse all-to-all, so the gradient gets back to x).
    4. Send the expert ids beside them (``dist.all_to_all_single`` with the same splits) and make
       them local: subtract rank·E/N.
    Raise a ValueError saying so if N does not divide the number of experts.
    """
    # ━━ Task 3 — your code: counts, then rows, over all-to-alls; returns Dispatched(tokens, experts, counts, token, slot) ━━
    raise NotImplementedError('Task 3: counts, then rows, over all-to-alls; returns Dispatched(tokens, experts, counts, token, slot)')
    # ━━ end of Task 3 ━━


def local_experts(d: Dispatched, experts: nn.ModuleList) -> torch.Tensor:
    """Given. Run this rank's experts on the rows it received; the results in the same row order."""
    # 0 · tokens, not zeros_like: the result must hang off the received rows in the autograd graph even
    # on a rank whose experts got no rows, or its backward would skip the all-to-alls the other ranks enter
    out = d.tokens * 0
    for e, expert in enumerate(experts):
        rows = torch.nonzero(d.experts == e, as_tuple=True)[0]
        if len(rows):
            out = out.index_put((rows,), expert(d.tokens[rows]))
    return out


def combine(results: torch.Tensor, d: Dispatched, routing: Routing, n_tokens: int, group=None) -> torch.Tensor:
    """Send each result back to the rank its row came from, and add gate × result to its token: [T, d].

    The reverse of dispatch's row all-to-all (the split sizes swap places), then
    out[token] += weights[token, slot] · result with ``index_add`` (differentiable in the results
    and in the weights: the router learns through the gates). A dropped assignment adds nothing.
    """
    # ━━ Task 3 — your code: the reverse all-to-all and the gated sum; returns y [T, d] ━━
    raise NotImplementedError('Task 3: the reverse all-to-all and the gated sum; returns y [T, d]')
    # ━━ end of Task 3 ━━


def moe_forward(x: torch.Tensor, router: nn.Module, experts: nn.ModuleList, n_experts: int, group=None):
    """Given. The expert-parallel MoE layer: route, dispatch, this rank's experts, combine.

    ``experts`` holds this rank's E/N experts. Returns (y [T, d], routing).
    """
    routing = router(x)
    d = dispatch(x, routing, n_experts, group)
    return combine(local_experts(d, experts), d, routing, len(x), group), routing
