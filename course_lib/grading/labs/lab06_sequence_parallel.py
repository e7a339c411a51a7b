"""Grader of lab 06: ring attention (and Ulysses, extra credit) against full causal attention.

Graded: the log-sum-exp merge (single process); the ring's output and its gradients equal
torch's scaled_dot_product_attention on the whole sequence at N = 2 and 4 (tolerances derived
below); that only point-to-point messages are used and that each rank
sends what the ring's formulas say (forward: K and V, N-1 hops; backward: K and V N-1 hops, dK and
dV N hops); and the zigzag load balance: the grader counts the scores each rank hands to
``block_attention``, which must be equal on every rank and cover each unmasked score once.
Ulysses (extra credit) must be bit-equal on CPU: its all-to-alls only move data.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``sequence_parallel.py``, tests/grading/test_lab_checks.py passes course_lib's own
ring attention and Ulysses.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.cost.collective_bytes import ring_comm_bytes, ulysses_comm_bytes
from course_lib.dist import counter, device, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task
from course_lib.grading.labs._lab06_timeline import _Timeline
from course_lib.parallel.context.ring_attention import block_attention, block_attention_backward, shard, unshard

ROLES = ("merge_partials", "ring_attention", "ulysses_attention")


def adapter(lab_dir: Path) -> Adapter:
    """The learner's functions, from ``sequence_parallel.py``."""
    return Adapter.of_file(Path(lab_dir) / "sequence_parallel.py", ROLES)


WORLDS = (2, 4)
B, H, HKV, D = 2, 4, 2, 8
EPS = torch.finfo(torch.float32).eps  # 2^-23 ≈ 1.19e-7
# Ring attention against torch's kernel: both sum the same fp32 terms in another order. Reordering a
# sum of n terms of magnitude ≤ 1 moves it by at most n·eps (Higham, "Accuracy and Stability of
# Numerical Algorithms", §4.2); with at most n = 64 keys per row here that is 64 × 1.19e-7 ≈ 7.6e-6,
# so 1e-5 bounds it on any CPU, while a real mistake (a block skipped, merged twice, masked on the
# wrong side) moves outputs and gradients by 1e-2 or more.
TOL = dict(atol=1e-5, rtol=1e-5)


def merge_tolerance(logits: torch.Tensor) -> float:
    """The error bound of a log-sum-exp merge at logits of magnitude L = max |logit|.

    A log-sum-exp near L carries an absolute rounding error of about eps·L, and the merge weights
    e^(l_a - l) inherit it as a relative error, so outputs and lse agree to a few eps·L (measured:
    5e-5 at L ≈ 1e3 on an AVX2 CPU). 8·eps·max(1, L) bounds that on every CPU and thread count; a
    wrong merge errs by the size of the values themselves, O(1).
    """
    return 8 * EPS * max(1.0, logits.abs().max().item())


P2P = {"isend", "irecv", "send", "recv"}


def inputs(seq_len, h=H, hkv=HKV):
    """q, k, v and the upstream gradient w, drawn on the host: the grader's reference uses them there, and
    each rank moves its shard to its device (so every machine grades the same numbers)."""
    g = torch.Generator().manual_seed(6)  # host: the same draw on every machine
    return [torch.randn(B, n, seq_len, D, generator=g) for n in (h, hkv, hkv, h)]  # host: drawn with g


