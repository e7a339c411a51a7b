"""course_lib.parallel.data.ddp: why it matches torch's DDP bit for bit, and against single-process training.

The comparisons with torch DDP themselves (the broadcast, the bucket rule and buckets, gradients and
parameters bit-equal at 2, 3 and 4 ranks, overlap in the trace, no_sync) are lab 02's grader checks,
run against this library in tests/grading/test_lab_checks.py. This file keeps what they do not check:
that the pre-division by W and torch's bucket layout are what bit-equality needs (see the module
docstring of course_lib/parallel/data/ddp.py), equality with single-process training up to rounding,
that the state broadcast is rank 0's, bad input, the traced step of lecture 02, and accelerate.

Torch DDP spends its first iteration with a single bucket holding every gradient (it does not yet
know the order in which gradients arrive) and rebuilds its buckets, in arrival order, at the next
forward. So the torch reference takes one warm-up backward before any comparison; from then on its
buckets are ours (lab 02's ``check_bucket_order`` checks that).
"""

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course_lib import data
from course_lib.dist import counter, device, launch
from course_lib.experiments.lecture02.ddp_trace import trace_step
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.data.ddp import DistributedDataParallel, NaiveDataParallel, assign_buckets, split_batch

ROOT = Path(__file__).resolve().parents[3]
CAP_MB = 0.05  # ~52 KB: the tiny model (417 KiB of gradients) gets 5 buckets
GLOBAL_BATCH, SEQ = 12, 32  # 12 splits over 2, 3 and 4 ranks


@functools.lru_cache
def _language():
    return data.MarkovLanguage()


def _global_batches(n: int, seed: int = 0):
    ds = data.make_dataset(_language(), GLOBAL_BATCH * SEQ * n + 1, SEQ, seed=seed)
    return list(ds.batches(GLOBAL_BATCH, seed=seed))[:n]


def _shard(batch):
    r, w = dist.get_rank(), dist.get_world_size()
    return tuple(split_batch(t, r, w).to(device()) for t in batch)  # the global batch is drawn on the host


def _step(model, x, y):
    next_token_loss(model(x), y).backward()


def _models(cap_mb=CAP_MB, seed=0):
    """(ours, torch DDP, plain copy) from one initial model; torch DDP already past its warm-up."""
    torch.manual_seed(seed)
    base = Transformer(configs.get("tiny")).to(device())
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap_mb)
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=cap_mb)
    x, y = _shard(_global_batches(1, seed=99)[0])
    _step(ref, x, y)  # warm-up: torch rebuilds its buckets at the next forward
    ref.zero_grad(set_to_none=True)
    return ours, ref, base


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _n_different(a, b) -> int:
    return sum(int((x != y).sum()) for x, y in zip(a, b))


# ---------------------------------------------------------------------------- why bit-equality needs torch's details


def _division_order():
    ours, ref, _ = _models()
    x, y = _shard(_global_batches(1)[0])
    _step(ours, x, y)
    _step(ref, x, y)
    pre = _n_different(_grads(ours), _grads(ref.module))
    # Same buckets, but the sum first and the division after: world_size=1 makes the copy-in a plain copy.
    ours.zero_grad(set_to_none=True)
    ours.world_size = 1
    _step(ours, x, y)
    post = [g / dist.get_world_size() for g in _grads(ours)]
    return pre, _n_different(post, _grads(ref.module))


def test_pre_division_is_what_makes_three_ranks_bit_equal():
    pre, post = launch(_division_order, 3, timeout=60)[0]
    # bit-equal: torch's buckets, layout, g·(1/W) and gloo all-reduce are the same float ops in the same order
    assert pre == 0, f"at W=3, {pre} gradient elements differ from torch DDP with pre-division g·(1/W)"
    assert post > 0, (
        "dividing after the sum should differ from torch at W=3 (Σ g·(1/3) and (Σ g)/3 round differently); "
        "if it does not, torch changed how it averages and the docstring of course_lib/parallel/data/ddp.py is out of date"
    )


