"""Grader of lab 04: Megatron-LM tensor parallelism (f/g, column/row linear, vocab-parallel embedding
and cross-entropy), at tensor-parallel sizes 2 and 4.

Graded: outputs and gradients equal to the dense layers (the embedding exactly — each token has one
owner and the others add zeros; the rest within 1e-5 of each tensor's largest magnitude, because a
row-parallel sum or f's gradient adds t partial sums in another order than one dense matmul), and
the collectives per layer from course_lib's counter: an MLP costs one all-reduce forward and one
backward, the cross-entropy exactly three (max, target logit, sum of exponentials) of one float per
token, and nothing backward.

A tensor-parallel group need not be the world (lab 10 builds TP on sub-groups of a mesh): the
4-rank launch of every check runs it twice, on the world and on the groups {0, 1} and {2, 3}, whose
data differ (and whose logits differ by 200, so that a cross-entropy maximum taken over the world
underflows exp(z − max) to 0 in the lower group). A collective without ``group=``, or an offset
from ``dist.get_rank()`` instead of the rank in the group, loses points; the counter names a pair's
collectives ``all_reduce@ranks[0,1]``, so a call on the world is seen even where it adds nothing.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``tensor_parallel.py``, tests/grading/test_lab_checks.py passes course_lib's
own f, g and layers (course_lib.parallel.tensor.comms and .layers).
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.dist import counter, device, intercept, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task

ROLES = (
    "f",
    "g",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "DenseMLP",
    "ParallelMLP",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
)
NAMES = ("CopyToParallelRegion", "ReduceFromParallelRegion", *ROLES)  # what check_setup wants in the file


def adapter(lab_dir: Path) -> Adapter:
    """The learner's operators and layers, from ``tensor_parallel.py``."""
    return Adapter.of_file(Path(lab_dir) / "tensor_parallel.py", ROLES)


WORLDS = (2, 4)
# n·eps for a reordered fp32 sum of n terms: the longest sum split over ranks here has n = 64 (the hidden width,
# the vocabulary), 64 × 1.19e-7 ≈ 7.6e-6 of the largest magnitude, so 1e-5 (measured ≤ 4e-7); a missing
# all-reduce errs by O(1).
RTOL = 1e-5


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _randn(seed, *shape):
    """Normal data on the rank's device, drawn on the host so every machine grades the same numbers."""
    g = torch.Generator().manual_seed(seed)  # host: the same draw on every machine
    return torch.randn(*shape, generator=g).to(device())  # host: drawn with g, moved to the device


def _tokens(seed, *shape):
    """Token ids in [0, 64) on the rank's device, drawn on the host like :func:`_randn`."""
    g = torch.Generator().manual_seed(seed)  # host: the same draw on every machine
    return torch.randint(0, 64, shape, generator=g).to(device())  # host: drawn with g, moved to the device


def _slice(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The group rank's slice of ``t`` along ``dim`` (``weight.chunk(t, dim)[r]``)."""
    return t.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)]


def _filled(value: float) -> torch.Tensor:
    """Four ``value``s, for the grader's process to compare with the ranks' results."""
    return torch.full((4,), value)  # host: launch returns the ranks' tensors on the host


def _shape_ok(got, want, what):
    assert got is not None, f"{what} returned None: return the result tensor"
    assert got.shape == want.shape, f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"


# ---------------------------------------------------------------------------------- rank bodies
# Each body runs on one group: the world, or the pair of 4 ranks this rank is in (see _on_groups).


def _on_groups(body, impl: Adapter, seed: int):
    """``body(impl, seed, group)`` on the world, and at 4 ranks on the pairs {0, 1} and {2, 3} as well:
    [(where, group size, result)]. ``dist.new_group`` is collective: every rank creates both pairs, in
    the same order; each pair draws other numbers (its own seed), so that a sum over the world differs."""
    runs = [("the world", dist.get_world_size(), body(impl, seed, dist.group.WORLD))]
    if dist.get_world_size() == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        i = dist.get_rank() // 2
        runs.append((f"the group {[2 * i, 2 * i + 1]} of 4 ranks", 2, body(impl, seed + 100 * (i + 1), pairs[i])))
    return runs