def reference(seq_len, h=H, hkv=HKV):
    q, k, v, w = inputs(seq_len, h, hkv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _ops(c) -> set[str]:
    return {key.split("@")[0] for key in c.as_dict()}


def _sent(c) -> dict:
    return {"calls": c.calls("isend") + c.calls("send"), "bytes": c.bytes("isend") + c.bytes("send")}


def _ring_rank(impl: Adapter, seq_len: int, backward: bool):
    work = []
    timeline = _Timeline()

    def counting(q, k, v, causal):  # the unmasked scores (per batch row and head) this rank computes
        m, n = q.shape[-2], k.shape[-2]
        work.append(m * (m + 1) // 2 if causal else m * n)
        return block_attention(q, k, v, causal)

    module = impl.module("ring_attention")  # this rank's process only
    module.block_attention = timeline.compute(counting)
    module.block_attention_backward = timeline.compute(block_attention_backward)
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, w = (shard(t, rank, world).to(device()) for t in inputs(seq_len))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    timeline.events.append(("phase", "forward"))
    with counter.count() as fwd:
        out = impl["ring_attention"](q, k, v)
    grads, bwd = (None, None, None), None
    if backward:
        timeline.events.append(("phase", "backward"))
        with counter.count() as bwd:
            (out * w).sum().backward()
        grads = (q.grad, k.grad, v.grad)
    fwd_sent, bwd_sent = _sent(fwd), (_sent(bwd) if backward else None)
    overlap = {"forward": timeline.overlap("forward")} | (
        {"backward": timeline.overlap("backward")} if backward else {}
    )
    return (
        out.detach(),
        *grads,
        sum(work),
        fwd_sent,
        _ops(fwd),
        bwd_sent,
        _ops(bwd) if backward else set(),
        overlap,
    )


def _check_close(results, indices, what, unshard_fn, reference, exact=False):
    names = ("output", "dL/dq", "dL/dk", "dL/dv")
    for i in indices:
        for rank, r in enumerate(results):
            assert r[i] is not None, f"{what}: rank {rank} has no {names[i]} (did the forward/backward return it?)"
        got, want = unshard_fn([r[i] for r in results]), reference[i]
        assert got.shape == want.shape, (
            f"{what}: the gathered {names[i]} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        )
        ok = torch.equal(got, want) if exact else torch.allclose(got, want, **TOL)
        assert ok, (
            f"{what}: the {names[i]} differs from full causal attention by {(got - want).abs().max().item():.2e} "
            f"(allowed {'0: bit-equal' if exact else '1e-5'}): check which query rows meet which keys at each step"
        )


# -------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("merge_partials")
    for fn in (
        "merge_partials",
        "ring_attention_forward",
        "ring_attention_backward",
        "ring_attention",
        "seq_to_heads",
        "heads_to_seq",
        "ulysses_attention",
    ):
        assert callable(getattr(module, fn, None)), f"sequence_parallel.py must define {fn}()"


def check_merge(impl: Adapter) -> None:
    q, k, v, _ = inputs(16)
    for scale in (1.0, 300.0):  # 300: logits ~1e3, where e^lse overflows fp32
        tol = merge_tolerance(q * scale @ k.repeat_interleave(H // HKV, dim=1).transpose(-1, -2) / D**0.5)
        whole, whole_lse = block_attention(q * scale, k, v, causal=False)
        a = block_attention(q * scale, k[..., :7, :], v[..., :7, :], causal=False)
        b = block_attention(q * scale, k[..., 7:, :], v[..., 7:, :], causal=False)
        out, lse = impl["merge_partials"](*a, *b)
        assert torch.isfinite(out).all(), (
            f"merge_partials overflowed with logits ~{scale:g}: use lse differences, not e^lse"
        )
        assert torch.allclose(out, whole, atol=tol, rtol=tol) and torch.allclose(lse, whole_lse, atol=tol, rtol=tol), (
            f"merge_partials of two key halves must equal attention over all keys (out and lse) within {tol:.1e}"
        )
    out, lse = block_attention(q, k, v, causal=False)
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    merged = impl["merge_partials"](*empty, out, lse)
    assert torch.equal(merged[0], out) and torch.equal(merged[1], lse), (
        "merging into an empty row (lse = -inf) must be exact"
    )


def check_ring_forward(impl: Adapter) -> None:
    for world in WORLDS:
        s = 16 * world
        results = launch(_ring_rank, world, impl, s, False, timeout=30)
        _check_close(results, [0], f"ring forward (N={world})", unshard, reference(s))
        for rank, r in enumerate(results):
            assert r[6] <= P2P, (
                f"ring forward on rank {rank} called {sorted(r[6] - P2P)}: pass K/V with isend/irecv only"
            )


def _check_sent(impl: Adapter, backward: bool) -> None:
    phase, index = ("backward", 7) if backward else ("forward", 5)
    hops = "K, V make N-1 hops and dK, dV make N" if backward else "K and V each make N-1 hops"
    for world in WORLDS:
        s = 16 * world
        want = ring_comm_bytes(B, s, HKV, D, world)
        expected = {"calls": want[f"{phase}_sends"], "bytes": want[f"{phase}_bytes"]}
        for rank, r in enumerate(launch(_ring_rank, world, impl, s, backward, timeout=30)):
            assert r[index] == expected, (
                f"ring {phase} at N={world}, rank {rank}: sent {r[index]}; {hops}: "
                f"{expected['calls']} sends, {expected['bytes']} bytes"
            )


def check_ring_forward_bytes(impl: Adapter) -> None:
    _check_sent(impl, backward=False)


def check_ring_balance(impl: Adapter) -> None:
    for world in WORLDS:
        s = 16 * world
        work = [r[4] for r in launch(_ring_rank, world, impl, s, False, timeout=30)]
        assert len(set(work)) == 1 and sum(work) == s * (s + 1) // 2, (
            f"zigzag at N={world}: each rank must compute the same number of unmasked scores, {s * (s + 1) // 2 // world}, "
            f"and skip masked blocks; block_attention was handed {work} per rank"
        )


def check_ring_backward(impl: Adapter) -> None:
    for world in WORLDS:
        s = 16 * world
        results = launch(_ring_rank, world, impl, s, True, timeout=30)
        _check_close(results, [1, 2, 3], f"ring backward (N={world})", unshard, reference(s))
        for rank, r in enumerate(results):
            assert r[8] <= P2P, f"ring backward on rank {rank} called {sorted(r[8] - P2P)}: use isend/irecv only"


def check_ring_backward_bytes(impl: Adapter) -> None:
    _check_sent(impl, backward=True)


OVERLAP_WORLD = 4  # three K/V hops: every one of them must travel while a block is computed


def check_ring_forward_overlap(impl: Adapter) -> None:
    s = 16 * OVERLAP_WORLD
    for rank, r in enumerate(launch(_ring_rank, OVERLAP_WORLD, impl, s, False, timeout=30)):
        posted, hidden = r[9]["forward"]
        assert posted and hidden == posted, (
            f"ring forward at N={OVERLAP_WORLD}, rank {rank}: {posted - hidden} of its {posted} receives completed "
            "(wait() returned, or a blocking recv) with no block_attention since they were posted: post the exchange "
            "of the next K/V block, compute on the block you hold, then wait"
        )


def check_ring_backward_overlap(impl: Adapter) -> None:
    s, want = 16 * OVERLAP_WORLD, 2 * (OVERLAP_WORLD - 1)
    for rank, r in enumerate(launch(_ring_rank, OVERLAP_WORLD, impl, s, True, timeout=30)):
        posted, hidden = r[9]["backward"]
        assert hidden >= want, (
            f"ring backward at N={OVERLAP_WORLD}, rank {rank}: {hidden} of its {posted} receives had a "
            f"block_attention_backward between posting and completion; the {want} K/V receives must: post the next "
            "K/V exchange before computing on the block you hold, wait after (dK/dV can only leave once computed)"
        )


def _ulysses_rank(impl: Adapter, seq_len: int, h: int, hkv: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, w = (t.chunk(world, dim=-2)[rank].contiguous().to(device()) for t in inputs(seq_len, h, hkv))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with counter.count() as c:
        out = impl["ulysses_attention"](q, k, v)
        (out * w).sum().backward()
    calls, nbytes = c.calls("all_to_all_single"), c.bytes("all_to_all_single")
    return out.detach(), q.grad, k.grad, v.grad, calls, nbytes, _ops(c), q.device.type


def check_ulysses(impl: Adapter) -> None:
    for world in WORLDS:
        s, h, hkv = 8 * world, 8, 4
        results = launch(_ulysses_rank, world, impl, s, h, hkv, timeout=30)
        exact = all(r[7] == "cpu" for r in results)  # GPU backward kernels may add in any order
        _check_close(
            results,
            [0, 1, 2, 3],
            f"Ulysses (N={world})",
            lambda xs: torch.cat(xs, dim=-2),
            reference(s, h, hkv),
            exact,
        )
        want = ulysses_comm_bytes(B, s, h, hkv, D, world)
        for rank, r in enumerate(results):
            assert r[6] == {"all_to_all_single"}, (
                f"Ulysses on rank {rank} used {sorted(r[6])}: one all_to_all_single per tensor"
            )
            assert (r[4], r[5]) == (8, 2 * want["payload_per_rank"]), (
                f"Ulysses at N={world}, rank {rank}: {r[4]} all-to-alls of {r[5]} bytes; expected 4 forward + 4 backward "
                f"carrying 2 x {want['payload_per_rank']} bytes"
            )


NEEDS_FORWARD = (check_merge, check_ring_forward)  # the backward starts from the forward's out and lse
TASKS = [
    Task("sequence_parallel.py imports and defines the functions", 1, check_setup, setup=True),
    Task("Task 1: log-sum-exp merge of partial attentions", 2, check_merge),
    Task("Task 2: ring forward equals full causal attention", 3, check_ring_forward, needs=(check_merge,)),
    Task("Task 2: forward sends N-1 K/V blocks", 1, check_ring_forward_bytes, needs=(check_merge,)),
    Task("Task 2: zigzag balances the work", 1, check_ring_balance, needs=(check_merge,)),
    Task(
        "Task 2: the next K/V block travels while one is computed", 1, check_ring_forward_overlap, needs=(check_merge,)
    ),
    Task("Task 3: ring backward equals full causal attention's gradients", 3, check_ring_backward, needs=NEEDS_FORWARD),
    Task("Task 3: backward sends the formula's bytes", 1, check_ring_backward_bytes, needs=NEEDS_FORWARD),
    Task(
        "Task 3: backward K/V blocks travel while one is computed", 1, check_ring_backward_overlap, needs=NEEDS_FORWARD
    ),
    Task("Task 4 (extra credit): Ulysses equals full causal attention", 3, check_ulysses),
]