def _layout_sensitivity():
    # host: drawn with a CPU generator (the same numbers on any machine), then moved to the rank's device
    x = torch.randn(1000, generator=torch.Generator().manual_seed(dist.get_rank())).to(device())
    whole, parts = x.clone(), x.clone()
    dist.all_reduce(whole)
    for part in parts.split(300):  # the same numbers, all-reduced as four buffers instead of one
        dist.all_reduce(part)
    return int((whole != parts).sum())


def test_four_rank_sums_depend_on_the_bucket_layout():
    n = launch(_layout_sensitivity, 4, timeout=60)[0]
    assert n > 0, (
        "a 4-rank gloo all-reduce should add the ranks' values in an order that depends on an element's "
        "position in the buffer; if it no longer does, bit-equality with torch DDP no longer needs torch's layout"
    )


# ---------------------------------------------------------------------------- the mechanisms


def _different_init():
    torch.manual_seed(dist.get_rank())  # every rank draws a different model
    model = DistributedDataParallel(Transformer(configs.get("tiny")).to(device()))
    flat = torch.cat([t.flatten() for t in [*model.parameters(), *model.buffers()]])
    torch.manual_seed(0)
    rank0 = torch.cat([t.flatten() for t in [*Transformer(configs.get("tiny")).parameters()]])
    return flat, rank0


def test_construction_broadcasts_rank0_state():
    # That every rank holds the same state is lab 02's check_broadcast (tests/grading/test_lab_checks.py);
    # here: that the common state is the one rank 0 drew, not another rank's.
    results = launch(_different_init, 2, timeout=60)
    n = results[0][1].numel()
    for rank, (flat, _) in enumerate(results):  # bit-equal: a broadcast copies, it computes nothing
        assert torch.equal(flat[:n], results[0][1]), f"rank {rank} should hold the parameters rank 0 drew"


# ---------------------------------------------------------------------------- single-process reference

# DDP on W shards computes (1/W)·Σ_r ∇L_r, single-process training ∇L of the whole batch: the same
# number, summed in a different order (per-shard sums, then across ranks), so equal only up to fp32
# rounding, a few eps of the largest gradient (~0.16): measured ≤ 9e-8 ≈ 5·eps·0.16 (3.7e-8 on AVX2 and
# with ATEN_CPU_CAPABILITY=default, at 1 and 2 threads). GRAD_ATOL = 1e-6 ≈ 50·eps·0.16 leaves 10x for
# other kernels, while a wrong average (1/W missing or applied twice) errs by ~0.16/2 = 0.08.
# Parameters after 3 SGD steps (lr 0.1): each step adds at most lr·GRAD_ATOL = 1e-7 from the gradient,
# plus one rounding of p - lr·g, whose two results can land 1 ulp apart, ≤ eps·|p| = 1.2e-7 at the norm
# weights (|p| ≈ 1): 3 × (1e-7 + 1.2e-7) ≈ 6.6e-7 < PARAM_ATOL = 1e-6 (measured ≤ 1.1e-8).
# The optimizer is SGD on purpose: AdamW's update g/√v has size ~lr however small g is, so it
# turns a 1e-8 rounding difference in a near-zero gradient into a 1e-5 parameter difference
# after one step (measured 2.7e-5) — a property of Adam, not of data parallelism.
GRAD_ATOL, PARAM_ATOL = 1e-6, 1e-6


