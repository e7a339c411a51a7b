"""Expert parallelism: dispatch/combine over all_to_all_single equals the MoE computed on one rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from course_lib.cost.expert_dispatch import ep_dispatch_bytes
from course_lib.dist import counter, device, launch
from course_lib.model import moe
from course_lib.parallel.expert.dispatch import combine, dispatch, local_experts

E, D, FF, T = 8, 16, 32, 24  # T tokens per rank


def _ep_rank(k: int, shared: int):
    rank, ep = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = moe.MoE(D, FF, E, k, n_shared=shared, score="sigmoid").to(device())
    model = copy.deepcopy(reference)
    # host: drawn with a CPU generator (the same tokens on any machine), then moved to the rank's device
    x_all = torch.randn(ep * T, D, generator=torch.Generator().manual_seed(1)).to(device())
    reference(x_all).square().sum().backward()  # the whole batch on one rank

    mine = x_all[rank * T : (rank + 1) * T]
    routing = model.router(mine)
    per = E // ep
    with counter.count() as c:
        d = dispatch(mine, routing, E)
        y = combine(local_experts(d, model.experts[rank * per : (rank + 1) * per]), d, routing, T)
    for s in model.shared:
        y = y + s(mine)
    y.square().sum().backward()
    replicated = list(model.router.parameters()) + list(model.shared.parameters())
    for p in replicated:  # the router and the shared experts see every rank's tokens: sum their gradients
        dist.all_reduce(p.grad)

    def worst(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    diffs = {"output": worst(y, reference(x_all)[rank * T : (rank + 1) * T].detach())}
    for name, p in model.named_parameters():
        e = int(name.split(".")[1]) if name.startswith("experts.") else None
        if e is not None and e // per != rank:
            assert p.grad is None, f"rank {rank} computed a gradient for expert {e}, which it does not hold"
            continue
        diffs[name] = worst(p.grad, dict(reference.named_parameters())[name].grad)
    kept = int(routing.kept.sum())
    return diffs, c.bytes("all_to_all_single"), kept, len(d.tokens)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_equals_one_rank(ep):
    results = launch(_ep_rank, ep, 2, 1, timeout=120)
    for rank, (diffs, sent, kept, received) in enumerate(results):
        for name, diff in diffs.items():
            # the same arithmetic per token, but an expert's rows come from several ranks: its matmul
            # runs on another batch (row results may move by an ulp) and its weight gradient sums the
            # ep·T tokens in another order, (n - 1)·u·Σ|g| with n <= 96, u = 2^-24: 1e-5 of the largest entry
            assert diff <= 1e-5, f"ep={ep}, rank {rank}: {name} differs by {diff:.2g} (relative to its largest entry)"
        # payloads counted per rank: token rows out (dispatch) and back (combine), expert ids, the counts
        want = kept * D * 4 + received * D * 4 + kept * 8 + ep * 8
        assert kept * D * 4 == ep_dispatch_bytes(T, D, 2, 4), "no capacity limit: all T·k rows go out"
        assert sent == want, f"ep={ep}, rank {rank}: all-to-all payload {sent} B, expected {want}"


def _identity_rank():
    torch.manual_seed(dist.get_rank())
    x = torch.randn(T, D, device=device())
    router = moe.Router(D, E, 1, capacity_factor=1.0).to(device())
    routing = router(x)
    routing.weights = torch.ones_like(routing.weights)
    d = dispatch(x, routing, E)
    back = combine(d.tokens, d, routing, T)  # no expert in between
    kept = routing.kept.squeeze(1)
    return torch.equal(back[kept], x[kept]), bool((back[~kept] == 0).all()), int((~kept).sum())


def test_dispatch_then_combine_with_unit_weights_is_the_identity():
    for same, zeros, _dropped in launch(_identity_rank, 2, timeout=60):
        assert same, "dispatch followed by combine must bring every kept token back unchanged"
        assert zeros, "a dropped token gets nothing from the experts"


def _bad_split():
    x = torch.randn(4, D, device=device())
    return dispatch(x, moe.Router(D, 6, 1).to(device())(x), 6)


def test_experts_must_split_over_the_ranks():
    with pytest.raises(Exception, match="6 experts do not split over ep=4 ranks"):
        launch(_bad_split, 4, timeout=60)
