"""Grader of lab 03: ZeRO-1/2/3 with AdamW.

Graded: parameters after 5 steps equal torch DDP + torch AdamW (foreach=False) bit for bit at 2
ranks, fp32, on the course model and on a small model whose parameter sizes 2 does not divide;
with two backward passes per optimizer step (gradient accumulation) ZeRO-2 still equals AdamW on
the summed gradients, bit for bit; at 3 ranks (an odd N, units whose sizes 3 does not divide, one
smaller than N) each stage equals one-process AdamW on the average of the 3 ranks' gradients
within a derived tolerance; the bytes each rank holds (a census of the tensors reachable from the
learner's ZeroAdamW and the model: parameters, gradients, Adam moments) within 5% of the ZeRO
formula for fp32 AdamW at 4 ranks; and the communication of each stage: ZeRO-1 and ZeRO-2 only
reduce-scatter and all-gather, 2(N-1)/N·Ψ elements per step, ZeRO-2 reduce-scatters during
backward and keeps no full gradient, ZeRO-3 holds one unit at a time and moves 3(N-1)/N·Ψ.
Bit-equality is fair: adamw_ (given) does torch's arithmetic, and a 2-term sum has one order.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``zero.py``, tests/test_lab_checks.py passes course_lib's own
``Zero`` (course_lib.parallel.data.zero), whose constructor, ``units`` and ``_gather`` are the lab's.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.cost.collective_bytes import ring_wire_bytes, zero_comm_bytes
from course_lib.cost.memory import zero_model_state_bytes
from course_lib.dist import counter, device, launch
from course_lib.dist.census import held_bytes
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.optim.optimizers import adamw_

ROLES = ("ZeroAdamW", "padded_size", "shard_of", "adamw_")


def adapter(lab_dir: Path) -> Adapter:
    """The learner's ZeroAdamW and helpers, from ``zero.py``."""
    return Adapter.of_file(Path(lab_dir) / "zero.py", ROLES)


LR, WD, STEPS = 3e-3, 0.1, 5
FP32 = dict(k=8, param_bytes=4, grad_bytes=4)  # fp32 AdamW: 4 + 4 bytes of parameter and gradient, m and v
# Bytes held and moved are counts, not rounded values: they leave the formula only by the padding, < N
# elements per unit (none here, measured equal: the course model's 5 unit sizes are multiples of 4). 5% admits
# that; a 4Ψ-byte buffer kept whole that the stage should shard adds 3Ψ at N = 4, ≥ 19% of any stage's ≤ 16Ψ.
SIZE_TOL = 0.05


def _model(kind):
    """The model, initialised on the host (the same weights on every machine), on the rank's device.

    "odd": units of 20, 42 and 8 elements, whose parameters (15, 5, 35, 7, 7, 1) 2 does not divide;
    "three": the same and a last unit of 2 elements, so that at 3 ranks units of 20, 8 and 2 are padded
    (to 21, 9, 3) and the last rank's shard of the last unit is padding only."""
    torch.manual_seed(0)
    if kind in ("odd", "three"):
        layers = [nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 7), nn.Linear(7, 1)]
        return nn.Sequential(*layers, *([nn.Linear(1, 1)] if kind == "three" else [])).to(device())
    return Transformer(configs.get("tiny")).to(device())


def _loss(model, x, kind):
    if kind in ("odd", "three"):
        return model(x[:, :3].float() / 64).pow(2).mean()
    return next_token_loss(model(x[:, :-1]), x[:, 1:])


def _tokens(steps, rank=None):
    """``steps`` batches of rank ``rank`` (this rank's by default), drawn on the host."""
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(1 + rank)  # host: the same tokens on every machine
    return [torch.randint(0, 64, (2, 17), generator=g).to(device()) for _ in range(steps)]  # host: drawn with g


def _train(impl: Adapter, stage, kind, steps):
    model = _model(kind)
    zero = impl["ZeroAdamW"](model, stage, lr=LR, weight_decay=WD)
    for x in _tokens(steps):
        _loss(model, x, kind).backward()
        zero.step()
        zero.zero_grad()
    return model, zero


