"""Ring attention (course_lib.parallel.context.ring_attention) against full causal attention, forward and backward.

Tolerance. Everything is fp32. The ring computes each query row's softmax in pieces, one K/V
block at a time, and merges them by log-sum-exp; torch's scaled_dot_product_attention sums the
same terms in another order (its own tiles). Reordering a sum of fp32 numbers of size ~1 changes
it by a few units of 2^-24 ≈ 6e-8 per term; measured differences are ~1e-6. 1e-5 (absolute and
relative) leaves a tenfold margin, while a real mistake — a block skipped, merged twice, masked on
the wrong side — moves outputs and gradients by 1e-2 or more.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.cost import activations as cost_activations
from course_lib.cost import comm
from course_lib.dist import Mesh, counter, device, launch
from course_lib.parallel.context import ring_attention as ra
from course_lib.parallel.context import ulysses

TOL = dict(atol=1e-5, rtol=1e-5)
B, H, HKV, D = 2, 4, 2, 8  # grouped-query: two query heads per K/V head


def _inputs(seq_len, h=H, hkv=HKV, seed=0):
    """q, k, v and a random output weight w (the loss is sum(out * w), so dO = w is not all ones)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, seq_len, D, generator=g) for n in (h, hkv, hkv, h)]


def _reference(seq_len):
    q, k, v, w = _inputs(seq_len)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


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


def test_merge_of_two_key_halves_equals_attention_over_all_keys():
    q, k, v, _ = _inputs(16)
    whole, whole_lse = ra.block_attention(q, k, v, causal=False)
    a = ra.block_attention(q, k[..., :5, :], v[..., :5, :], causal=False)
    b = ra.block_attention(q, k[..., 5:, :], v[..., 5:, :], causal=False)
    out, lse = ra.merge_partials(*a, *b)
    assert torch.allclose(out, whole, **TOL) and torch.allclose(lse, whole_lse, **TOL), (
        "merging partial softmaxes by log-sum-exp must give attention over the union of the keys"
    )
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    assert torch.equal(ra.merge_partials(*empty, out, lse)[0], out), "merging into an empty (-inf) row must be exact"
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
def test_ring_attention_equals_full_causal_attention_forward_and_backward(world):
    for layout in ra.LAYOUTS:
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


@pytest.mark.parametrize("world", [2, 4])
def test_ring_sends_n_minus_1_kv_blocks_forward_as_the_formula_says(world):
    s = 16 * world
    results = launch(_ring_rank, world, s, "zigzag", timeout=60)
    want = comm.ring_comm_bytes(B, s, HKV, D, world)
    block = B * HKV * (s // world) * D * 4
    assert want["forward_bytes"] == 2 * (world - 1) * block
    for rank, (*_, fwd, bwd) in enumerate(results):
        assert set(fwd) == {"isend@world", "irecv@world"}, (
            f"ring attention must use point-to-point only, rank {rank} used {set(fwd)}"
        )
        assert fwd["isend@world"] == {"calls": want["forward_sends"], "bytes": want["forward_bytes"]}, (
            f"forward on rank {rank}: K and V each make N-1 = {world - 1} hops of {block} B; measured {fwd['isend@world']}"
        )
        assert bwd["isend@world"] == {"calls": want["backward_sends"], "bytes": want["backward_bytes"]}, (
            f"backward on rank {rank}: K, V make N-1 hops and dK, dV make N; measured {bwd['isend@world']}, formula {want}"
        )
        assert fwd["irecv@world"]["bytes"] == fwd["isend@world"]["bytes"], "on a ring each rank receives what it sends"


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


def test_lab06_run_py_under_accelerate_launch_at_2_ranks():
    import re
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "solutions/accelerate/cpu.yaml",
        "--num_processes",
        "2",
        "--main_process_port",
        str(port),
        "solutions/lab06_sequence_parallel/run.py",
        "--seq-len",
        "32",
    ]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    sent = re.search(r"ring forward: rank 0 sent (\d+) B; K and V, N-1 hops each: (\d+) B", out.stdout)
    assert sent and sent[1] == sent[2], f"run.py must report the ring's bytes equal to the formula:\n{out.stdout}"
    each = 32 * 33 // 2 // 2  # s(s+1)/2 unmasked scores, halved between the 2 ranks
    assert f"unmasked scores computed per rank (zigzag): [{each}, {each}]" in out.stdout, out.stdout
    assert "ulysses: max |difference|" in out.stdout, "the reference solution implements the extra credit too"
