"""Grader of lab 04: Megatron-LM tensor parallelism (f/g, column/row linear, vocab-parallel embedding
and cross-entropy), at tensor-parallel sizes 2 and 4.

Graded: outputs and gradients equal to the dense layers (the embedding exactly — each token has one
owner and the others add zeros; the rest within 1e-5 of each tensor's largest magnitude, because a
row-parallel sum or f's gradient adds t partial sums in another order than one dense matmul), and
the collectives per layer from course_lib's counter: an MLP costs one all-reduce forward and one
backward, the cross-entropy exactly three (max, target logit, sum of exponentials) of one float per
token, and nothing backward.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``tensor_parallel.py``, tests/test_lab_checks.py passes course_lib's
own f, g and layers (course_lib.parallel.tensor.comms and .layers).
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.dist import counter, device, launch
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


def _slice(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.chunk(dist.get_world_size(), dim)[dist.get_rank()]


def _filled(value: float) -> torch.Tensor:
    """Four ``value``s, for the grader's process to compare with the ranks' results."""
    return torch.full((4,), value)  # host: launch returns the ranks' tensors on the host


def _shape_ok(got, want, what):
    assert got is not None, f"{what} returned None: return the result tensor"
    assert got.shape == want.shape, f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"


# ---------------------------------------------------------------------------------- rank bodies


def _f_and_g(impl: Adapter):
    f, g = impl["f"], impl["g"]
    r, group = dist.get_rank(), dist.group.WORLD
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
    return y.detach(), x.grad, z.detach(), x2.grad, x2.detach(), [c.calls() for c in (c1, c2, c3, c4)]


def _linears(impl: Adapter, seed):
    group = dist.group.WORLD
    torch.manual_seed(seed)
    dense = impl["DenseMLP"](16, 64).to(device())  # initialised on the host: the same weights everywhere
    x = _randn(seed, 3, 5, 16).requires_grad_(True)
    dy = _randn(seed + 1, 3, 5, 16)
    (dense(x) * dy).sum().backward()
    # each layer alone: a column layer's output is a slice, a row layer's input is a slice
    col = impl["ColumnParallelLinear"].from_dense(dense.fc1, group)
    xc = x.detach().clone().requires_grad_(True)
    yc = col(xc)
    _shape_ok(yc, _slice(dense.fc1(x), -1), "ColumnParallelLinear's output (this rank's output features)")
    dyc = _randn(seed + 2, 3, 5, 64)
    yc.mul(_slice(dyc, -1)).sum().backward()
    xd = x.detach().clone().requires_grad_(True)
    dense.fc1(xd).mul(dyc).sum().backward()
    row = impl["RowParallelLinear"].from_dense(dense.fc2, group)
    h = _randn(seed + 3, 3, 5, 64).requires_grad_(True)
    hr = _slice(h.detach(), -1).clone().requires_grad_(True)
    yr = row(hr)
    _shape_ok(yr, dense.fc2(h), "RowParallelLinear's output (the full sum)")
    yr.mul(dy).sum().backward()
    dense.fc2.weight.grad = None
    dense.fc2(h).mul(dy).sum().backward()
    return {
        "column output": _rel(yc, _slice(dense.fc1(x), -1)),
        "column input gradient (did f all-reduce it?)": _rel(xc.grad, xd.grad),
        "column weight (rows of fc1.weight)": _rel(col.weight, _slice(dense.fc1.weight, 0)),
        "row output (did g sum the partial products?)": _rel(yr, dense.fc2(h)),
        "row input gradient": _rel(hr.grad, _slice(h.grad, -1)),
        "row weight gradient": _rel(row.weight.grad, _slice(dense.fc2.weight.grad, 1)),
    }


def _mlp(impl: Adapter, seed):
    torch.manual_seed(seed)
    dense = impl["DenseMLP"](16, 64).to(device())  # initialised on the host: the same weights everywhere
    mlp = impl["ParallelMLP"](dense, dist.group.WORLD)
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
        "fc1 weight gradient": _rel(mlp.fc1.weight.grad, _slice(dense.fc1.weight.grad, 0)),
        "fc2 weight gradient": _rel(mlp.fc2.weight.grad, _slice(dense.fc2.weight.grad, 1)),
    }
    return diffs, fwd.as_dict(), bwd.as_dict(), x.numel() * x.element_size()


def _embedding(impl: Adapter, seed):
    torch.manual_seed(seed)
    dense = torch.nn.Embedding(64, 8).to(device())  # initialised on the host: the same weights everywhere
    emb = impl["VocabParallelEmbedding"].from_dense(dense, dist.group.WORLD)
    tokens = _tokens(seed, 4, 9)
    dy = _randn(seed, 4, 9, 8)
    (dense(tokens) * dy).sum().backward()
    with counter.count() as fwd:
        y = emb(tokens)
    _shape_ok(y, dense(tokens), "VocabParallelEmbedding's output")
    with counter.count() as bwd:
        (y * dy).sum().backward()
    # bit-equal: each token, and each row of the gradient, has one owner; the other ranks add exact zeros
    same = torch.equal(y, dense(tokens)) and torch.equal(emb.weight.grad, _slice(dense.weight.grad, 0))
    return same, fwd.calls("all_reduce"), bwd.calls()


def _cross_entropy(impl: Adapter, seed):
    logits = (_randn(seed, 6, 7, 64) * 5).requires_grad_(True)  # large logits: the max matters
    targets = _tokens(seed, 6, 7)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    want.backward()
    local = _slice(logits.detach(), -1).clone().requires_grad_(True)
    with counter.count() as fwd:
        got = impl["vocab_parallel_cross_entropy"](local, targets, dist.group.WORLD)
    with counter.count() as bwd:
        (got * 3.0).backward()  # an upstream gradient other than 1 must be applied
    assert local.grad is not None, "vocab_parallel_cross_entropy produced no gradient for the logits"
    return (
        got.item(),
        want.item(),
        _rel(local.grad, _slice(logits.grad, -1) * 3.0),
        {k: v for k, v in fwd.as_dict().items()},
        bwd.as_dict(),
        targets.numel(),
    )


# -------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("f")
    missing = [n for n in NAMES if not hasattr(module, n)]
    assert not missing, f"tensor_parallel.py must define {', '.join(missing)}"


def check_f_and_g(impl: Adapter) -> None:
    for world in WORLDS:
        total = world * (world + 1) / 2
        for r, (y, xg, z, x2g, x2, calls) in enumerate(launch(_f_and_g, world, impl, timeout=30)):
            assert torch.equal(y, _filled(r + 1.0)), f"f must be the identity forward (rank {r}, t={world})"
            assert xg is not None and torch.equal(xg, _filled(total)), (
                f"f's backward must all-reduce (sum) the gradient: rank {r} of {world} got {xg}, expected {total}"
            )
            assert torch.equal(z, _filled(total)), f"g must all-reduce (sum) forward: rank {r} got {z}"
            assert torch.equal(x2, _filled(r + 1.0)), "g must not modify its input in place: reduce a copy"
            assert x2g is not None and torch.equal(x2g, _filled(r + 1.0)), "g's backward must be the identity"
            assert calls == [0, 1, 1, 0], (
                f"collectives in f fwd, f bwd, g fwd, g bwd should be [0, 1, 1, 0], got {calls}"
            )


def check_linears(impl: Adapter) -> None:
    for world in WORLDS:
        for r, diffs in enumerate(launch(_linears, world, impl, 0, timeout=30)):
            bad = {k: f"{v:.1e}" for k, v in diffs.items() if v > RTOL}
            assert not bad, f"t={world}, rank {r}: these differ from the dense nn.Linear: {bad}"


def check_mlp(impl: Adapter) -> None:
    for world in WORLDS:
        for r, (diffs, _, _, _) in enumerate(launch(_mlp, world, impl, 1, timeout=30)):
            bad = {k: f"{v:.1e}" for k, v in diffs.items() if v > RTOL}
            assert not bad, f"ParallelMLP at t={world}, rank {r} differs from DenseMLP: {bad}"


def check_mlp_collectives(impl: Adapter) -> None:
    for world in WORLDS:
        _, fwd, bwd, nbytes = launch(_mlp, world, impl, 1, timeout=30)[0]
        one = {"all_reduce@world": {"calls": 1, "bytes": nbytes}}
        assert fwd == one, f"the MLP forward needs exactly one all-reduce of [b, s, h] (g after fc2); counted {fwd}"
        assert bwd == one, f"the MLP backward needs exactly one all-reduce of [b, s, h] (f before fc1); counted {bwd}"


def check_embedding(impl: Adapter) -> None:
    for world in WORLDS:
        for r, (same, fwd_calls, bwd_calls) in enumerate(launch(_embedding, world, impl, 2, timeout=30)):
            assert same, (
                f"t={world}, rank {r}: the vocab-parallel embedding and its weight gradient must equal "
                "nn.Embedding's exactly: zero the rows of tokens you do not own, then sum with g"
            )
            assert (fwd_calls, bwd_calls) == (1, 0), (
                f"the embedding needs one all-reduce forward and none backward, counted {fwd_calls} and {bwd_calls}"
            )


def check_cross_entropy(impl: Adapter) -> None:
    for world in WORLDS:
        for r, (got, want, grad_diff, _, _, _) in enumerate(launch(_cross_entropy, world, impl, 3, timeout=30)):
            # reordering S_n's 64 terms moves log S_n by ≤ 64·eps ≈ 7.6e-6, below 1e-5·|loss| ≈ 1.2e-4 (loss ≈ 12)
            assert abs(got - want) <= 1e-5 * abs(want), (
                f"t={world}, rank {r}: loss {got} should equal F.cross_entropy {want}"
            )
            assert grad_diff <= RTOL, (
                f"t={world}, rank {r}: the logits' gradient differs by {grad_diff:.1e}: "
                "softmax minus one-hot on your columns, times the incoming gradient"
            )


def check_cross_entropy_collectives(impl: Adapter) -> None:
    for world in WORLDS:
        _, _, _, fwd, bwd, n_tokens = launch(_cross_entropy, world, impl, 3, timeout=30)[0]
        want = {"all_reduce@world": {"calls": 3, "bytes": 3 * n_tokens * 4}}
        assert fwd == want, (
            f"the cross-entropy needs exactly 3 all-reduces of one float per token (max, target "
            f"logit, sum of exponentials), counted {fwd}"
        )
        assert bwd == {}, f"the cross-entropy backward needs no communication, counted {bwd}"


TASKS = [
    Task("tensor_parallel.py imports and defines the layers", 1, check_setup, setup=True),
    Task("Task 1: f and g forward and backward", 2, check_f_and_g),
    Task("Task 2: column and row parallel linear equal nn.Linear", 3, check_linears),
    Task("Task 2: ParallelMLP equals DenseMLP (outputs and gradients)", 2, check_mlp),
    Task("Task 2: one all-reduce forward and one backward per MLP", 1, check_mlp_collectives),
    Task("Task 3: vocab-parallel embedding equals nn.Embedding", 2, check_embedding),
    Task("Task 4: vocab-parallel cross-entropy equals F.cross_entropy", 3, check_cross_entropy),
    Task("Task 4: exactly three all-reduces, none backward", 1, check_cross_entropy_collectives),
]