def _parity(impl: Adapter, stage):
    """{kind: the parameters that differ from DDP + AdamW after STEPS steps}, for both models, in one launch."""
    differ = {}
    for kind in ("tiny", "odd"):
        ref = _model(kind)
        ddp = DDP(ref)
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
        for x in _tokens(STEPS):
            _loss(ddp, x, kind).backward()
            opt.step()
            opt.zero_grad()
        model, zero = _train(impl, stage, kind, STEPS)
        units = getattr(zero, "units", [])
        for u in units if stage == 3 else []:
            zero._gather(u)  # read the parameters: gathered
        # bit-equal: adamw_ is torch's elementwise AdamW arithmetic, and gloo adds 2 terms g_0/2 + g_1/2 in one order
        differ[kind] = [n for (n, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(p, q)]
    return differ


def _bytes(impl: Adapter, stage):
    model, zero = _train(impl, stage, "tiny", 1)
    return held_bytes(zero, model), sum(p.numel() for p in _model("tiny").parameters())


def _counts(impl: Adapter, stage):
    model = _model("tiny")
    zero = impl["ZeroAdamW"](model, stage, lr=LR)
    units = zero.units
    live = lambda: [i for i, u in enumerate(units) if u.full.untyped_storage().nbytes() > 0]
    seen = []
    for i, u in enumerate(units):
        u.module.register_forward_pre_hook(lambda *_, i=i: seen.append((i, live())))
    with counter.count() as c:
        _loss(model, _tokens(1)[0], "tiny").backward()
        before_step = c.as_dict()
        grads_held = [n for n, p in model.named_parameters() if p.grad is not None]
        zero.step()
    return before_step, c.as_dict(), grads_held, seen, len(units), sum(u.numel for u in units)


class _AdamW:
    """torch.optim.AdamW(foreach=False)'s arithmetic (course_lib's adamw_, the parity checks prove it bit-equal),
    without torch.optim: its first step imports torch._dynamo, seconds in each rank of a check."""

    def __init__(self, params, eps=1e-8):
        self.params, self.eps, self.t = list(params), eps, 0
        self.state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]

    @torch.no_grad()
    def step(self, grads):
        self.t += 1
        for p, g, (m, v) in zip(self.params, grads, self.state):
            adamw_(p, g, m, v, self.t, LR, 0.9, 0.999, self.eps, WD)


ACCUMULATE = 2  # backward passes per optimizer step in the accumulation check
ACC_STEPS = 3


