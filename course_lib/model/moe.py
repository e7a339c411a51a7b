"""Mixture of experts: a router picks k of E feed-forward experts for each token (lecture 03, Part 3).

    y = shared(x) + Σ_{e in topk(x)} g_e(x) · expert_e(x)

The pieces, each from its paper:

* **Router scores.** ``score="softmax"``: probabilities over the experts (Shazeer et al. 2017;
  Switch Transformer, Fedus et al. 2021, top-1; GShard/Mixtral, top-2, weights renormalised over
  the k chosen). ``score="sigmoid"``: an independent affinity per expert, the k chosen
  renormalised to sum to 1 (DeepSeek-V3 report, §2.1.2, eqs. 13–16).
* **Noisy gating** (Shazeer et al. 2017, §2.1): in training, logits + N(0, 1)·softplus(x·W_noise).
* **Capacity** (Switch §2.2): expert e accepts at most ⌈capacity_factor · T · k / E⌉ of the T·k
  assignments, first come (token order) first served; the rest are *dropped*: that token gets
  nothing from that expert and keeps its residual.
* **Balancing.** The Switch auxiliary loss E · Σ_i f_i · P_i (f_i: share of assignments routed to i,
  P_i: mean router probability of i), equal to 1 at perfect balance and scaled by its coefficient;
  the router z-loss mean(logsumexp(logits)²) (ST-MoE, Zoph et al. 2022, §3.5), which keeps logits
  small; DeepSeek-V3's *auxiliary-loss-free* balancing (§2.1.2): a per-expert bias added to the
  scores for the top-k *selection only* (the gating weights ignore it), nudged after each step by
  ``rate · sign(mean load - load)``, with a small sequence-wise balance loss beside it (eqs. 17–20).
* **Shared experts** beside fine-grained routed ones (DeepSeekMoE, Dai et al. 2024): always on.
* **Node-limited routing** (DeepSeek-V3 §2.1.2): the experts form ``n_groups`` groups (one per node);
  each token first keeps its ``topk_groups`` best groups, scored by the sum of their two highest
  affinities, and picks its k experts among those, so its dispatch reaches at most that many nodes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

SCORES = ("softmax", "sigmoid")


class Expert(nn.Module):
    """One SwiGLU feed-forward expert: w2(SiLU(w1·x) ⊙ w3·x) (Shazeer 2020, eq. 6); the dense model's
    MLP is the same module at width d_ff."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass
class Routing:
    """Where each of T tokens goes: ``experts`` [T, k], ``weights`` [T, k] (the gates), ``kept`` [T, k]
    (within capacity), ``scores`` and ``logits`` [T, E]."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    scores: torch.Tensor
    logits: torch.Tensor

    def load(self, n_experts: int) -> torch.Tensor:
        """Assignments each expert receives after dropping: [E] (int64)."""
        return torch.bincount(self.experts[self.kept], minlength=n_experts)


def capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Most assignments one expert accepts: ⌈capacity_factor · T · k / E⌉ (Switch Transformer §2.2)."""
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


