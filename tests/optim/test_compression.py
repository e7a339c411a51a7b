"""course_lib.optim.compression: gradient compression hooks, their bytes, their algorithm and their DDP plumbing.

* bytes: what course_lib.dist.counter counts in one DDP step with each hook == the formula of
  course_lib.cost.compression_payload, bucket by bucket;
* the algorithms: QSGD is unbiased; error feedback telescopes (Σ applied = Σ mean gradient − mean
  residual) and recovers what plain Top-K drops; course PowerSGD == torch's ``powerSGD_hook``;
* the plumbing: one hook function gives the same gradients under the course DDP and torch's DDP;
* training the tiny course model with each hook reduces the loss.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course_lib.cost.compression_payload import powersgd_comm_bytes, qsgd_comm_bytes, sign_comm_bytes, topk_comm_bytes
from course_lib.dist import counter, device, launch
from course_lib.experiments.lecture05 import gradient_compression_runs
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.optim.compression import QSGDState, TopKState, pack_bits, qsgd_dequantize, qsgd_quantize, unpack_bits
from course_lib.optim.powersgd import PowerSGDState, powersgd_hook
from course_lib.parallel.data.comm_hook import GradBucket
from course_lib.parallel.data.ddp import DistributedDataParallel, split_batch

EPS = torch.finfo(torch.float32).eps
# the harness's settings and hooks (course_lib.experiments.lecture05.gradient_compression_runs): ~52 KB buckets, so the tiny model's
# 417 KiB of gradients make 5 of them (as in tests/parallel/data/test_ddp.py); 8 sequences of 32 tokens per step
CAP_MB, HOOKS, _global_batches = (
    gradient_compression_runs.CAP_MB,
    gradient_compression_runs.HOOKS,
    gradient_compression_runs.global_batches,
)


def _expected_bytes(name: str, shapes: list[tuple[int, ...]], state) -> int:
    """The formula of course_lib.cost.compression_payload for one bucket holding gradients of ``shapes``."""
    n = sum(torch.Size(s).numel() for s in shapes)
    if name.startswith("topk"):
        return topk_comm_bytes(state.k(n))
    if name == "qsgd":
        return qsgd_comm_bytes(n)
    if name == "sign":
        return sign_comm_bytes(n)
    return powersgd_comm_bytes(shapes, state.matrix_approximation_rank, state.min_compression_rate)


def _shard(batch):
    r, w = dist.get_rank(), dist.get_world_size()
    return tuple(split_batch(t, r, w).to(device()) for t in batch)  # the global batch is drawn on the host


def _bucket(tensors, index=0, is_last=True) -> GradBucket:
    """A bucket holding copies of ``tensors`` back to back (the tensors stand in for the parameters)."""
    return GradBucket(index, torch.cat([t.reshape(-1) for t in tensors]), tensors, is_last)


# ---------------------------------------------------------------------------- pieces, on one process


@pytest.mark.parametrize("n", [1, 8, 13, 64])
def test_pack_bits_round_trips(n):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 8), "8 bits per byte, the last byte padded"
    assert torch.equal(unpack_bits(packed, n), bits), "unpack_bits(pack_bits(b)) should give b back"


def test_qsgd_is_unbiased():
    # One draw of coordinate i is ‖v‖/s·(⌊x⌋ + Bernoulli(frac x)): its standard deviation is at most
    # ‖v‖/(2s). The mean of T draws is off by at most 5·‖v‖/(2s·√T) at 5σ (P ≈ 6e-7 per coordinate).
    # Rounding to the nearest level instead is biased by up to ‖v‖/(2s) = √T/5 ≈ 12.6 tolerances.
    s, T = 4, 4000
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(64, generator=gen)
    draws = torch.stack([qsgd_dequantize(*qsgd_quantize(v, s, gen), s) for _ in range(T)])
    level, _ = qsgd_quantize(v, s, gen)
    assert level.dtype == torch.int8 and int(level.abs().max()) <= s, "levels are signed ints in -s..s"
    tol = 5 * float(v.norm()) / (2 * s * T**0.5)
    err = float((draws.mean(0) - v).abs().max())
    assert err < tol, f"the mean of {T} QSGD draws is {err:.3g} from v (> {tol:.3g}): is the rounding up with P = frac?"


def test_bad_settings_say_what_is_allowed():
    with pytest.raises(ValueError, match=r"ratio=0 must be in \(0, 1\]"):
        TopKState(ratio=0)
    with pytest.raises(ValueError, match="levels=200 must be in 1..127"):
        QSGDState(levels=200)
    with pytest.raises(ValueError, match="cannot hold"):
        GradBucket(0, torch.zeros(3), [torch.zeros(2)], True)


# ---------------------------------------------------------------------------- bytes: counter == formula


def _count_one_step(name, batch):
    make, hook = HOOKS[name]
    torch.manual_seed(0)
    model = DistributedDataParallel(Transformer(configs.get("tiny")).to(device()), bucket_cap_mb=CAP_MB)
    state = make()
    model.register_comm_hook(state, hook)
    x, y = _shard(batch)
    with counter.count() as c:
        next_token_loss(model(x), y).backward()
    shapes = [[tuple(p.shape) for p in b.params] for b in model.buckets]
    expected = [_expected_bytes(name, s, state) for s in shapes]
    if name == "powersgd":  # per bucket: one all-reduce of what it leaves alone (if any), then P and Q
        ranks = [[state.rank_of(s) for s in b] for b in shapes]
        calls = sum((None in r) + 2 * any(q is not None for q in r) for r in ranks)
    else:  # one all-gather per bucket: values, indices and scales travel as one message
        calls = len(shapes)
    return c.as_dict(), expected, calls, shapes


@pytest.mark.parametrize("name", ["topk", "qsgd", "sign", "powersgd"])
def test_bytes_per_step_match_the_formula(name):
    for rank, (counts, expected, calls, shapes) in enumerate(
        launch(_count_one_step, 2, name, _global_batches(1)[0], timeout=60)
    ):
        total = sum(e["bytes"] for e in counts.values())
        plain = sum(torch.Size(s).numel() * 4 for b in shapes for s in b)
        assert total == sum(expected), (
            f"rank {rank}, {name}: the counter saw {total} B in one step ({counts}), course_lib.cost.compression_payload says "
            f"{sum(expected)} B ({expected} per bucket): does the hook send what its formula says?"
        )
        op = "all_reduce@world" if name == "powersgd" else "all_gather@world"
        assert counts == {op: {"calls": calls, "bytes": total}}, f"{name}: expected {calls} calls of {op}: {counts}"
        assert total < plain / 3, f"{name} should send far less than the {plain} B of an all-reduce, sent {total}"


# ---------------------------------------------------------------------------- error feedback

N, STEPS = 200, 60


def _gradients(step: int, rank: int) -> torch.Tensor:
    """A persistent direction μ (the same on every rank and step) plus per-rank, per-step noise; drawn on
    the host (the same numbers on any machine), returned on the rank's device."""
    mu = 0.3 * torch.randn(N, generator=torch.Generator().manual_seed(1234))
    return (mu + torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + rank))).to(device())


