"""Lab 07's Tasks 1 and 2: the top-k router with capacity and the Switch balancing loss.

Graded here (lab07_moe.py holds the task list): the router's experts and gate weights against a
per-token float64 reference (k = 1, 2, 3); its capacity, first come first served (Switch Transformer,
Fedus et al. 2021, §2.2); the auxiliary loss E · Σ f_i P_i and its gradient; and a small MoE layer
trained with the learner's loss, whose expert load evens out. The sizes, the tokens and the
tolerances (each derived below) are shared with Task 3's checks, _lab07_expert_parallel.py.
"""

import math

import torch
import torch.nn as nn

from course_lib.grading.adapter import Adapter
from course_lib.model import moe

E, D, FF = 8, 16, 32  # experts, model width, expert width
T_EP = 24  # tokens per rank in the expert-parallel checks
EP = 2  # ranks of the expert-parallel checks
U = 2.0**-24  # unit roundoff of fp32
# The router and auxiliary-loss checks run in the grader's own process, not on ranks: on the host, where the
# learner's Router and MoE are built (they take no device), with the same numbers on every machine.
GRADER = torch.device("cpu")

# Gate weights: fp32 softmax has each score within (E + 2)·u relatively of the exact one (exp, an
# E-term sum, a division: Higham, "Accuracy and Stability of Numerical Algorithms", §3), and
# renormalising over the k chosen adds the sum's and the division's errors, another (E + 4)·u at
# most: 2(E + 4)·u ≈ 1.4e-6 on values ≤ 1 with E = 8. 2e-6 absorbs that on any CPU; a weight left
# unnormalised, normalised at k = 1, or taken from the wrong expert is off by 1e-2 or more.
WEIGHT_TOL = 2e-6
# The auxiliary loss: P_i is a mean of T = 64 fp32 scores ((T - 1)·u relative at worst), the sum over
# E terms adds (E - 1)·u, the products and the factor E two more: (T + E)·u ≈ 4.3e-6 relative.
# 1e-5 bounds it; counting only the kept assignments, dropping E or averaging the gates instead of
# the scores moves the loss by 1e-2 or more on these routings.
AUX_RTOL = 1e-5
# Expert parallel against one rank: the same operations on the same numbers, except that an
# expert's GEMMs see the rows of both ranks at once (a row's dot products may be blocked otherwise:
# an ulp or two) and its weight gradient sums the n ≤ EP·T_EP·k = 96 rows' products in another order,
# (n - 1)·u·Σ|terms| ≈ 5.7e-6·Σ|terms| (Higham §4.2). Measured: below 1e-6 of the largest entry;
# 1e-5 of the largest entry of each tensor bounds it, while a row lost, sent twice, or added with the
# wrong gate moves a gradient or an output by 1e-2 of its largest entry or more.
EP_TOL = 1e-5
# Balance: max/mean load over the last 5 of 30 training steps (Adam, lr 1e-2, coefficient 0.1, 256
# tokens with a common offset that skews the router from the start). Measured with course_lib's
# loss: 2.76 without the loss, 1.23 with it; requiring at most 0.75 of the load ratio without the
# loss leaves a wide margin both ways (a loss without gradient, or a wrong sign, gives ≥ 2.7).
BALANCE_STEPS, BALANCE_COEF, BALANCE_RATIO = 30, 0.1, 0.75


def tokens(t: int, seed: int, offset: float = 1.0) -> torch.Tensor:
    """t tokens [t, D]: Gaussian, plus one offset shared by all, so that the router starts unbalanced.

    Drawn on the host, so every machine grades the same numbers; a rank moves them to its device."""
    g = torch.Generator().manual_seed(seed)  # host: the same draw on every machine
    return torch.randn(t, D, generator=g) + offset * torch.randn(D, generator=g)  # host: drawn with g


def _by_expert(experts, *others):
    """Each token's k slots ordered by expert id: the order of the k choices within a token is free."""
    order = experts.argsort(-1)
    return [t.gather(1, order) for t in (experts, *others)]


def reference_routing(logits: torch.Tensor, k: int, capacity_factor: float | None):
    """experts, weights, kept [T, k] in float64, token by token (slots ordered by expert id)."""
    p = logits.detach().double().softmax(-1)
    t = len(p)
    order = p.argsort(-1, descending=True)
    if k < p.shape[-1]:  # the grader's data must not hold near-ties that fp32 rounding could flip
        gap = p.gather(1, order[:, k - 1 : k]) - p.gather(1, order[:, k : k + 1])
        assert gap.min() > 1e-5, "grader: choose other data (a near-tie between the k-th and next expert)"
    experts = order[:, :k]
    weights = p.gather(1, experts)
    if k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    kept = torch.ones(t, k, dtype=torch.bool, device=p.device)
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * t * k / p.shape[-1])
        seen = [0] * p.shape[-1]
        for i in range(t):  # first come (token order), first served
            for j in range(k):
                e = int(experts[i, j])
                seen[e] += 1
                kept[i, j] = seen[e] <= cap
    return _by_expert(experts, weights, kept)


