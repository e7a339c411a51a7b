"""course_lib.parallel.data.ddp against torch's DistributedDataParallel and against single-process training.

Bit-equality with torch DDP needs the same buckets, the same layout inside each bucket and the
same pre-division by W (see the module docstring of course_lib/parallel/data/ddp.py). Torch DDP spends its
first iteration with a single bucket holding every gradient (it does not yet know the order in
which gradients arrive) and rebuilds its buckets, in arrival order, at the next forward. So the
torch reference takes one warm-up backward before the comparison starts; from then on its
buckets are ours (``test_bucket_layout_is_torchs`` checks that).
"""

import copy
import functools
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course_lib import data
from course_lib.dist import counter, launch, trace
from course_lib.measure.ddp import trace_step
from course_lib.model import config as configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.data.ddp import DistributedDataParallel, assign_buckets, split_batch

ROOT = Path(__file__).resolve().parent.parent
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
    return tuple(split_batch(t, r, w) for t in batch)


def _step(model, x, y):
    next_token_loss(model(x), y).backward()


def _models(cap_mb=CAP_MB, seed=0):
    """(ours, torch DDP, plain copy) from one initial model; torch DDP already past its warm-up."""
    torch.manual_seed(seed)
    base = Transformer(configs.get("tiny"))
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


# ---------------------------------------------------------------------------- against torch DDP


def _against_torch(steps: int):
    """Alternate plain steps and 2-micro-batch accumulation steps; AdamW after each."""
    ours, ref, _ = _models()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, ref)]
    batches = _global_batches(2 * steps)
    grad_diffs = []
    for step in range(steps):
        accumulate = step % 2 == 1
        micro = [_shard(b) for b in batches[2 * step : 2 * step + (2 if accumulate else 1)]]
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad(set_to_none=True)
            if accumulate:
                with model.no_sync():
                    _step(model, *micro[0])
            _step(model, *micro[-1])
        grad_diffs.append(("accumulation" if accumulate else "plain", _n_different(_grads(ours), _grads(ref.module))))
        for opt in opts:
            opt.step()
    param_diff = _n_different(list(ours.parameters()), list(ref.module.parameters()))
    return grad_diffs, param_diff, len(ours.buckets)


@pytest.mark.parametrize("world", [2, 4])
def test_gradients_and_parameters_bit_equal_torch_ddp(world):
    for rank, (grad_diffs, param_diff, n_buckets) in enumerate(launch(_against_torch, world, 4, timeout=60)):
        assert n_buckets == 5, "the tiny model should span 5 buckets at 0.05 MiB, so bucketing is exercised"
        for step, (kind, n) in enumerate(grad_diffs):
            assert n == 0, (
                f"rank {rank}, step {step} ({kind}): {n} gradient elements differ from torch DDP. The DDP "
                "gradients should equal torch DDP exactly: same buckets in reverse registration order, the "
                "same layout inside each bucket, grad·(1/W) copied in, then SUM"
            )
        assert param_diff == 0, (
            f"rank {rank}: after 4 AdamW steps {param_diff} parameter elements differ from torch DDP"
        )


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
    assert pre == 0, f"at W=3, {pre} gradient elements differ from torch DDP with pre-division g·(1/W)"
    assert post > 0, (
        "dividing after the sum should differ from torch at W=3 (Σ g·(1/3) and (Σ g)/3 round differently); "
        "if it does not, torch changed how it averages and the docstring of course_lib/parallel/data/ddp.py is out of date"
    )


def _layout_sensitivity():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(dist.get_rank()))
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


def _layouts():
    ours, ref, _ = _models()
    _step(ref, *_shard(_global_batches(1)[0]))  # the forward of this step rebuilds torch's buckets
    names = {id(p): n for n, p in ref.module.named_parameters()}
    torch_buckets = [[names[id(p)] for p in b.parameters()] for b in ref.reducer._get_zeros_like_grad_buckets()]
    return ours.bucket_names(), torch_buckets


def test_bucket_layout_is_torchs():
    ours, theirs = launch(_layouts, 2, timeout=60)[0]
    assert ours[0][0] == "output.weight" and ours[-1][-1] == "tok_embeddings.weight", (
        "buckets go in reverse registration order: the output layer's gradient is ready first, the embedding's last"
    )
    assert ours == theirs, f"our buckets {ours} should be torch DDP's rebuilt buckets {theirs}"


@pytest.mark.parametrize("cap", [1, 100, 1000, 5000])
def test_bucket_assignment_follows_torchs_rule(cap):
    g = torch.Generator().manual_seed(cap)
    tensors = [torch.empty(int(n)) for n in torch.randint(1, 400, (40,), generator=g)]
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, [cap], [], list(range(len(tensors))))
    got = assign_buckets([t.numel() * t.element_size() for t in tensors], cap)
    assert got == [list(b) for b in expected], f"cap {cap} B: buckets {got} differ from torch's {expected}"


# ---------------------------------------------------------------------------- the mechanisms


def _different_init():
    torch.manual_seed(dist.get_rank())  # every rank draws a different model
    model = DistributedDataParallel(Transformer(configs.get("tiny")))
    flat = torch.cat([t.flatten() for t in [*model.parameters(), *model.buffers()]])
    torch.manual_seed(0)
    rank0 = torch.cat([t.flatten() for t in [*Transformer(configs.get("tiny")).parameters()]])
    return flat, rank0


