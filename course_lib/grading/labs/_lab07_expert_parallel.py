"""Lab 07's Task 3: dispatch and combine over all-to-alls, and the expert-parallel layer at 2 ranks.

Graded here (lab07_moe.py holds the task list): dispatch followed by combine, with unit gates and no
expert between, gives every token back (times its number of kept assignments), over all-to-alls
only, each rank receiving exactly the rows of its experts; and the expert-parallel layer —
course_lib's router and experts, the learner's dispatch and combine — gives the outputs and
gradients of the same layer computed on one rank (tolerance EP_TOL, derived in _lab07_routing.py).
"""

import copy
import math
import warnings

import torch
import torch.distributed as dist

from course_lib.dist import counter, device, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.labs._lab07_routing import EP, EP_TOL, FF, T_EP, D, E, tokens
from course_lib.model import moe
from course_lib.parallel.expert.dispatch import local_experts


def _quiet() -> None:
    """torch marks its differentiable all-to-all deprecated (for a private module): keep that out of the feedback."""
    warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated.*", category=FutureWarning)


def _ops(c) -> set[str]:
    return {key.split("@")[0] for key in c.as_dict()}


def _rows_sorted(rows: torch.Tensor) -> torch.Tensor:
    return rows[rows[:, 0].argsort()] if len(rows) else rows


def _identity_rank(impl: Adapter, k: int):
    _quiet()
    rank, ep = dist.get_rank(), dist.get_world_size()
    per = E // ep
    torch.manual_seed(0)
    router = moe.Router(D, E, k, capacity_factor=1.0).to(device())  # initialised on the host: same weights everywhere
    xs = [tokens(T_EP, 20 + r).to(device()) for r in range(ep)]
    routings = [router(x) for x in xs]  # every rank routes every rank's tokens: it knows what it must receive
    x, routing = xs[rank], routings[rank]
    routing.weights = torch.ones_like(routing.weights)
    with counter.count() as c:
        d = impl["dispatch"](x, routing, E)
        back = impl["combine"](d.tokens, d, routing, T_EP)  # no expert in between
    want = x * routing.kept.sum(-1, keepdim=True)  # x + x is exact: 2x
    wrong_rows = []
    for local in range(per):
        e = rank * per + local
        expected = torch.cat([xr[((r.experts == e) & r.kept).any(-1)] for xr, r in zip(xs, routings)])
        got = d.tokens[d.experts == local].detach()
        if got.shape != expected.shape or not torch.equal(_rows_sorted(got), _rows_sorted(expected)):
            wrong_rows.append((e, len(got), len(expected)))
    dropped = int((~routing.kept).sum())
    return torch.equal(back.detach(), want), (back.detach() - want).abs().max().item(), wrong_rows, _ops(c), dropped


def check_dispatch_combine_identity(impl: Adapter) -> None:
    for k in (1, 2):
        results = launch(_identity_rank, EP, impl, k, timeout=60)
        assert sum(r[4] for r in results) > 0, "grader: these tokens must overfill an expert"
        for rank, (same, err, wrong_rows, ops, _) in enumerate(results):
            assert ops <= {"all_to_all_single", "all_to_all"}, (
                f"k={k}, rank {rank}: dispatch and combine called {sorted(ops)}: use all-to-alls only"
            )
            if wrong_rows:
                e, got, want = wrong_rows[0]
                raise AssertionError(
                    f"k={k}, rank {rank} received {got} rows for its expert {e}, not the {want} kept rows routed to it: "
                    "sort the kept assignments by expert, exchange the counts, send x[token] with those splits"
                )
            assert same, (
                f"k={k}, rank {rank}: dispatch then combine with unit gates and no expert must give each token back "
                f"(times its kept assignments; nothing if all were dropped), off by {err:.2e}: check the reverse "
                "all-to-all's splits and the token index of each returned row"
            )


EP_CASES = [(2, 1.0), (1, None)]  # (k, capacity_factor): with drops, and without capacity at top-1


def _ep_rank(impl: Adapter):
    _quiet()
    rank, ep = dist.get_rank(), dist.get_world_size()
    per = E // ep
    out = []
    for k, cf in EP_CASES:
        torch.manual_seed(0)
        reference = moe.MoE(D, FF, E, k, capacity_factor=cf).to(device())  # initialised on the host: same weights
        model = copy.deepcopy(reference)
        xs = [tokens(T_EP, 30 + r, offset=0.0).to(device()) for r in range(ep)]  # spread: every expert gets rows
        g = torch.Generator().manual_seed(40)  # host: the same draw on every machine
        # dL/dy: L = Σ y · upstream, drawn with g on the host
        upstream = [torch.randn(T_EP, D, generator=g).to(device()) for _ in range(ep)]  # host: drawn with g

        # one rank: every rank's batch routed on its own (capacity counts per batch), with all experts
        ref_x = [x.clone().requires_grad_() for x in xs]
        ref_y, dropped = [], 0
        for x, w in zip(ref_x, upstream):
            routing = reference.router(x)
            dropped += int((~routing.kept).sum())
            ref_y.append(moe.routed_experts(x, routing, reference.experts))
            (ref_y[-1] * w).sum().backward()

        # expert parallel: this rank's batch, its E/ep experts, the learner's dispatch and combine
        x = xs[rank].clone().requires_grad_()
        routing = model.router(x)
        d = impl["dispatch"](x, routing, E)
        y = impl["combine"](local_experts(d, model.experts[rank * per : (rank + 1) * per]), d, routing, T_EP)
        assert y.requires_grad, "combine's output must be differentiable: use the autograd all-to-all and index_add"
        (y * upstream[rank]).sum().backward()
        gate = model.router.gate.weight
        if gate.grad is not None:  # the router sees every rank's tokens: sum its gradient over the ranks
            dist.all_reduce(gate.grad)

        pairs = {
            "the output": (y, ref_y[rank]),
            "dL/dx": (x.grad, ref_x[rank].grad),
            "the router's gradient": (gate.grad, reference.router.gate.weight.grad),
        }
        for e in range(rank * per, (rank + 1) * per):
            for name, p in model.experts[e].named_parameters():
                pairs[f"expert {e}'s {name} gradient"] = (
                    p.grad,
                    dict(reference.experts[e].named_parameters())[name].grad,
                )
        diffs = {}
        for what, (got, want) in pairs.items():
            if want is None:  # an expert that no token of any rank reached: it must get no gradient either
                diffs[what] = 0.0 if got is None or not got.any() else math.inf
            else:
                diffs[what] = None if got is None else ((got.detach() - want).abs().max() / want.abs().max()).item()
        out.append((k, cf, dropped, diffs))
    return out


def check_expert_parallel(impl: Adapter) -> None:
    for rank, cases in enumerate(launch(_ep_rank, EP, impl, timeout=90)):
        for k, cf, dropped, diffs in cases:
            assert cf is None or dropped > 0, "grader: these tokens must overfill an expert"
            for what, diff in diffs.items():
                where = f"expert parallel at {EP} ranks, k={k}, capacity_factor={cf}, rank {rank}"
                assert diff is not None, (
                    f"{where}: {what} is missing: the token all-to-alls must be differentiable "
                    "(torch.distributed.nn.functional.all_to_all_single)"
                )
                assert diff <= EP_TOL, (
                    f"{where}: {what} differs from the layer on one rank by {diff:.1e} of its largest entry "
                    f"(allowed {EP_TOL:g}): check that every kept row goes out once, comes back to its token, "
                    "and is multiplied by its gate"
                )