def _route(impl: Adapter, t: int, k: int, cf: float | None, seed: int):
    """The learner's router with the grader's gate weights on the grader's tokens: (routing, logits)."""
    router = impl["Router"](D, E, k, capacity_factor=cf)
    gate = getattr(router, "gate", None)
    assert isinstance(gate, nn.Linear) and gate.weight.shape == (E, D), (
        "Router must keep its gate as self.gate = nn.Linear(d_model, n_experts, bias=False) (given)"
    )
    g = torch.Generator(device=GRADER).manual_seed(seed)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, D, generator=g, device=GRADER) / D**0.5)
    x = tokens(t, seed)
    routing = router(x)
    for name in ("experts", "weights", "kept", "scores"):
        assert hasattr(routing, name), f"Router.forward must return a Routing; it has no {name}"
    assert routing.experts.shape == (t, k) and routing.weights.shape == (t, k) and routing.kept.shape == (t, k), (
        f"T={t}, k={k}: experts, weights and kept must be [T, k] = [{t}, {k}]; got "
        f"{tuple(routing.experts.shape)}, {tuple(routing.weights.shape)}, {tuple(routing.kept.shape)}"
    )
    assert routing.scores.shape == (t, E), f"scores must be [T, E] = [{t}, {E}]: the softmax over all experts"
    return routing, gate(x)


TOPK_CASES = [(64, 1, 3), (64, 2, 4), (60, 3, 5)]  # (T, k, seed)


def check_router_topk(impl: Adapter) -> None:
    for t, k, seed in TOPK_CASES:
        routing, logits = _route(impl, t, k, None, seed)
        want_e, want_w, _ = reference_routing(logits, k, None)
        got_e, got_w, got_kept = _by_expert(routing.experts, routing.weights, routing.kept)
        assert torch.allclose(
            routing.scores.detach().double(), logits.detach().double().softmax(-1), atol=WEIGHT_TOL
        ), f"k={k}: scores must be the softmax of the gate's logits over the {E} experts"
        assert torch.equal(got_e, want_e), f"k={k}: the experts chosen are not each token's {k} highest scores"
        assert routing.weights.requires_grad, "the weights must stay differentiable: the router learns through them"
        err = (got_w.detach().double() - want_w).abs().max().item()
        hint = "the score itself (no renormalising at k = 1)" if k == 1 else "the k scores renormalised to sum to 1"
        assert err <= WEIGHT_TOL, f"k={k}: the gate weights differ by {err:.1e} (allowed {WEIGHT_TOL:g}): {hint}"
        assert bool(got_kept.all()), "without a capacity_factor every assignment is kept"


# (T, k, factor, seed); cf·T·k/E = 8, 7.5, 20, 7.5, 7.25, 11.2, 17.55: round() and int() each miss some
CAPACITY_CASES = [(64, 1, 1.0, 6), (60, 1, 1.0, 7), (64, 2, 1.25, 8), (60, 2, 0.5, 9), (58, 1, 1.0, 10)]
CAPACITY_CASES += [(64, 2, 0.7, 11), (52, 3, 0.9, 12)]


def check_router_capacity(impl: Adapter) -> None:
    capacity = getattr(impl.module("Router"), "capacity", None)
    for t, k, cf, want in ((58, 1, 1.0, 8), (62, 1, 1.0, 8), (64, 2, 0.7, 12), (64, 1, 1.0, 8)):
        got = capacity(t, k, E, cf) if capacity is not None else None
        assert got == want, f"capacity({t}, {k}, {E}, {cf}) = {got}: ⌈{cf}·{t}·{k}/{E}⌉ = ⌈{cf * t * k / E:g}⌉ = {want}"
    for t, k, cf, seed in CAPACITY_CASES:
        routing, logits = _route(impl, t, k, cf, seed)
        want_e, _, want_kept = reference_routing(logits, k, cf)
        assert not want_kept.all(), "grader: these tokens must overfill an expert"
        cap = math.ceil(cf * t * k / E)
        got_e, got_kept = _by_expert(routing.experts, routing.kept)
        assert routing.kept.dtype == torch.bool, "kept must be a bool tensor [T, k]"
        assert torch.equal(got_e, want_e), (
            f"T={t}, k={k}, capacity_factor={cf}: the experts chosen changed; capacity decides what is kept, not the choice"
        )
        load = torch.bincount(routing.experts[routing.kept], minlength=E)
        assert load.max() <= cap, (
            f"T={t}, k={k}, capacity_factor={cf}: an expert kept {int(load.max())} assignments, over its capacity "
            f"⌈{cf}·{t}·{k}/{E}⌉ = {cap} (round up)"
        )
        if not torch.equal(got_kept, want_kept):
            first = int((got_kept != want_kept).any(-1).nonzero()[0, 0])
            raise AssertionError(
                f"T={t}, k={k}, capacity_factor={cf}: kept differs from first come, first served from token {first} "
                f"on (capacity {cap}): count each expert's earlier assignments in token order (token 0's k choices, "
                "then token 1's, ...), not all first choices before the second ones"
            )