def _against_single_process(steps: int):
    ours, _, base = _models()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, base)]
    worst_grad = 0.0
    for x, y in _global_batches(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        _step(ours, *_shard((x, y)))
        _step(base, x.to(device()), y.to(device()))  # the whole global batch on one process
        worst_grad = max(worst_grad, max(float((a - b).abs().max()) for a, b in zip(_grads(ours), _grads(base))))
        for opt in opts:
            opt.step()
    worst_param = max(float((a - b).detach().abs().max()) for a, b in zip(ours.parameters(), base.parameters()))
    return worst_grad, worst_param


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_equals_single_process_training_on_the_global_batch(world):
    for rank, (grad, param) in enumerate(launch(_against_single_process, world, 3, timeout=60)):
        assert grad < GRAD_ATOL, (
            f"rank {rank}: DDP gradients differ from single-process training by {grad:.2e} (> {GRAD_ATOL}); "
            "only summation order should separate them: is each shard's loss a mean and the average 1/W?"
        )
        assert param < PARAM_ATOL, f"rank {rank}: parameters after 3 steps differ by {param:.2e} (> {PARAM_ATOL})"


def _naive_against_bucketed():
    ours, _, base = _models()
    naive = NaiveDataParallel(copy.deepcopy(base))
    with counter.count() as c:
        for x, y in _global_batches(2):
            x, y = _shard((x, y))
            naive.zero_grad(set_to_none=True)
            _step(naive, x, y)
            naive.all_reduce_gradients()
    _step(ours, x, y)
    naive_grads = [p.grad for p in naive.parameters()]
    return c.calls("all_reduce"), len(naive_grads), _n_different(naive_grads, _grads(ours))


def test_naive_ddp_sends_one_all_reduce_per_parameter_and_averages_like_the_bucketed_one():
    calls, n_params, differ = launch(_naive_against_bucketed, 2, timeout=60)[0]
    assert calls == 2 * n_params, f"the naive DDP should all-reduce each of {n_params} parameters once per step"
    # 2 ranks: g0/2 + g1/2 has one rounding whatever the layout, so the two versions agree bit for bit
    assert differ == 0, f"{differ} gradient elements of the naive DDP differ from the bucketed DDP's"


# ---------------------------------------------------------------------------- bad input and API


@pytest.mark.parametrize("cap", [0, -1.5])
def test_bucket_size_must_be_positive(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb=.* must be > 0"):
        DistributedDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=cap)
    with pytest.raises(ValueError, match="must be > 0"):
        assign_buckets([4, 4], cap)


def test_global_batch_must_split_evenly():
    with pytest.raises(ValueError, match="10 rows does not split evenly over 4 .* e.g. 8 or 12"):
        split_batch(torch.zeros(10, 3), 0, 4)
    assert torch.equal(split_batch(torch.arange(8), 1, 4), torch.tensor([2, 3]))


class _Unused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.used(x)


def _unused_parameter():
    model = DistributedDataParallel(_Unused().to(device()))
    try:
        model(torch.ones(1, 2, device=device())).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_parameter_without_gradient_is_a_clear_error():
    message = launch(_unused_parameter, 1, timeout=60)[0]
    assert "2 parameters got no gradient (unused.bias, unused.weight)" in message, message


def test_trace_step_gives_a_timeline_per_rank():
    timeline = trace_step(world_size=2)
    assert len(timeline["spans"]) == 2 and len(timeline["buckets"]) == 5
    for spans in timeline["spans"]:
        names = [s.name for s in spans]
        assert {"forward", "backward", "ddp.wait", "optimizer"} <= set(names)
        reduces = [s for s in spans if s.name == "all_reduce"]
        assert [s.meta["bucket"] for s in reduces] == [0, 1, 2, 3, 4], "one all-reduce per bucket, in bucket order"
        assert all(s.start <= s.meta["done"] for s in reduces), "an all-reduce completes after it was launched"
        assert all(s.start >= timeline["origin"] for s in spans)


def test_lab02_runs_under_accelerate_launch(accelerate_launch):
    out = accelerate_launch("solutions/lab02_ddp/run.py", "--steps", 2, "--batch", 8, num_processes=2, timeout=120)
    assert "2 ranks, backend gloo; 5 buckets" in out.stdout
    assert "step 2: loss" in out.stdout and "all-reduces 5 (427264 B) for 5 buckets; 1 of 2" in out.stdout
    assert "replicas identical after 2 steps: True" in out.stdout