def _runs(body, impl: Adapter, seed: int = 0):
    """(where, t, rank, result) of ``body`` on the world at t = 2 and 4, then on each pair of 4 ranks."""
    out = []
    for world in WORLDS:
        for rank, runs in enumerate(launch(_on_groups, world, body, impl, seed, timeout=30)):
            out += [(where, t, rank, result) for where, t, result in runs]
    return sorted(out, key=lambda run: run[0] != "the world")  # the world's verdicts first


def _f_and_g(impl: Adapter, seed, group):
    f, g = impl["f"], impl["g"]
    r = dist.get_rank()
    total = float(sum(m + 1 for m in dist.get_process_group_ranks(group)))  # Σ (rank + 1) over the group
    x = torch.full((4,), float(r + 1), device=device(), requires_grad=True)
    with counter.count() as c1:
        y = f(x, group)
    with counter.count() as c2:
        (y * (r + 1)).sum().backward()
    x2 = torch.full((4,), float(r + 1), device=device(), requires_grad=True)
    with counter.count() as c3:
        z = g(x2, group)
    with counter.count() as c4:
        (z * (r + 1)).sum().backward()
    counts = [c.calls() for c in (c1, c2, c3, c4)]
    return y.detach(), x.grad, z.detach(), x2.grad, x2.detach(), counts, total, sorted({*c2.as_dict(), *c3.as_dict()})


def _linears(impl: Adapter, seed, group):
    torch.manual_seed(seed)
    dense = impl["DenseMLP"](16, 64).to(device())  # initialised on the host: the same weights in the group
    x = _randn(seed, 3, 5, 16).requires_grad_(True)
    dy = _randn(seed + 1, 3, 5, 16)
    (dense(x) * dy).sum().backward()
    # each layer alone: a column layer's output is a slice, a row layer's input is a slice
    col = impl["ColumnParallelLinear"].from_dense(dense.fc1, group)
    xc = x.detach().clone().requires_grad_(True)
    yc = col(xc)
    _shape_ok(yc, _slice(dense.fc1(x), -1, group), "ColumnParallelLinear's output (this rank's output features)")
    dyc = _randn(seed + 2, 3, 5, 64)
    yc.mul(_slice(dyc, -1, group)).sum().backward()
    xd = x.detach().clone().requires_grad_(True)
    dense.fc1(xd).mul(dyc).sum().backward()
    row = impl["RowParallelLinear"].from_dense(dense.fc2, group)
    h = _randn(seed + 3, 3, 5, 64).requires_grad_(True)
    hr = _slice(h.detach(), -1, group).clone().requires_grad_(True)
    yr = row(hr)
    _shape_ok(yr, dense.fc2(h), "RowParallelLinear's output (the full sum)")
    yr.mul(dy).sum().backward()
    dense.fc2.weight.grad = None
    dense.fc2(h).mul(dy).sum().backward()
    return {
        "column output": _rel(yc, _slice(dense.fc1(x), -1, group)),
        "column input gradient (did f all-reduce it over the group?)": _rel(xc.grad, xd.grad),
        "column weight (rows of fc1.weight)": _rel(col.weight, _slice(dense.fc1.weight, 0, group)),
        "row output (did g sum the partial products over the group?)": _rel(yr, dense.fc2(h)),
        "row input gradient": _rel(hr.grad, _slice(h.grad, -1, group)),
        "row weight gradient": _rel(row.weight.grad, _slice(dense.fc2.weight.grad, 1, group)),
    }


def _mlp(impl: Adapter, seed, group):
    torch.manual_seed(seed)
    dense = impl["DenseMLP"](16, 64).to(device())  # initialised on the host: the same weights in the group
    mlp = impl["ParallelMLP"](dense, group)
    x = _randn(seed, 3, 5, 16).requires_grad_(True)
    xp = x.detach().clone().requires_grad_(True)
    dy = _randn(seed + 1, 3, 5, 16)
    (dense(x) * dy).sum().backward()
    with counter.count() as fwd:
        y = mlp(xp)
    _shape_ok(y, x, "ParallelMLP's output")
    with counter.count() as bwd:
        (y * dy).sum().backward()
    diffs = {
        "output": _rel(y, dense(x)),
        "input gradient": _rel(xp.grad, x.grad),
        "fc1 weight gradient": _rel(mlp.fc1.weight.grad, _slice(dense.fc1.weight.grad, 0, group)),
        "fc2 weight gradient": _rel(mlp.fc2.weight.grad, _slice(dense.fc2.weight.grad, 1, group)),
    }
    return diffs, fwd.as_dict(), bwd.as_dict(), x.numel() * x.element_size(), intercept.group_name(group)