def _accumulate(name):
    """Σ_t applied_t, Σ_t mean-gradient_t and the mean residual after STEPS steps of one hook."""
    make, hook = HOOKS[name]
    state, world = make(), dist.get_world_size()
    if name.startswith("topk"):
        state.ratio = 0.05
    applied = torch.zeros(N, dtype=torch.float64, device=device())
    true, worst = torch.zeros_like(applied), 0.0
    for t in range(STEPS):
        g = _gradients(t, dist.get_rank())
        shapes = [g[:120].view(12, 10), g[120:]]  # a matrix and a vector, for PowerSGD
        out = hook(state, _bucket(shapes)).wait()
        applied += out.double()
        true += sum(_gradients(t, r).double() for r in range(world)) / world
        worst = max(worst, float(g.abs().max()))
    residuals = getattr(state, "residuals", None) or getattr(state, "error_dict", {})
    e = residuals.get(0, torch.zeros(N, device=device())).clone()
    worst_e = float(e.abs().max())
    dist.all_reduce(e)
    return applied, true, (e / world).double(), worst + worst_e


@pytest.mark.parametrize("name", ["topk", "sign", "powersgd"])
def test_error_feedback_telescopes(name):
    # e_t = p_t − C(p_t), p_t = g_t + e_{t-1}, so Σ_t applied_t = Σ_t ḡ_t − mean_r e_T,r exactly in real
    # numbers. In fp32 each step rounds g + e, the decoding and the division by W, each by ≤ eps of its
    # size (≤ max|g| + max|e|, summed over 2 ranks): 8·eps·STEPS·(max|g| + max|e|) bounds it.
    applied, true, mean_residual, size = launch(_accumulate, 2, name, timeout=60)[0]
    gap = float((applied + mean_residual - true).abs().max())
    tol = 8 * EPS * STEPS * size
    assert gap < tol, (
        f"{name}: Σ applied + mean residual differs from Σ mean gradient by {gap:.3g} (> {tol:.3g}): "
        "is the residual e = (g + e) − C(g + e), added back before compressing?"
    )


