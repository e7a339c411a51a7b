"""An expert-parallel course Transformer: each of ``ep`` ranks holds E/ep routed experts of every MoE
layer; everything else (embeddings, attention, norms, routers, shared experts) is replicated (lecture 03).

    model = expert_parallel(Transformer(cfg), group)      # same seed on every rank
    loss = model.loss(x_mine, y_mine)                     # this rank's share of the batch
    loss.backward()
    sync_gradients(model, group)                          # = one rank's gradient of the whole batch
    optimizer.step()
    update_biases(model, global_loads(model, group), rate)  # aux-loss-free balancing on global loads

The MoE forward becomes route -> dispatch -> local experts -> combine (+ shared experts), with
:mod:`course_lib.parallel.expert.dispatch`.

Why this equals one rank on the whole batch. Rank r holds B/ep of the B sequences and takes the mean
loss L_r over them; one rank on the whole batch takes L = (1/ep) Σ_r L_r (equal shares).

* A replicated parameter θ gets ∂L_r/∂θ on rank r, so ∂L/∂θ = (1/ep) Σ_r ∂L_r/∂θ: an all-reduce
  of the gradients, divided by ep (what DDP does).
* An expert's weights live on one rank only, but every rank's loss reaches them: the dispatch
  all-to-all's backward brings each rank's ∂L_r/∂(rows) to the owner, whose backward therefore
  accumulates Σ_r ∂L_r/∂θ_e — already summed over ranks, with no collective of its own. Dividing
  by ep is all that is left. (All-reducing it as well would count every rank's tokens ep times.)
* The balancing losses must be the whole batch's too. The Switch loss E · Σ_i f_i · P_i is not a
  mean over tokens: f_i (share of assignments to expert i) multiplies P_i (mean router
  probability), and a mean of products is not the product of means. With the *global* f_i (an
  all-reduce of the per-expert counts; f carries no gradient) and each rank's own P_i^r, the mean
  over ranks of E · Σ_i f_i P_i^r is exactly E · Σ_i f_i P_i. The z-loss is a mean over tokens and
  DeepSeek-V3's sequence-wise loss a mean over sequences (each sequence on one rank): their rank
  means already equal the whole batch's.
* The aux-loss-free bias (DeepSeek-V3 §2.1.2) is updated from the load of the whole step: an
  all-reduce (sum) of each rank's per-expert counts before ``update_bias``, so every rank applies
  the same update and the router stays replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.dist import trace
from course_lib.model.moe import MoE, Routing, as_probabilities
from course_lib.parallel.expert.dispatch import combine, dispatch, local_experts


class ExpertParallelMoE(MoE):
    """One MoE layer over an expert-parallel group: this rank's E/ep routed experts, the router and
    the shared experts. Takes over the modules of an existing :class:`MoE` (the others are dropped,
    so their memory is freed once the original layer is gone)."""

    def __init__(self, moe: MoE, group=None, fp8: bool = False):
        nn.Module.__init__(self)  # take moe's modules over instead of building new ones
        self.group, self.fp8 = group, fp8
        self.n_experts = len(moe.experts)
        ep_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if self.n_experts % ep_size:
            raise ValueError(f"{self.n_experts} experts do not split over ep={ep_size} ranks: ep_size must divide E")
        per = self.n_experts // ep_size
        self.first = rank * per  # global index of this rank's first expert (dispatch.owner's blocks)
        self.router, self.shared, self.coefs = moe.router, moe.shared, moe.coefs
        self.experts = nn.ModuleList(moe.experts[self.first : self.first + per])
        self.routing: Routing | None = None
        self.losses: dict[str, torch.Tensor] = {}

    def routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Route -> dispatch -> this rank's experts -> combine (MoE.forward adds the shared experts)."""
        with trace.span("ep.dispatch"):  # spans cost nothing unless a timeline is recording
            d = dispatch(x, routing, self.n_experts, self.group, fp8=self.fp8)
        with trace.span("ep.experts"):
            results = local_experts(d, self.experts)
        with trace.span("ep.combine"):
            return combine(results, d, routing, len(x), self.group)

    def aux_loss(self, routing: Routing) -> torch.Tensor:
        return global_switch_aux_loss(as_probabilities(routing, self.router.score), self.n_experts, self.group)


def global_switch_aux_loss(routing: Routing, n_experts: int, group=None) -> torch.Tensor:
    """E · Σ_i f_i · P_i^r (Switch §2.2, eq. 4) with f_i counted over every rank's tokens and P_i^r
    this rank's mean router probability: its mean over the ranks is the whole batch's loss."""
    counts = torch.bincount(routing.experts.flatten(), minlength=n_experts).float()
    dist.all_reduce(counts, group=group)
    return n_experts * (counts / counts.sum() * routing.scores.mean(0)).sum()


def expert_parallel(model: nn.Module, group=None, fp8: bool = False) -> nn.Module:
    """Make every :class:`MoE` inside ``model`` expert-parallel over ``group`` (in place; returns it).

    Every rank must have built the same model (the same seed); rank 0's replicated parameters and
    buffers are broadcast anyway, so that the ranks start equal whatever happened before.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoE) and not isinstance(child, ExpertParallelMoE):
                setattr(parent, name, ExpertParallelMoE(child, group, fp8))
    src = dist.get_global_rank(group, 0) if group is not None else 0
    local = {id(p) for p in expert_params(model)}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in local:
            dist.broadcast(t.data, src, group=group)
    return model


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters this rank holds (held nowhere else)."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()]


@torch.no_grad()
def sync_gradients(model: nn.Module, group=None) -> None:
    """Turn each rank's gradient of its own mean loss into the gradient of the whole batch's mean
    loss (see the module docstring): replicated parameters all-reduced and divided by ep, routed
    experts' (already summed over ranks by the all-to-all's backward) divided by ep."""
    ep_size = dist.get_world_size(group)
    local = {id(p) for p in expert_params(model)}
    replicated = [p for p in model.parameters() if id(p) not in local]
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.flatten() for p in replicated])  # one all-reduce, not one per tensor
    dist.all_reduce(flat, group=group)
    for p, g in zip(replicated, flat.split([p.numel() for p in replicated])):
        p.grad.copy_(g.view_as(p)).div_(ep_size)
    for p in expert_params(model):
        p.grad.div_(ep_size)


@torch.no_grad()
def global_loads(model: nn.Module, group=None) -> list[torch.Tensor]:
    """Assignments per expert [E] of every MoE layer in the last forward, summed over the group's
    ranks (without a process group, this process's own)."""
    loads = []
    for m in model.modules():
        if isinstance(m, MoE) and m.routing is not None:
            load = m.routing.load(m.router.n_experts)
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(load, group=group)
            loads.append(load)
    return loads


@torch.no_grad()
def update_biases(model: nn.Module, loads: list[torch.Tensor], rate: float = 1e-3) -> None:
    """DeepSeek-V3's aux-loss-free step for every MoE layer, from :func:`global_loads`: every rank
    gets the same loads, so every rank's router moves the same way and stays replicated."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if len(layers) != len(loads):
        raise ValueError(f"{len(loads)} loads for {len(layers)} MoE layers: pass global_loads(model) of this step")
    for m, load in zip(layers, loads):
        m.router.update_bias(load, rate)