def _embedding(impl: Adapter, seed, group):
    torch.manual_seed(seed)
    dense = torch.nn.Embedding(64, 8).to(device())  # initialised on the host: the same weights in the group
    emb = impl["VocabParallelEmbedding"].from_dense(dense, group)
    tokens = _tokens(seed, 4, 9)
    dy = _randn(seed, 4, 9, 8)
    (dense(tokens) * dy).sum().backward()
    with counter.count() as fwd:
        y = emb(tokens)
    _shape_ok(y, dense(tokens), "VocabParallelEmbedding's output")
    with counter.count() as bwd:
        (y * dy).sum().backward()
    # bit-equal: each token, and each row of the gradient, has one owner; the other ranks add exact zeros
    same = torch.equal(y, dense(tokens)) and torch.equal(emb.weight.grad, _slice(dense.weight.grad, 0, group))
    return same, fwd.calls("all_reduce"), bwd.calls()


def _cross_entropy(impl: Adapter, seed, group):
    # large logits: the max matters; the pair {2, 3} 200 higher, so that a max over the world (not the
    # group) underflows the pair {0, 1}'s exp(z - max) to 0 (the loss is invariant to the shift itself)
    shift = 200.0 if dist.get_process_group_ranks(group) == [2, 3] else 0.0
    logits = (_randn(seed, 6, 7, 64) * 5 + shift).requires_grad_(True)
    targets = _tokens(seed, 6, 7)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    want.backward()
    local = _slice(logits.detach(), -1, group).clone().requires_grad_(True)
    with counter.count() as fwd:
        got = impl["vocab_parallel_cross_entropy"](local, targets, group)
    with counter.count() as bwd:
        (got * 3.0).backward()  # an upstream gradient other than 1 must be applied
    assert local.grad is not None, "vocab_parallel_cross_entropy produced no gradient for the logits"
    return (
        got.item(),
        want.item(),
        _rel(local.grad, _slice(logits.grad, -1, group) * 3.0),
        fwd.as_dict(),
        bwd.as_dict(),
        targets.numel(),
        intercept.group_name(group),
    )


# -------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("f")
    missing = [n for n in NAMES if not hasattr(module, n)]
    assert not missing, f"tensor_parallel.py must define {', '.join(missing)}"


def check_f_and_g(impl: Adapter) -> None:
    """f: identity forward, its backward sums the gradient over the group (one all-reduce); g: sums over
    the group forward (a copy: the input untouched), identity backward. Exact: small integers."""
    for where, t, r, (y, xg, z, x2g, x2, calls, total, keys) in _runs(_f_and_g, impl):
        at = f"t={t} on {where}, rank {r}"
        assert torch.equal(y, _filled(r + 1.0)), f"{at}: f must be the identity forward"
        assert xg is not None and torch.equal(xg, _filled(total)), (
            f"{at}: f's backward must all-reduce (sum) the gradient over the group: got {xg}, expected {total} "
            "(pass group= to the all-reduce)"
        )
        assert torch.equal(z, _filled(total)), (
            f"{at}: g must all-reduce (sum) forward over the group: got {z}, expected {total}"
        )
        assert torch.equal(x2, _filled(r + 1.0)), f"{at}: g must not modify its input in place: reduce a copy"
        assert x2g is not None and torch.equal(x2g, _filled(r + 1.0)), f"{at}: g's backward must be the identity"
        assert calls == [0, 1, 1, 0], (
            f"{at}: collectives in f fwd, f bwd, g fwd, g bwd should be [0, 1, 1, 0], got {calls}"
        )
        assert all(k.endswith("@world") == (where == "the world") for k in keys), (
            f"{at}: f and g called {keys}: pass the layer's group to every collective (group=group)"
        )


def check_linears(impl: Adapter) -> None:
    for where, t, r, diffs in _runs(_linears, impl):
        bad = {k: f"{v:.1e}" for k, v in diffs.items() if v > RTOL}
        assert not bad, f"t={t} on {where}, rank {r}: these differ from the dense nn.Linear: {bad}"