def test_error_feedback_recovers_what_topk_drops():
    # Without error feedback the small coordinates of the persistent direction μ are never sent: the
    # gap grows as STEPS·|μ|. With it, the gap is one residual, whatever STEPS is.
    with_ef = launch(_accumulate, 2, "topk", timeout=60)[0]
    without = launch(_accumulate, 2, "topk_no_ef", timeout=60)[0]
    gap_ef = float((with_ef[0] - with_ef[1]).norm())
    gap_plain = float((without[0] - without[1]).norm())
    assert gap_ef < 0.25 * gap_plain, (
        f"after {STEPS} steps of Top-K 5%, ‖Σ applied − Σ mean gradient‖ is {gap_ef:.3g} with error feedback and "
        f"{gap_plain:.3g} without: error feedback should deliver what plain Top-K keeps dropping"
    )


# ---------------------------------------------------------------------------- PowerSGD: course == torch

SHAPES = [(48, 40), (40,), (8, 6, 5), (64, 16), (48, 40), (7,)]  # (48, 40) twice: torch groups by shape


def _powersgd_side_by_side(rank):
    common = dict(matrix_approximation_rank=rank, min_compression_rate=0.1, use_error_feedback=True, warm_start=True)
    ours = PowerSGDState(start_powerSGD_iter=0, random_seed=3, **common)
    theirs = torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2, random_seed=3, **common)
    theirs.start_powerSGD_iter = 0  # its constructor wants ≥ 2 for torch DDP's bucket rebuild; no DDP here
    worst = []
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        grads = [torch.randn(s, generator=gen).to(device()) for s in SHAPES]  # drawn on the host, as any machine
        a = powersgd_hook(ours, _bucket(grads, is_last=True)).wait()
        b = torch_powersgd.powerSGD_hook(theirs, _bucket(grads, is_last=True)).wait()
        worst.append((float((a - b).abs().max()), float(b.abs().max())))
    return worst


@pytest.mark.parametrize("rank", [1, 3])  # rank ≤ 2: Gram-Schmidt; rank 3: QR (torch's split)
def test_course_powersgd_equals_torch_powersgd(rank):
    # Same matrices (vectors too: min_compression_rate 0.1 compresses a bias as an n×1 matrix), same first
    # Q (same seed, drawn the same way), same orthogonalisation, error feedback and warm start. Left: the
    # kernels. Torch multiplies with bmm, which takes its own loop for products under 400 multiply-adds
    # (the 8×30 matrix at rank 1), we with matmul (BLAS). Each output element is a sum of ≤ 48 fp32
    # products, so another summation order moves it by ≲ 48·eps of the output scale, and 3 steps of
    # error feedback carry that on: tolerance 3·48·eps·scale. Measured: bit-equal at rank 3, ≤ 2.6·eps·scale
    # at rank 1 (AVX2 and ATEN_CPU_CAPABILITY=default).
    for r, steps in enumerate(launch(_powersgd_side_by_side, 2, rank, timeout=60)):
        for step, (diff, scale) in enumerate(steps):
            assert diff <= 3 * 48 * EPS * scale, (
                f"rank {r}, step {step}: course PowerSGD differs from torch's powerSGD_hook by {diff:.3g} "
                f"(output scale {scale:.3g}): compare the orthogonalisation, the P/Q order and the error update"
            )


# ---------------------------------------------------------------------------- the same hook under both DDPs