def _random_routing(t=64, k=2, seed=11) -> moe.Routing:
    """Scores [t, E] as a leaf that requires grad, top-k experts, and a quarter of the assignments dropped."""
    g = torch.Generator(device=GRADER).manual_seed(seed)
    logits = torch.randn(t, E, generator=g, device=GRADER) * 2 + torch.randn(E, generator=g, device=GRADER)
    scores = logits.softmax(-1).requires_grad_()
    weights, experts = scores.detach().topk(k, dim=-1)
    kept = torch.rand(t, k, generator=g, device=GRADER) > 0.25
    return moe.Routing(experts, weights, kept, scores, logits)


def _balanced_routing(t=16, k=2) -> moe.Routing:
    """Every expert gets the same share of assignments and the same mean score 1/E (exact in binary)."""
    experts = (torch.arange(t * k, device=GRADER) % E).view(t, k)
    scores = torch.full((t, E), 1 / E, device=GRADER)
    weights = torch.full((t, k), 1 / k, device=GRADER)
    return moe.Routing(experts, weights, torch.ones(t, k, dtype=torch.bool, device=GRADER), scores, scores.log())


def check_aux_loss(impl: Adapter) -> None:
    aux = impl["switch_aux_loss"]
    routing = _random_routing()
    t, k = routing.experts.shape
    f = torch.bincount(routing.experts.flatten(), minlength=E).double() / (t * k)
    want = E * (f * routing.scores.detach().double().mean(0)).sum().item()
    got = aux(routing, E)
    assert isinstance(got, torch.Tensor) and got.numel() == 1, "switch_aux_loss must return a scalar tensor"
    assert math.isclose(got.item(), want, rel_tol=AUX_RTOL), (
        f"switch_aux_loss is {got.item():.6f}, expected {want:.6f}: E · Σ_i f_i · P_i with f_i the share of all T·k "
        "assignments (dropped ones included) and P_i the mean score of expert i over the tokens"
    )
    assert got.requires_grad, "the loss must be differentiable through P_i (the mean router scores)"
    got.backward()
    grad = routing.scores.grad
    want_grad = (E * f / t).expand(t, E)  # d/ds[t, i] of E · Σ_i f_i · mean_t s[t, i]
    assert grad is not None and torch.allclose(grad.double(), want_grad, rtol=AUX_RTOL, atol=0), (
        "the gradient must reach the scores through P_i = mean of the scores, E·f_i/T each; f_i is a count"
    )
    one = aux(_balanced_routing(), E).item()
    assert one == 1.0, f"at perfect balance (f_i = P_i = 1/E) the loss is exactly 1, not {one!r}: check the factor E"
    skewed = moe.Routing(
        torch.zeros(16, 1, dtype=torch.long, device=GRADER),
        torch.ones(16, 1, device=GRADER),
        torch.ones(16, 1, dtype=torch.bool, device=GRADER),
        torch.eye(E, device=GRADER)[torch.zeros(16, dtype=torch.long, device=GRADER)],
        torch.zeros(16, E, device=GRADER),
    )
    worst = aux(skewed, E).item()
    assert worst == E, f"when one expert takes every token with probability 1 the loss is E = {E}, not {worst!r}"


def _train(aux, coef: float, seed: int = 0) -> float:
    """max/mean expert load over the last 5 of BALANCE_STEPS steps of a small MoE layer learning a teacher."""
    torch.manual_seed(seed)
    layer = moe.MoE(D, FF, E, 2)
    x = tokens(256, seed + 100)
    with torch.no_grad():
        target = moe.Expert(D, FF)(x)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    ratios = []
    for _ in range(BALANCE_STEPS):
        loss = (layer(x) - target).square().mean()
        if coef:
            loss = loss + coef * aux(layer.routing, E)
        loss.backward()
        opt.step()
        opt.zero_grad()
        load = layer.routing.load(E).float()
        ratios.append((load.max() / load.mean()).item())
    return sum(ratios[-5:]) / 5


def check_balance_improves(impl: Adapter) -> None:
    aux = impl["switch_aux_loss"]
    with_aux = _train(aux, BALANCE_COEF)  # first: a starter fails here at once
    without = _train(aux, 0.0)
    assert with_aux <= BALANCE_RATIO * without, (
        f"training with {BALANCE_COEF}·switch_aux_loss left the load at {with_aux:.2f}× the mean on the busiest expert, "
        f"against {without:.2f}× without it (must be ≤ {BALANCE_RATIO}× that): does the loss's gradient reach P_i?"
    )
