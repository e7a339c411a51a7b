"""DeepSpeed-Ulysses (course_lib.parallel.context.ulysses) against full causal attention, forward and backward.

Lab 06's Ulysses check (bit-equal at N = 2 and 4, 4 + 4 all-to-alls of the formula's bytes) runs on
course_lib's Ulysses in tests/grading/test_lab_checks.py; the tests here add the all-to-all round trip,
a mesh's cp groups, the backward's symmetry and the errors.

Tolerance: none on CPU. The all-to-alls only move numbers, and each rank then runs the same
scaled_dot_product_attention kernel on whole heads over the whole sequence; heads do not interact,
so every output and gradient element is computed by the same operations in the same order as in
the single-process reference: bit-equal. (On GPUs a backward kernel that accumulates with atomics
is not deterministic; there the test falls back to the ring's 1e-5, see test_ring_attention.py.)
"""

import pytest
import torch
import torch.distributed as dist

from course_lib.cost import collective_bytes
from course_lib.dist import Mesh, RankError, counter, device, launch
from course_lib.grading.labs import lab06_sequence_parallel as lab06
from course_lib.parallel.context import ulysses

B, H, HKV, D = 2, 8, 4, 8  # grouped-query attention; 2 and 4 divide both head counts


def _inputs(seq_len, h=H, hkv=HKV):
    """q, k, v and a random output weight w (the loss is sum(out * w)): the lab's inputs."""
    return lab06.inputs(seq_len, h, hkv)


def _reference(seq_len):
    """Full causal attention over the whole sequence, output and gradients: the lab's reference."""
    return lab06.reference(seq_len, H, HKV)


def _ulysses_rank(seq_len, use_mesh=False, h=H, hkv=HKV):
    group, rank, world = None, dist.get_rank(), dist.get_world_size()
    if use_mesh:  # two sequence-parallel groups side by side: ranks {0,1} and {2,3}
        mesh = Mesh(dp=2, cp=world // 2)
        group, rank, world = mesh.group("cp"), mesh.rank("cp"), mesh.size("cp")
    q, k, v, w = (ulysses.split(t, rank, world) for t in _inputs(seq_len, h, hkv))
    q, k, v = (t.contiguous().to(device()).requires_grad_() for t in (q, k, v))
    w = w.to(device())
    with counter.count() as fwd:
        out = ulysses.ulysses_attention(q, k, v, group=group)
    with counter.count() as bwd:
        (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, fwd.as_dict(), bwd.as_dict(), q.device.type


def _compare(results, what):
    names = ("output", "dL/dq", "dL/dk", "dL/dv")
    exact = all(r[-1] == "cpu" for r in results)
    for i, (name, want) in enumerate(zip(names, _reference(results[0][0].shape[-2] * len(results)))):
        got = torch.cat([r[i] for r in results], dim=-2)  # Ulysses shards are contiguous: concatenate
        same = torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        assert same, (
            f"{what}: the {name} gathered from {len(results)} ranks differs from full causal attention by "
            f"{(got - want).abs().max().item():.2e}; on CPU it must be bit-equal (the all-to-all only moves data): "
            f"check which head and sequence piece each rank sends where"
        )


# ------------------------------------------------------------------------------------ the all-to-all


def _round_trip(world_seq):
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.randn(B, H, world_seq, D, generator=torch.Generator().manual_seed(1)).to(device())
    mine = ulysses.split(full, rank, world)
    heads = ulysses.seq_to_heads(mine)
    return torch.equal(heads, full.chunk(world, dim=1)[rank]), torch.equal(ulysses.heads_to_seq(heads), mine)


@pytest.mark.parametrize("world", [2, 4])
def test_seq_to_heads_gives_whole_sequence_of_a_head_shard_and_heads_to_seq_undoes_it(world):
    for rank, (layout_ok, identity) in enumerate(launch(_round_trip, world, 4 * world, timeout=60)):
        assert layout_ok, f"rank {rank}: after seq_to_heads it must hold all tokens of heads {rank}·h/N ... exactly"
        assert identity, (
            f"rank {rank}: heads_to_seq(seq_to_heads(x)) must return x exactly (a permutation and its inverse)"
        )


# ---------------------------------------------------------------------------------- attention


def test_ulysses_on_the_cp_groups_of_a_mesh():
    results = launch(_ulysses_rank, 4, 16, True, timeout=60)
    for pair in (results[:2], results[2:]):
        _compare(pair, "Ulysses on Mesh(dp=2, cp=2)")
    assert all("all_to_all_single@cp" in r[4] for r in results), "the all-to-alls must run on the cp group given"


@pytest.mark.parametrize("world", [2, 4])
def test_backward_all_to_alls_mirror_the_forward(world):
    s = 8 * world
    want = collective_bytes.ulysses_comm_bytes(B, s, H, HKV, D, world)
    assert want["payload_per_rank"] == B * (s // world) * (2 * H + 2 * HKV) * D * 4
    for rank, r in enumerate(launch(_ulysses_rank, world, s, timeout=60)):
        fwd, bwd = r[4], r[5]
        assert set(fwd) == {"all_to_all_single@world"}, (
            f"Ulysses communicates by all-to-all only; rank {rank} used {set(fwd)}"
        )
        assert fwd["all_to_all_single@world"] == {"calls": want["forward_calls"], "bytes": want["payload_per_rank"]}, (
            f"forward on rank {rank}: q, k, v in and the output back, b·(s/N)·(2h+2h_kv)·d·4 B; measured "
            f"{fwd['all_to_all_single@world']}, formula {want}"
        )
        assert bwd == fwd, (
            f"the backward of each all-to-all is the inverse all-to-all of the gradient, same calls and bytes; "
            f"rank {rank}: forward {fwd}, backward {bwd}"
        )


def test_divisibility_errors_name_the_constraint_and_the_fix():
    with pytest.raises(ValueError, match=r"degree 3 does not divide 8 query heads.*among \[1, 2, 4, 8\]"):
        collective_bytes.check_ulysses_divisible(8, 8, 3)
    with pytest.raises(ValueError, match=r"degree 4 does not divide 2 key/value heads.*repeat the K/V heads"):
        collective_bytes.check_ulysses_divisible(8, 2, 4)
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by the Ulysses degree 4"):
        ulysses.split(torch.zeros(1, 4, 10, 2), 0, 4)
    with pytest.raises(RankError, match="degree 2 does not divide 3 query heads"):
        launch(_ulysses_rank, 2, 8, False, 3, 3, timeout=60)
