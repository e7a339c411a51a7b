"""Ring attention (course_lib.parallel.context.ring_attention) against full causal attention, forward and backward.

The checks of lab 06 (course_lib/grading/labs/lab06_sequence_parallel.py) run on course_lib's
own ring attention and Ulysses in tests/grading/test_lab_checks.py: merge, forward and backward at N = 2 and 4, bytes sent, zigzag
balance. The tests below add what the lab does not ask for: the contiguous layout, a mesh's cp
groups, the block count per rank, bf16, the memory model and the lab's entry point.

Tolerance. Everything is fp32. The ring computes each query row's softmax in pieces, one K/V
block at a time, and merges them by log-sum-exp; torch's scaled_dot_product_attention sums the
same terms in another order (its own tiles). Reordering a sum of fp32 numbers of size ~1 changes
it by a few units of 2^-24 ≈ 6e-8 per term; measured differences are ~1e-6. 1e-5 (absolute and
relative) leaves a tenfold margin, while a real mistake — a block skipped, merged twice, masked on
the wrong side — moves outputs and gradients by 1e-2 or more.
"""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.cost import activations as cost_activations
from course_lib.cost import collective_bytes
from course_lib.dist import Mesh, counter, device, launch
from course_lib.grading.labs import lab06_sequence_parallel as lab06
from course_lib.parallel.context import ring_attention as ra
from course_lib.parallel.context import ulysses

TOL = lab06.TOL  # n·eps for a reordered fp32 sum of n ≤ 64 terms: see lab06.TOL
B, H, HKV, D = 2, 4, 2, 8  # grouped-query: two query heads per K/V head


def _inputs(seq_len, h=H, hkv=HKV):
    """q, k, v and a random output weight w (the loss is sum(out * w)): the lab's inputs."""
    return lab06.inputs(seq_len, h, hkv)


def _reference(seq_len):
    """Full causal attention over the whole sequence, output and gradients: the lab's reference."""
    return lab06.reference(seq_len)