def _accumulation(impl: Adapter, stage):
    """ZeroAdamW with ACCUMULATE backwards per step, against torch AdamW on the summed gradients.

    The reference averages each backward's gradient over the ranks and adds them up, as a ZeRO-2/3 hook does
    (at 2 ranks: g_a0/2 + g_a1/2 then + (g_b0/2 + g_b1/2), each sum of two terms exact in any order)."""
    ref = _model("tiny")
    opt = _AdamW(ref.parameters())
    model = _model("tiny")
    zero = impl["ZeroAdamW"](model, stage, lr=LR, weight_decay=WD)
    batches = _tokens(ACC_STEPS * ACCUMULATE)
    n = dist.get_world_size()
    for step in range(ACC_STEPS):
        total = [torch.zeros_like(p) for p in ref.parameters()]
        for x in batches[step * ACCUMULATE : (step + 1) * ACCUMULATE]:
            _loss(model, x, "tiny").backward()
            _loss(ref, x, "tiny").backward()
            for t, p in zip(total, ref.parameters()):
                g = p.grad.mul(1 / n)
                dist.all_reduce(g)
                t.add_(g)
                p.grad = None
        opt.step(total)
        zero.step()
        zero.zero_grad()
    for u in getattr(zero, "units", []) if stage == 3 else []:
        zero._gather(u)
    return [name for (name, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(p, q)]


THREE = 3  # ranks of the odd-world check
EPS_THREE = 1e-3
# At 3 ranks the average g0/3 + g1/3 + g2/3 has several orders and 1/3 is inexact: a rank's averaged gradient
# differs from the grader's (an fp64 mean rounded once) by a few units of roundoff of the largest g_i,
# |Δg| ≤ 4·2^-24·max|g_i| ≈ 2.4e-7·max|g_i|. With eps = 1e-3 (instead of 1e-8) AdamW's step
# lr·m̂/(√v̂ + eps) moves by at most about lr/eps·|Δg|·2 per step, and no near-cancelling gradient can
# blow that up (its sensitivity is capped by 1/eps): over 5 steps 5·3·2·2.4e-7·max|g_i| < 1e-5 for
# |g_i| ≤ 1 (measured: below 1e-7). A large eps also keeps AdamW from hiding a wrong averaging factor: a
# gradient scaled by 3/2 (1/2 for 1/N) changes the step of every element whose |g| is near eps by ~1e-4.
THREE_TOL = 1e-5


def _three_ranks(impl: Adapter, stage):
    """STEPS steps of ZeroAdamW at 3 ranks, each rank its own batches, against one-process torch AdamW on
    the fp64 mean of the 3 ranks' gradients: the largest parameter difference and the parameters that differ."""
    ref = _model("three")
    opt = _AdamW(ref.parameters(), eps=EPS_THREE)
    model = _model("three")
    zero = impl["ZeroAdamW"](model, stage, lr=LR, weight_decay=WD, eps=EPS_THREE)
    n = dist.get_world_size()
    data = [_tokens(STEPS, r) for r in range(n)]  # every rank's batches: the reference sees them all
    for step in range(STEPS):
        _loss(model, data[dist.get_rank()][step], "three").backward()
        total = [torch.zeros_like(p, dtype=torch.float64) for p in ref.parameters()]
        for r in range(n):
            _loss(ref, data[r][step], "three").backward()
            for t, p in zip(total, ref.parameters()):
                t.add_(p.grad.double())
                p.grad = None
        opt.step([(t / n).float() for t in total])
        zero.step()
        zero.zero_grad()
    for u in getattr(zero, "units", []) if stage == 3 else []:
        zero._gather(u)
    diffs = {name: (p - q).abs().max().item() for (name, p), q in zip(model.named_parameters(), ref.parameters())}
    return max(diffs.values()), [name for name, d in diffs.items() if d > THREE_TOL]


# -------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("ZeroAdamW")
    for name in ROLES:
        assert callable(getattr(module, name, None)), f"zero.py must define {name}"


def check_padding(impl: Adapter) -> None:
    padded_size, shard_of = impl["padded_size"], impl["shard_of"]
    for numel, n, want in ((10, 4, 12), (12, 4, 12), (1, 4, 4), (7, 1, 7)):
        got = padded_size(numel, n)
        assert got == want, (
            f"padded_size({numel}, {n}) = {got}: the smallest multiple of {n} that holds {numel} is {want}"
        )
    flat = torch.arange(12.0)  # host: the grader's own process, no rank and no collective
    piece = shard_of(flat, 2, 4)
    assert torch.equal(piece, torch.tensor([6.0, 7.0, 8.0])), (  # host: compared with piece, on the host
        f"shard_of(arange(12), 2, 4) = {piece.tolist()}, expected [6, 7, 8]"
    )
    assert piece.data_ptr() == flat.data_ptr() + 6 * 4, "shard_of must return a view of the flat buffer, not a copy"


def _check_parity(impl: Adapter, stage: int) -> None:
    for rank, differ in enumerate(launch(_parity, 2, impl, stage, timeout=60)):
        for kind, names in differ.items():
            assert not names, (
                f"ZeRO-{stage}: after {STEPS} steps rank {rank}'s parameters {names[:3]} differ from torch DDP + AdamW "
                f"(model {kind!r}{', parameter sizes 2 does not divide' if kind == 'odd' else ''}): check the 1/N "
                "average, which slice each rank updates, and the all-gather"
            )


def _check_bytes(impl: Adapter, stage: int) -> None:
    world = 4
    for rank, (held, psi) in enumerate(launch(_bytes, world, impl, stage, timeout=60)):
        want = zero_model_state_bytes(psi, world, stage, **FP32)
        assert abs(held - want) <= SIZE_TOL * want, (
            f"ZeRO-{stage} at 4 ranks: rank {rank} holds {held} bytes of parameters, gradients and Adam state; the "
            f"formula says {want:.0f} (fp32: 4Ψ params, 4Ψ grads, 8Ψ moments, sharded by stage): look for a full "
            "buffer that this stage should shard, or a .grad left behind"
        )


RING_OPS = {"reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single", "all_gather_into_tensor"}


def _check_comm(impl: Adapter, stage: int, counts: dict, psi: int) -> None:
    """Stages 1-2 move what DDP moves, 2(N-1)/N·Ψ elements per rank per step, by reduce-scatter and all-gather."""
    other = {key.split("@")[0] for key in counts} - RING_OPS
    assert not other, (
        f"ZeRO-{stage} called {sorted(other)} in one step: reduce-scatter the averaged gradient (rank r needs "
        "only the sum of its own slice) and all-gather the updated parameters, nothing else"
    )
    moved, want = ring_wire_bytes(counts, 2), zero_comm_bytes(psi, 2, stage, bytes_per_element=4)
    assert abs(moved - want) <= SIZE_TOL * want, (
        f"ZeRO-{stage} moved {moved:.0f} bytes per rank in one step at 2 ranks; a reduce-scatter of the gradient and "
        f"an all-gather of the parameters move 2(N-1)/N·Ψ·4 = {want:.0f}: look for a buffer sent twice or whole"
    )


def _check_three_ranks(impl: Adapter, stage: int) -> None:
    for rank, (worst, differ) in enumerate(launch(_three_ranks, THREE, impl, stage, timeout=60)):
        assert not differ, (
            f"ZeRO-{stage} at 3 ranks: after {STEPS} steps rank {rank}'s parameters {differ[:3]} differ from AdamW on "
            f"the mean of the 3 ranks' gradients by up to {worst:.1e} (allowed {THREE_TOL:g}); units of 20, 8 and 2 "
            "elements are padded to 21, 9 and 3: check the padding, the shard sizes and offsets (padded, not numel), "
            "and the 1/N average"
        )


def check_stage1_parity(impl: Adapter) -> None:
    _check_parity(impl, 1)


def check_stage1_bytes(impl: Adapter) -> None:
    _check_bytes(impl, 1)


def check_stage1_comm(impl: Adapter) -> None:
    _, counts, _, _, _, psi = launch(_counts, 2, impl, 1, timeout=60)[0]
    _check_comm(impl, 1, counts, psi)


def check_stage1_three_ranks(impl: Adapter) -> None:
    _check_three_ranks(impl, 1)


def check_stage2_parity(impl: Adapter) -> None:
    _check_parity(impl, 2)


def check_stage2_bytes(impl: Adapter) -> None:
    _check_bytes(impl, 2)


def check_stage2_during_backward(impl: Adapter) -> None:
    before, counts, held, _, n_units, psi = launch(_counts, 2, impl, 2, timeout=60)[0]
    calls = sum(v["calls"] for k, v in before.items() if k.startswith("reduce_scatter"))
    assert calls == n_units, (
        f"ZeRO-2 should reduce-scatter each of the {n_units} units during backward, as soon as "
        f"its gradients are complete; counted {calls} reduce-scatters before step()"
    )
    assert not held, f"ZeRO-2 keeps only the gradient shard: set p.grad = None after copying; still held: {held[:3]}"
    _check_comm(impl, 2, counts, psi)


def check_stage2_accumulates(impl: Adapter) -> None:
    for rank, differ in enumerate(launch(_accumulation, 2, impl, 2, timeout=60)):
        assert not differ, (
            f"ZeRO-2 with {ACCUMULATE} backward passes per step (gradient accumulation): after {ACC_STEPS} steps rank "
            f"{rank}'s parameters {differ[:3]} differ from AdamW on the sum of both passes' averaged gradients: "
            "_grad_ready must add each pass's shard to u.grad_shard (zero_grad clears it), not overwrite or zero it"
        )


def check_stage2_three_ranks(impl: Adapter) -> None:
    _check_three_ranks(impl, 2)


def check_stage3_parity(impl: Adapter) -> None:
    _check_parity(impl, 3)


def check_stage3_bytes(impl: Adapter) -> None:
    _check_bytes(impl, 3)


def check_stage3_comm(impl: Adapter) -> None:
    _, counts, _, seen, n_units, psi = launch(_counts, 2, impl, 3, timeout=60)[0]
    for unit, live in seen:
        assert live == [unit], (
            f"ZeRO-3: while unit {unit} runs its forward, only it should be gathered; gathered "
            f"were units {live}: free after forward"
        )
    gathers = sum(v["calls"] for k, v in counts.items() if k.startswith("all_gather"))
    assert gathers == 2 * n_units, (
        f"ZeRO-3 all-gathers each of the {n_units} units twice per step (forward, backward); counted {gathers}"
    )
    moved, want = ring_wire_bytes(counts, 2), zero_comm_bytes(psi, 2, 3, bytes_per_element=4)
    assert abs(moved - want) <= SIZE_TOL * want, (
        f"ZeRO-3 moved {moved:.0f} bytes per rank per step; 3(N-1)/N·Ψ·4 = {want:.0f}"
    )


def check_stage3_three_ranks(impl: Adapter) -> None:
    _check_three_ranks(impl, 3)


ZERO1 = (check_padding, check_stage1_parity)  # stages 2 and 3 pad like stage 1 and update with Task 2's step
ZERO2 = (*ZERO1, check_stage2_parity)  # stage 3 reduce-scatters with Task 3's hook
TASKS = [
    Task("zero.py imports and defines ZeroAdamW and helpers", 1, check_setup, setup=True),
    Task("Task 1: padded_size and shard_of", 2, check_padding),
    Task("Task 2: ZeRO-1 parameters equal DDP + AdamW", 3, check_stage1_parity, needs=(check_padding,)),
    Task("Task 2: ZeRO-1 bytes per rank = 4Ψ + 4Ψ + 8Ψ/N", 1, check_stage1_bytes, needs=(check_padding,)),
    Task("Task 2: ZeRO-1 reduce-scatters and all-gathers, 2Ψ moved", 1, check_stage1_comm, needs=ZERO1),
    Task("Task 2: ZeRO-1 at 3 ranks equals AdamW", 1, check_stage1_three_ranks, needs=ZERO1),
    Task("Task 3: ZeRO-2 parameters equal DDP + AdamW", 2, check_stage2_parity, needs=ZERO1),
    Task("Task 3: ZeRO-2 bytes per rank = 4Ψ + 12Ψ/N", 1, check_stage2_bytes, needs=(check_padding,)),
    Task(
        "Task 3: ZeRO-2 reduce-scatters during backward, 2Ψ moved",
        1,
        check_stage2_during_backward,
        needs=(*ZERO1, check_stage1_comm),
    ),
    Task("Task 3: ZeRO-2 accumulates two backwards per step", 1, check_stage2_accumulates, needs=ZERO1),
    Task(
        "Task 3: ZeRO-2 at 3 ranks equals AdamW", 1, check_stage2_three_ranks, needs=(*ZERO1, check_stage1_three_ranks)
    ),
    Task("Task 4: ZeRO-3 parameters equal DDP + AdamW", 2, check_stage3_parity, needs=ZERO2),
    Task("Task 4: ZeRO-3 bytes per rank = 16Ψ/N", 1, check_stage3_bytes, needs=(check_padding, check_stage2_bytes)),
    Task(
        "Task 4: ZeRO-3 one unit at a time, 3Ψ moved",
        2,
        check_stage3_comm,
        needs=(*ZERO2, check_stage2_during_backward),
    ),
    Task(
        "Task 4: ZeRO-3 at 3 ranks equals AdamW",
        1,
        check_stage3_three_ranks,
        needs=(*ZERO2, check_stage1_three_ranks, check_stage2_three_ranks),
    ),
]