def test_construction_broadcasts_rank0_state():
    results = launch(_different_init, 2, timeout=60)
    for rank, (flat, _) in enumerate(results):
        assert torch.equal(flat, results[0][0]), (
            f"rank {rank} should hold rank 0's parameters and buffers after wrapping"
        )
    n = results[0][1].numel()
    assert torch.equal(results[1][0][:n], results[0][1]), "the common state should be the one rank 0 drew"


def _overlap():
    torch.manual_seed(0)
    module = Transformer(configs.get("tiny"))
    arrived = []  # registered before DDP's hooks, so each fires as its gradient arrives, before DDP sees it
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: arrived.append(trace.now()))
    ours = DistributedDataParallel(module, bucket_cap_mb=CAP_MB)
    x, y = _shard(_global_batches(1)[0])
    _step(ours, x, y)  # warm-up
    ours.zero_grad(set_to_none=True)
    with trace.record() as tl:
        arrived.clear()
        with trace.span("forward"):
            loss = next_token_loss(ours(x), y)
        with trace.span("backward"):
            loss.backward()
    return tl.spans, max(arrived), len(ours.buckets)


def test_all_reduce_overlaps_backward_in_the_trace():
    for rank, (spans, last_grad, n_buckets) in enumerate(launch(_overlap, 2, timeout=60)):
        backward = next(s for s in spans if s.name == "backward")
        reduces = [s for s in spans if s.name == "all_reduce"]
        assert len(reduces) == n_buckets, f"rank {rank}: one all-reduce per bucket, got {len(reduces)} for {n_buckets}"
        assert [s.meta["bucket"] for s in reduces] == list(range(n_buckets)), "buckets are launched in order"
        assert reduces[0].start < backward.end, "an all-reduce should start before backward ends"
        early = [s for s in reduces if s.start < last_grad]
        assert len(early) == n_buckets - 1, (
            f"rank {rank}: {len(early)} of {n_buckets} all-reduces started before the last gradient was computed; "
            f"all but the last bucket should, since each is launched from the hook that completes it"
        )
        assert all(s.end >= last_grad for s in reduces), (
            f"rank {rank}: an all-reduce was waited for before backward had computed every gradient: launch with "
            "async_op=True and wait only in finish(), or backward stalls on the network"
        )


def _no_sync_counts():
    ours, _, base = _models()
    x, y = _shard(_global_batches(1)[0])
    with counter.count() as inside:
        with ours.no_sync():
            _step(ours, x, y)
    _step(base, x, y)  # what this rank's gradient is without any communication
    local_equal = _n_different(_grads(ours), _grads(base)) == 0
    with counter.count() as outside:
        _step(ours, x, y)
    return inside.calls("all_reduce"), local_equal, outside.calls("all_reduce"), len(ours.buckets)


def test_no_sync_accumulates_locally_without_communication():
    for rank, (inside, local_equal, outside, n_buckets) in enumerate(launch(_no_sync_counts, 2, timeout=60)):
        assert inside == 0, f"rank {rank}: {inside} all-reduces inside no_sync(); it must not communicate"
        assert local_equal, f"rank {rank}: inside no_sync() the gradient should be the rank's own local gradient"
        assert outside == n_buckets, (
            f"rank {rank}: the synchronised backward should all-reduce each of the {n_buckets} buckets once"
        )


# ---------------------------------------------------------------------------- single-process reference

# DDP on W shards computes (1/W)·Σ_r ∇L_r, single-process training ∇L of the whole batch: the same
# number, summed in a different order (per-shard sums, then across ranks), so equal only up to
# float32 rounding. Measured on the tiny model (largest gradient ~0.16): gradients differ by
# <= 9e-8, parameters after 3 SGD steps (lr 0.1) by <= 1.1e-8. Bounds with ~10x headroom below.
# The optimizer is SGD on purpose: AdamW's update g/√v has size ~lr however small g is, so it
# turns a 1e-8 rounding difference in a near-zero gradient into a 1e-5 parameter difference
# after one step (measured 2.7e-5) — a property of Adam, not of data parallelism.
GRAD_ATOL, PARAM_ATOL = 1e-6, 1e-7


def _against_single_process(steps: int):
    ours, _, base = _models()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, base)]
    worst_grad = 0.0
    for x, y in _global_batches(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        _step(ours, *_shard((x, y)))
        _step(base, x, y)  # the whole global batch on one process
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
    model = DistributedDataParallel(_Unused())
    try:
        model(torch.ones(1, 2)).sum().backward()
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lab02_runs_under_accelerate_launch():
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "solutions/accelerate/cpu.yaml",
        "--num_processes",
        "2",
        "--main_process_port",
        str(_free_port()),
        "solutions/lab02_ddp/run.py",
        "--steps",
        "2",
        "--batch",
        "8",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 ranks, backend gloo; 5 buckets" in out.stdout
    assert "step 2: loss" in out.stdout and "all-reduces 5 (427264 B) for 5 buckets; 1 of 2" in out.stdout
    assert "replicas identical after 2 steps: True" in out.stdout
