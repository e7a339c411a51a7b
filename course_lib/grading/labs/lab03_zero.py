"""Grader of lab 03: ZeRO-1/2/3 with AdamW.

Graded: parameters after 5 steps equal torch DDP + torch AdamW (foreach=False) bit for bit at 2
ranks, fp32, on the course model and on a small model whose sizes 2 does not divide (padding);
the bytes each rank holds (a census of the tensors reachable from the learner's ZeroAdamW and the
model: parameters, gradients, Adam moments) within 5% of the ZeRO formula for fp32 AdamW at 4
ranks; and the invariant of each stage: ZeRO-2 reduce-scatters during backward and keeps no full
gradient, ZeRO-3 holds one unit at a time and moves 3(N-1)/N·Ψ elements per step.
Bit-equality is fair: adamw_ (given) does torch's arithmetic, and a 2-term sum has one order.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``zero.py``, tests/test_lab_checks.py passes course_lib's own
``Zero`` (course_lib.parallel.data.zero), whose constructor, ``units`` and ``_gather`` are the lab's.
"""

from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.cost.comm import ring_wire_bytes, zero_comm_bytes
from course_lib.cost.memory import zero_model_state_bytes
from course_lib.dist import counter, device, launch
from course_lib.dist.census import held_bytes
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task
from course_lib.model import config as configs
from course_lib.model.transformer import Transformer, next_token_loss

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
    """The model, initialised on the host (the same weights on every machine), on the rank's device."""
    torch.manual_seed(0)
    if kind == "odd":
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 7), nn.Linear(7, 1)).to(device())
    return Transformer(configs.get("tiny")).to(device())


def _loss(model, x, kind):
    if kind == "odd":
        return model(x[:, :3].float() / 64).pow(2).mean()
    return next_token_loss(model(x[:, :-1]), x[:, 1:])


def _tokens(steps):
    g = torch.Generator().manual_seed(1 + dist.get_rank())  # host: the same tokens on every machine
    return [torch.randint(0, 64, (2, 17), generator=g).to(device()) for _ in range(steps)]  # host: drawn with g


def _train(impl: Adapter, stage, kind, steps):
    model = _model(kind)
    zero = impl["ZeroAdamW"](model, stage, lr=LR, weight_decay=WD)
    for x in _tokens(steps):
        _loss(model, x, kind).backward()
        zero.step()
        zero.zero_grad()
    return model, zero


def _parity(impl: Adapter, stage, kind):
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
    differ = [n for (n, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(p, q)]
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
    for kind in ("tiny", "odd"):
        for rank, differ in enumerate(launch(_parity, 2, impl, stage, kind, timeout=60)):
            assert not differ, (
                f"ZeRO-{stage}: after {STEPS} steps rank {rank}'s parameters {differ[:3]} differ from torch DDP + AdamW "
                f"(model {kind!r}{', sizes 2 does not divide' if kind == 'odd' else ''}): check the 1/N average, which "
                "slice each rank updates, and the all-gather"
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


def check_stage2_during_backward(impl: Adapter) -> None:
    before, _, held, _, n_units, _ = launch(_counts, 2, impl, 2, timeout=60)[0]
    calls = sum(v["calls"] for k, v in before.items() if k.startswith("reduce_scatter"))
    assert calls == n_units, (
        f"ZeRO-2 should reduce-scatter each of the {n_units} units during backward, as soon as "
        f"its gradients are complete; counted {calls} reduce-scatters before step()"
    )
    assert not held, f"ZeRO-2 keeps only the gradient shard: set p.grad = None after copying; still held: {held[:3]}"


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


TASKS = [
    Task("zero.py imports and defines ZeroAdamW and helpers", 1, check_setup, setup=True),
    Task("Task 1: padded_size and shard_of", 2, check_padding),
    Task("Task 2: ZeRO-1 parameters equal DDP + AdamW", 3, partial(_check_parity, stage=1)),
    Task("Task 2: ZeRO-1 bytes per rank = 4Ψ + 4Ψ + 8Ψ/N", 1, partial(_check_bytes, stage=1)),
    Task("Task 3: ZeRO-2 parameters equal DDP + AdamW", 2, partial(_check_parity, stage=2)),
    Task("Task 3: ZeRO-2 bytes per rank = 4Ψ + 12Ψ/N", 1, partial(_check_bytes, stage=2)),
    Task("Task 3: ZeRO-2 reduce-scatters during backward", 1, check_stage2_during_backward),
    Task("Task 4: ZeRO-3 parameters equal DDP + AdamW", 2, partial(_check_parity, stage=3)),
    Task("Task 4: ZeRO-3 bytes per rank = 16Ψ/N", 1, partial(_check_bytes, stage=3)),
    Task("Task 4: ZeRO-3 one unit at a time, 3Ψ moved", 2, check_stage3_comm),
]
