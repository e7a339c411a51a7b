"""Lab 03's rank side: what each rank runs for the grader's checks (lab03_zero.py compares the results).

On each rank the learner's ZeroAdamW trains a model next to the reference — torch DDP with torch's
AdamW (foreach=False), or one-process AdamW on the average of the ranks' gradients at 3 ranks — and the
parameters, the bytes held (a census of the tensors reachable from the optimizer and the model) and the
collectives issued come back to the grader. The tolerances are derived where they are defined.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.dist import counter, device
from course_lib.dist.census import held_bytes
from course_lib.grading.adapter import Adapter
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.optim.optimizers import adamw_

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