def check_mlp(impl: Adapter) -> None:
    for where, t, r, (diffs, _, _, _, _) in _runs(_mlp, impl, 1):
        bad = {k: f"{v:.1e}" for k, v in diffs.items() if v > RTOL}
        assert not bad, f"ParallelMLP at t={t} on {where}, rank {r} differs from DenseMLP: {bad}"


def check_mlp_collectives(impl: Adapter) -> None:
    for where, t, r, (_, fwd, bwd, nbytes, name) in _runs(_mlp, impl, 1):
        one = {f"all_reduce@{name}": {"calls": 1, "bytes": nbytes}}
        assert fwd == one, (
            f"t={t} on {where}, rank {r}: the MLP forward needs exactly one all-reduce of [b, s, h] on the layer's "
            f"group (g after fc2): expected {one}, counted {fwd}"
        )
        assert bwd == one, (
            f"t={t} on {where}, rank {r}: the MLP backward needs exactly one all-reduce of [b, s, h] on the layer's "
            f"group (f before fc1): expected {one}, counted {bwd}"
        )


def check_embedding(impl: Adapter) -> None:
    for where, t, r, (same, fwd_calls, bwd_calls) in _runs(_embedding, impl, 2):
        assert same, (
            f"t={t} on {where}, rank {r}: the vocab-parallel embedding and its weight gradient must equal "
            "nn.Embedding's exactly: rows from the rank in the group (dist.get_rank(group)), zero the tokens "
            "you do not own, then sum with g"
        )
        assert (fwd_calls, bwd_calls) == (1, 0), (
            f"the embedding needs one all-reduce forward and none backward, counted {fwd_calls} and {bwd_calls}"
        )


def check_cross_entropy(impl: Adapter) -> None:
    for where, t, r, (got, want, grad_diff, _, _, _, _) in _runs(_cross_entropy, impl, 3):
        # reordering S_n's 64 terms moves log S_n by ≤ 64·eps ≈ 7.6e-6, below 1e-5·|loss| ≈ 1.2e-4 (loss ≈ 12)
        assert abs(got - want) <= 1e-5 * abs(want), (
            f"t={t} on {where}, rank {r}: loss {got} should equal F.cross_entropy {want}: the row maximum, the "
            "target logit and the sum of exponentials over the group, your columns from the rank in the group"
        )
        assert grad_diff <= RTOL, (
            f"t={t} on {where}, rank {r}: the logits' gradient differs by {grad_diff:.1e}: "
            "softmax minus one-hot on your columns, times the incoming gradient"
        )


def check_cross_entropy_collectives(impl: Adapter) -> None:
    for where, t, r, (_, _, _, fwd, bwd, n_tokens, name) in _runs(_cross_entropy, impl, 3):
        want = {f"all_reduce@{name}": {"calls": 3, "bytes": 3 * n_tokens * 4}}
        assert fwd == want, (
            f"t={t} on {where}, rank {r}: the cross-entropy needs exactly 3 all-reduces of one float per token "
            f"(max, target logit, sum of exponentials) on the group: expected {want}, counted {fwd}"
        )
        assert bwd == {}, f"the cross-entropy backward needs no communication, counted {bwd}"


TASKS = [
    Task("tensor_parallel.py imports and defines the layers", 1, check_setup, setup=True),
    Task("Task 1: f and g forward and backward, on the world and on sub-groups", 2, check_f_and_g),
    # Task 2's layers and Task 3's embedding put Task 1's f and g in place
    Task("Task 2: column and row parallel linear equal nn.Linear", 3, check_linears, needs=(check_f_and_g,)),
    Task("Task 2: ParallelMLP equals DenseMLP (outputs and gradients)", 2, check_mlp, needs=(check_f_and_g,)),
    Task("Task 2: one all-reduce forward and one backward per MLP", 1, check_mlp_collectives, needs=(check_f_and_g,)),
    Task("Task 3: vocab-parallel embedding equals nn.Embedding", 2, check_embedding, needs=(check_f_and_g,)),
    Task("Task 4: vocab-parallel cross-entropy equals F.cross_entropy", 3, check_cross_entropy),
    Task("Task 4: exactly three all-reduces, none backward", 1, check_cross_entropy_collectives),
]