class Router(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        score: str = "softmax",
        noisy: bool = False,
        capacity_factor: float | None = None,
        n_groups: int = 1,
        topk_groups: int | None = None,
    ):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"router score {score!r}: choose one of {SCORES}")
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in 1..n_experts={n_experts}: each token picks k experts")
        if n_experts % n_groups:
            raise ValueError(f"{n_experts} experts do not split into n_groups={n_groups} equal groups (nodes)")
        topk_groups = n_groups if topk_groups is None else topk_groups
        if not 0 < topk_groups <= n_groups or topk_groups * (n_experts // n_groups) < top_k:
            raise ValueError(
                f"topk_groups={topk_groups} groups of {n_experts // n_groups} experts cannot offer top_k={top_k} "
                f"experts: need 1 <= topk_groups <= n_groups={n_groups} and topk_groups·E/n_groups >= k"
            )
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None: no capacity limit)")
        self.n_experts, self.top_k, self.score = n_experts, top_k, score
        self.capacity_factor, self.n_groups, self.topk_groups = capacity_factor, n_groups, topk_groups
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.noise = nn.Linear(d_model, n_experts, bias=False) if noisy else None
        # aux-loss-free balancing: used to choose experts, never to weight them; not learned
        self.register_buffer("bias", torch.zeros(n_experts))  # host: a buffer, moved with the module by .to(device)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route ``x`` [T, d_model]."""
        logits = self.gate(x)
        if self.noise is not None and self.training:
            logits = logits + torch.randn_like(logits) * F.softplus(self.noise(x))
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choose = scores.detach() + self.bias
        if self.topk_groups < self.n_groups:  # node-limited: keep each token's best groups only
            grouped = choose.view(len(x), self.n_groups, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            best = group_score.topk(self.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            choose = choose.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        experts = choose.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.score == "sigmoid" or self.top_k > 1:  # renormalise over the chosen (Switch's top-1 keeps p)
            weights = weights / weights.sum(-1, keepdim=True)
        kept = torch.ones_like(experts, dtype=torch.bool)
        if self.capacity_factor is not None:
            cap = capacity(len(x), self.top_k, self.n_experts, self.capacity_factor)
            onehot = F.one_hot(experts.flatten(), self.n_experts)  # assignments in token order
            position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # how many came before, per expert
            kept = (position < cap).view_as(experts)
        return Routing(experts, weights, kept, scores, logits)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float = 1e-3) -> None:
        """DeepSeek-V3's balancing step: raise the bias of under-loaded experts, lower the over-loaded's.
        ``load`` counts the assignments per expert over the step (summed over all ranks)."""
        self.bias += rate * torch.sign(load.float().mean() - load.float())


# ------------------------------------------------------------------------------ balancing losses


def switch_aux_loss(routing: Routing, n_experts: int) -> torch.Tensor:
    """E · Σ_i f_i · P_i (Switch §2.2, eq. 4): 1 at perfect balance, up to E when one expert gets all."""
    f = torch.bincount(routing.experts.flatten(), minlength=n_experts).float() / routing.experts.numel()
    p = routing.scores.mean(0)
    return n_experts * (f * p).sum()


def z_loss(routing: Routing) -> torch.Tensor:
    """mean over tokens of logsumexp(logits)² (ST-MoE §3.5)."""
    return torch.logsumexp(routing.logits.float(), dim=-1).square().mean()


def sequence_balance_loss(routing: Routing, n_experts: int, seq_len: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eqs. 17–20) before its α: per sequence,
    Σ_i f_i · P_i with f_i = E/(k·T) · (tokens choosing i) and P_i the mean of the normalised
    affinities s_i / Σ_j s_j; 1 at perfect balance. Averaged over the sequences."""
    t, k = routing.experts.shape
    experts = routing.experts.view(t // seq_len, seq_len * k)
    f = torch.zeros(len(experts), n_experts, device=experts.device)  # scatter_add_ needs index and target on one device
    f = f.scatter_add_(1, experts, torch.ones_like(experts, dtype=torch.float))
    f = f * n_experts / (k * seq_len)
    s = routing.scores / routing.scores.sum(-1, keepdim=True)
    p = s.view(t // seq_len, seq_len, n_experts).mean(1)
    return (f * p).sum(-1).mean()


# ------------------------------------------------------------------------------ the layer


class MoE(nn.Module):
    """Shared experts plus top-k of ``n_experts`` routed experts; x [..., d_model] -> same shape.

    After a forward pass, ``self.routing`` holds the routing and ``self.losses`` the balancing
    losses (already multiplied by their coefficients; add ``sum(moe.losses.values())`` to the loss).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int,
        n_shared: int = 0,
        aux_coef: float = 0.0,
        z_coef: float = 0.0,
        seq_coef: float = 0.0,
        **router_kwargs,
    ):
        super().__init__()
        self.router = Router(d_model, n_experts, top_k, **router_kwargs)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(n_experts))
        self.shared = nn.ModuleList(Expert(d_model, d_ff) for _ in range(n_shared))
        self.coefs = {"aux": aux_coef, "z": z_coef, "sequence": seq_coef}
        self.routing: Routing | None = None
        self.losses: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        out = self.routed(flat, routing)
        for expert in self.shared:
            out = out + expert(flat)
        self.routing = routing
        n = self.router.n_experts
        terms = {
            "aux": lambda: self.aux_loss(routing),
            "z": lambda: z_loss(routing),
            "sequence": lambda: sequence_balance_loss(routing, n, shape[-2]),
        }
        self.losses = {name: coef * terms[name]() for name, coef in self.coefs.items() if coef}
        return out.view(shape)

    def routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' part of the output, [T, d] (expert parallelism overrides this)."""
        return routed_experts(x, routing, self.experts)

    def aux_loss(self, routing: Routing) -> torch.Tensor:
        """The Switch loss of this batch (expert parallelism overrides it with global counts), on the router's
        probabilities: :func:`as_probabilities` turns sigmoid scores into a distribution first."""
        return switch_aux_loss(as_probabilities(routing, self.router.score), self.router.n_experts)


def as_probabilities(routing: Routing, score: str) -> Routing:
    """``routing`` with its scores a distribution over the experts, as the Switch loss's P_i must be.

    Fedus et al.'s eq. 4 averages router *probabilities*, which a softmax router gives and sums to 1.
    Sigmoid scores (DeepSeek-V3) do not sum to 1, so E·Σ f_i P_i on them is not 1 at balance and its
    gradient pushes every score down, not the load apart; DeepSeek-V3's own sequence-wise loss normalises
    them, s_i / Σ_j s_j (eq. 19), and so does this. Softmax scores are returned as they are."""
    if score == "softmax":
        return routing
    return dataclasses.replace(routing, scores=routing.scores / routing.scores.sum(-1, keepdim=True))


def routed_experts(x: torch.Tensor, routing: Routing, experts) -> torch.Tensor:
    """Σ over each token's kept assignments of gate · expert(token): x [T, d] -> [T, d].
    ``experts`` maps an expert index to its module (all of them, or this rank's under expert parallel)."""
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = torch.nonzero((routing.experts == e) & routing.kept, as_tuple=True)
        if len(token):
            out = out.index_add(0, token, routing.weights[token, slot, None] * expert(x[token]))
    return out