def _same_hook_both_ddps(name, batches):
    torch.manual_seed(0)
    base = Transformer(configs.get("tiny")).to(device())
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    x, y = _shard(batches[0])
    next_token_loss(ref(x), y).backward()  # torch's first step: it rebuilds its buckets at the next forward
    ref.zero_grad(set_to_none=True)
    if name == "allreduce":  # torch's own reference hook: checks the convention (raw bucket in, average out)
        ours.register_comm_hook(None, default_hooks.allreduce_hook)
        ref.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        make, hook = HOOKS[name]
        ours.register_comm_hook(make(), hook)
        ref.register_comm_hook(make(), hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    different = []
    for batch in batches[1:]:
        x, y = _shard(batch)
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad(set_to_none=True)
            next_token_loss(model(x), y).backward()
        different.append(sum(int((a.grad != b.grad).sum()) for a, b in zip(ours.parameters(), ref.parameters())))
        for opt in opts:
            opt.step()
    return different


@pytest.mark.parametrize("name", ["allreduce", "sign", "powersgd", "topk"])
def test_same_hook_same_gradients_in_course_and_torch_ddp(name):
    # bit-equal: the same buckets (tests/parallel/data/test_ddp.py), the same raw gradients in them, the same hook
    for rank, different in enumerate(launch(_same_hook_both_ddps, 2, name, _global_batches(4, seed=5), timeout=60)):
        assert different == [0, 0, 0], (
            f"rank {rank}, hook {name}: {different} gradient elements per step differ between the course DDP and "
            "torch DDP: does the course DDP hand the hook raw (not pre-divided) gradients and copy the result back?"
        )


# ---------------------------------------------------------------------------- training

STEPS_TRAINED = 30


@functools.cache
def _runs() -> dict:
    """Every hook trained 30 steps from one initial model on the same batches, in one launch."""
    return gradient_compression_runs.train_with_hooks(steps=STEPS_TRAINED, seed=1)


@pytest.mark.parametrize("name", ["topk", "qsgd", "sign", "powersgd"])
def test_training_with_each_hook_reduces_the_loss(name):
    losses = _runs()[name]["loss"]
    first, last = losses[0], sum(losses[-5:]) / 5
    # measured: 4.19 -> 2.78 uncompressed, 2.78 PowerSGD r=2, 2.78 QSGD, 2.79 sign, 2.93 Top-K 1% (the
    # language's floor is 1.90); a hook whose updates were noise would stay near ln 64 = 4.16
    assert last < first - 1.0, (
        f"{name}: 30 AdamW steps on the tiny model took the loss from {first:.3f} to {last:.3f} (mean of the "
        "last 5): the compressed gradients should still point downhill"
    )


def test_every_training_step_sends_the_same_compressed_payload():
    runs = _runs()
    plain = runs["none"]["bytes"]
    assert len(set(plain)) == 1 and plain[0] == 4 * sum(
        p.numel() for p in Transformer(configs.get("tiny")).parameters()
    ), "without a hook, every step should all-reduce each fp32 gradient once: 4 bytes per parameter"
    for name in ("topk", "qsgd", "sign", "powersgd"):
        sent = runs[name]["bytes"]
        # the payloads depend on the bucket sizes only (Top-K's k, PowerSGD's shapes, QSGD's n + 4): the
        # same every step, each below the plain all-reduce (test_bytes_per_step_match_the_formula: == formula)
        assert len(set(sent)) == 1 and sent[0] < plain[0], f"{name}: {sent[:3]} bytes per step against {plain[0]}"


def _register_twice():
    model = DistributedDataParallel(torch.nn.Linear(2, 2).to(device()))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_comm_hook_is_registered_once():
    message = launch(_register_twice, 1, timeout=60)[0]
    assert "can only be called once" in message, message


def test_error_feedback_makes_topk_train_better():
    with_ef, without = _runs()["topk"]["loss"], _runs()["topk_no_ef"]["loss"]
    ef, plain = sum(with_ef[-5:]) / 5, sum(without[-5:]) / 5
    # measured 2.93 with error feedback, 3.01 without (Top-K 1%, mean of the last 5 of 30 AdamW steps)
    assert ef < plain - 0.03, (
        f"Top-K 1% ends at loss {ef:.3f} with error feedback and {plain:.3f} without: the residual should deliver "
        "the coordinates plain Top-K never sends, and training should gain from them"
    )