def _ring_rank(seq_len, layout, use_mesh=False):
    group, rank, world = None, dist.get_rank(), dist.get_world_size()
    if use_mesh:  # two context-parallel groups side by side: ranks {0,1} and {2,3}
        mesh = Mesh(dp=2, cp=world // 2)
        group, rank, world = mesh.group("cp"), mesh.rank("cp"), mesh.size("cp")
    q, k, v, w = (ra.shard(t, rank, world, layout) for t in _inputs(seq_len))
    q, k, v = (t.to(device()).requires_grad_() for t in (q, k, v))
    w, stats = w.to(device()), {}
    with counter.count() as fwd:
        out = ra.ring_attention(q, k, v, group=group, layout=layout, stats=stats)
    with counter.count() as bwd:
        (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, stats, fwd.as_dict(), bwd.as_dict()


def _compare(results, layout, world, what):
    names = ("output", "dL/dq", "dL/dk", "dL/dv")
    for i, (name, want) in enumerate(zip(names, _reference(results[0][0].shape[-2] * world))):
        got = ra.unshard([r[i] for r in results], layout)
        err = (got - want).abs().max().item()
        assert torch.allclose(got, want, **TOL), (
            f"{what}: the {name} gathered from {world} ranks differs from full causal attention by {err:.2e} "
            f"(allowed 1e-5): look at which query rows meet which K/V rows at each step, and at the merge"
        )


# ------------------------------------------------------------------------ single-process pieces


def test_a_causal_block_is_causal_attention():
    q, k, v, _ = _inputs(16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(ra.block_attention(q, k, v, causal=True)[0], ref, **TOL), "a causal block is causal attention"


def test_block_backward_equals_autograd():
    q, k, v, w = _inputs(12)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ra.block_attention(q, k, v, causal=True)
    (out * w).sum().backward()
    mine = ra.block_attention_backward(w, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), causal=True)
    for name, got, want in zip("qkv", mine, (q.grad, k.grad, v.grad)):
        assert torch.allclose(got, want, **TOL), f"the FlashAttention-2 formulas for d{name} must equal autograd's"


def test_zigzag_layout_gives_each_rank_one_early_and_one_late_chunk():
    assert ra.positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert ra.positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    x = torch.arange(2 * 24 * 3.0).view(2, 24, 3)
    for layout in ra.LAYOUTS:
        shards = [ra.shard(x, r, 4, layout, dim=1) for r in range(4)]
        assert torch.equal(ra.unshard(shards, layout, dim=1), x), f"unshard must invert shard ({layout})"


def test_divisibility_errors_name_the_constraint():
    with pytest.raises(
        ValueError, match=r"sequence length 12 is not divisible by 8 = 2 x the context-parallel degree 4"
    ):
        ra.shard(torch.zeros(1, 1, 12, 4), 0, 4)
    q = torch.zeros(1, 2, 5, 4)
    with pytest.raises(ValueError, match="odd number.*divisible by 2 x the degree"):
        ra.ring_attention(q, q, q)
    with pytest.raises(ValueError, match="not a multiple of 3 key/value heads"):
        ra.ring_attention(torch.zeros(1, 4, 4, 4), torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 4, 4))


# ---------------------------------------------------------------------------------- on N ranks


@pytest.mark.parametrize("world", [2, 4])
def test_contiguous_ring_equals_full_causal_attention_forward_and_backward(world):
    for layout in ("contiguous",):  # zigzag: lab06.check_ring_forward / check_ring_backward
        results = launch(_ring_rank, world, 16 * world, layout, timeout=60)
        _compare(results, layout, world, f"ring attention ({layout}, N={world})")


def test_ring_attention_on_the_cp_groups_of_a_mesh():
    results = launch(_ring_rank, 4, 32, "zigzag", True, timeout=60)
    for pair in (results[:2], results[2:]):  # each cp group computed the whole sequence by itself
        _compare(pair, "zigzag", 2, "ring attention on Mesh(dp=2, cp=2)")
    assert all("isend@cp" in r[5] for r in results), "the ring must run on the cp group it was given"


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_gives_every_rank_the_same_work_and_contiguous_does_not(world):
    s = 16 * world
    zig = [r[4] for r in launch(_ring_rank, world, s, "zigzag", timeout=60)]
    assert [z["blocks"] for z in zig] == [2 * world + 1] * world, (
        f"with the head-tail layout each rank must compute 2 diagonal + (2N-1) full chunk pairs = {2 * world + 1}; "
        f"got {[z['blocks'] for z in zig]}: skip the pairs the causal mask hides entirely"
    )
    assert len({z["scores"] for z in zig}) == 1, f"unmasked scores per rank must be equal: {[z['scores'] for z in zig]}"
    assert sum(z["scores"] for z in zig) == s * (s + 1) // 2, "together the ranks compute each unmasked score once"
    contiguous = [r[4]["blocks"] for r in launch(_ring_rank, world, s, "contiguous", timeout=60)]
    assert contiguous == [4 * r + 3 for r in range(world)], (
        f"contiguous shards: rank r sees r earlier blocks (4 chunk pairs each) + its diagonal (3), got {contiguous}"
    )


def test_ring_bytes_formula_counts_n_minus_1_hops_of_a_kv_block():
    world, s = 4, 64
    want = collective_bytes.ring_comm_bytes(B, s, HKV, D, world)  # measured against the counter by lab06's checks
    block = B * HKV * (s // world) * D * 4
    assert want["forward_bytes"] == 2 * (world - 1) * block and want["forward_sends"] == 2 * (world - 1)


def _bf16_rank(seq_len):
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, w = (ra.shard(t, rank, world).bfloat16().to(device()) for t in _inputs(seq_len))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ra.ring_attention(q, k, v)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def test_bf16_ring_is_as_accurate_as_torchs_bf16_kernel():
    """The merge runs in fp32: in bf16 the ring must be no less accurate than torch's own bf16 attention."""
    s = 64
    q, k, v, w = (t.bfloat16() for t in _inputs(s))

    def full(dtype):
        qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        (out * w.to(dtype)).sum().backward()
        return [t.float() for t in (out.detach(), qq.grad, kk.grad, vv.grad)]

    exact, torch_bf16 = full(torch.float32), full(torch.bfloat16)
    results = launch(_bf16_rank, 2, s, timeout=60)
    for i, name in enumerate(("output", "dq", "dk", "dv")):
        ring = ra.unshard([r[i] for r in results]).float()
        assert results[0][i].dtype == torch.bfloat16, f"the ring must return {name} in the input dtype"
        ring_err, torch_err = ((x - exact[i]).abs().max().item() for x in (ring, torch_bf16[i]))
        assert ring_err <= 1.01 * torch_err + 1e-6, (
            f"bf16 ring {name} is off by {ring_err:.2e} from fp32 attention, torch's bf16 kernel by {torch_err:.2e}: "
            f"keep the block results, the merge and the dK/dV accumulators in fp32"
        )


# ------------------------------------------------------------------------- memory model vs measured


def _saved_bytes(fn):
    """Bytes autograd keeps for the backward while ``fn`` runs (each storage counted once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _saved_rank(seq_len, method, h, hkv):
    rank, world = dist.get_rank(), dist.get_world_size()
    split = (lambda t: ulysses.split(t, rank, world)) if method == "ulysses" else (lambda t: ra.shard(t, rank, world))
    q, k, v, _ = (split(t).contiguous().to(device()).requires_grad_() for t in _inputs(seq_len, h, hkv))
    attend = ulysses.ulysses_attention if method == "ulysses" else ra.ring_attention
    return _saved_bytes(lambda: attend(q, k, v))


@pytest.mark.parametrize("world", [2, 4])
def test_memory_model_matches_what_autograd_saves(world):
    s, h, hkv = 32, 8, 4  # Ulysses at N = 4 needs 4 | h_kv
    q, k, v, _ = (t.requires_grad_() for t in _inputs(s, h, hkv))
    measured = {"none": _saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))}
    model = {"none": cost_activations.attention_memory_per_rank(s, h, hkv, D, 1, "none", B)["saved"]}
    for method in ("ulysses", "ring"):
        per_rank = launch(_saved_rank, world, s, method, h, hkv, timeout=60)
        assert len(set(per_rank)) == 1, f"{method}: every rank should keep the same bytes, got {per_rank}"
        measured[method] = per_rank[0]
        model[method] = cost_activations.attention_memory_per_rank(s, h, hkv, D, world, method, B)["saved"]
    assert measured == model, f"bytes saved for backward per rank: measured {measured}, model {model}"


# ---------------------------------------------------------------------------- the lab's entry point


def test_lab06_run_py_under_accelerate_launch_at_2_ranks(accelerate_launch):
    out = accelerate_launch("solutions/lab06_sequence_parallel/run.py", "--seq-len", 32, num_processes=2, timeout=120)
    sent = re.search(r"ring forward: rank 0 sent (\d+) B; K and V, N-1 hops each: (\d+) B", out.stdout)
    assert sent and sent[1] == sent[2], f"run.py must report the ring's bytes equal to the formula:\n{out.stdout}"
    each = 32 * 33 // 2 // 2  # s(s+1)/2 unmasked scores, halved between the 2 ranks
    assert f"unmasked scores computed per rank (zigzag): [{each}, {each}]" in out.stdout, out.stdout
    assert "ulysses: max |difference|" in out.stdout, "the reference solution implements the extra credit too"
