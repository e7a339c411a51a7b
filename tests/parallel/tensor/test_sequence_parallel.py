"""Megatron sequence parallelism (course_lib.parallel.tensor.sequence) against the dense course model.

Same tolerance as tests/parallel/tensor/test_tensor_parallel.py: 1e-5 of each tensor's largest magnitude, because
the reduce-scatters add the t partial products in another order than the dense matmul (measured
differences are below 1e-6). The collectives themselves are checked exactly on integer-valued data.
"""

import pytest
import torch
import torch.distributed as dist
from test_tensor_parallel import CFG, RTOL, dense_model, max_rel_diff  # one model, one tolerance for TP and TP+SP

from course_lib.cost.collective_bytes import ring_wire_bytes
from course_lib.dist import Mesh, device, launch
from course_lib.experiments.lecture02.tp_collectives import collectives_per_layer
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.tensor.comms import all_gather_sequence, reduce_scatter_sequence
from course_lib.parallel.tensor.model import TPBlock, TPTransformer
from course_lib.parallel.tensor.sequence import shard_sequence, sync_sequence_parallel_grads
from course_lib.parallel.tensor.sharded_layers import shard_of


def _primitives():
    group = Mesh(tp=dist.get_world_size()).group("tp")
    r = dist.get_rank()
    full = torch.arange(2 * 8 * 3, dtype=torch.float32, device=device()).view(2, 8, 3)  # the same on every rank
    gathered = all_gather_sequence(shard_sequence(full, group), group)
    mine = full * (r + 1)  # partial sums: their total is full * (1 + 2 + ... + t)
    scattered = reduce_scatter_sequence(mine, group)
    return gathered, scattered, full


def test_sequence_all_gather_and_reduce_scatter_are_exact():
    t = 4
    for r, (gathered, scattered, full) in enumerate(launch(_primitives, t, timeout=60)):
        assert torch.equal(gathered, full), "all-gather of the sequence shards must rebuild [b, s, h] in position order"
        want = (full * sum(range(1, t + 1))).chunk(t, dim=1)[r]
        assert torch.equal(scattered, want), (
            f"rank {r}: reduce-scatter must leave the sum of all ranks' [b, s, h] at positions [r·s/t, (r+1)·s/t)"
        )


def _sp_block_vs_dense(seed: int, sync: bool):
    b, s = 2, 16
    mesh, dense, cos, sin = dense_model(seed, s)
    group = mesh.group("tp")
    block = TPBlock(dense.layers[0], mesh, sequence_parallel=True)
    # host: drawn with CPU generators (the same numbers on any machine), then moved to the rank's device
    x = torch.randn(b, s, CFG.d_model, generator=torch.Generator().manual_seed(seed + 1)).to(device()).requires_grad_()
    dy = torch.randn(b, s, CFG.d_model, generator=torch.Generator().manual_seed(seed + 2)).to(device())
    y = dense.layers[0](x, cos, sin)
    (y * dy).sum().backward()
    x_sp = shard_sequence(x.detach(), group).clone().requires_grad_(True)
    y_sp = block(x_sp, cos, sin)
    (y_sp * shard_sequence(dy, group)).sum().backward()
    if sync:
        sync_sequence_parallel_grads(block, group)
    diffs = {
        "output shard": max_rel_diff(y_sp, shard_sequence(y.detach(), group)),
        "input grad shard": max_rel_diff(x_sp.grad, shard_sequence(x.grad, group)),
    }
    for name, p in block.named_parameters():
        diffs[name + ".grad"] = max_rel_diff(p.grad, shard_of(dense.layers[0].get_parameter(name).grad, p, group))
    return diffs


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_block_outputs_and_gradients_equal_dense(tp):
    for rank, diffs in enumerate(launch(_sp_block_vs_dense, tp, 0, True, timeout=60)):
        bad = {k: v for k, v in diffs.items() if v > RTOL}
        assert not bad, (
            f"TP+SP={tp}, rank {rank}: the sequence-parallel block must equal the dense block on this "
            f"rank's positions (relative {RTOL}); these differ more: {bad}"
        )


def test_norm_gradients_are_partial_until_all_reduced():
    diffs = launch(_sp_block_vs_dense, 2, 0, False, timeout=60)[0]
    norms = {k: v for k, v in diffs.items() if "norm" in k}
    assert norms and all(v > 1e-2 for v in norms.values()), (
        "without sync_sequence_parallel_grads the norm weights' gradients cover only this rank's s/t positions, "
        f"so they must differ from dense; got relative differences {norms}"
    )
    others = {k: v for k, v in diffs.items() if "norm" not in k}
    assert all(v <= RTOL for v in others.values()), f"sharded weights need no extra all-reduce: {others}"


def test_sp_replaces_the_all_reduces_by_all_gather_and_reduce_scatter_of_the_same_volume():
    t, b, s = 2, 2, 16
    counts = collectives_per_layer(CFG, tp_size=t, batch=b, seq_len=s)
    tp_, sp = counts["TP"], counts["TP+SP"]
    full = b * s * CFG.d_model * 4  # bytes of one [b, s, h] fp32 activation
    calls = {phase: {k: v["calls"] for k, v in sp[phase].items()} for phase in ("forward", "backward")}
    assert tp_["forward"] == {"all_reduce@tp": {"calls": 2, "bytes": 2 * full}}, tp_["forward"]
    assert tp_["backward"] == {"all_reduce@tp": {"calls": 2, "bytes": 2 * full}}, tp_["backward"]
    assert calls["forward"] == {"all_gather_single@tp": 2, "reduce_scatter_single@tp": 2}, (
        f"TP+SP forward: an all-gather entering each region and a reduce-scatter leaving it, got {calls['forward']}"
    )
    assert calls["backward"] == {"all_gather_single@tp": 4, "reduce_scatter_single@tp": 2}, (
        f"TP+SP backward: 2 reduce-scatters (f's gradient sums), 2 all-gathers (g's), and 2 all-gathers that rebuild "
        f"the stored input shards; got {calls['backward']}"
    )
    # Korthikanti §4.2.2: all-reduce = reduce-scatter + all-gather, so the wire volume is unchanged
    assert ring_wire_bytes(sp["forward"], t) == ring_wire_bytes(tp_["forward"], t), (
        "TP+SP must send exactly the ring bytes of TP in the forward pass: "
        f"{ring_wire_bytes(sp['forward'], t)} vs {ring_wire_bytes(tp_['forward'], t)}"
    )
    regather = 2 * (t - 1) * full // t  # two all-gathers of a [b, s/t, h] shard
    assert ring_wire_bytes(sp["backward"], t) == ring_wire_bytes(tp_["backward"], t) + regather, (
        "TP+SP backward = TP's volume plus the two re-gathers of stored shards (Korthikanti §4.2.2)"
    )
    norm_bytes = 2 * CFG.d_model * 4
    assert sp["norm gradients"] == {"all_reduce@tp": {"calls": 1, "bytes": norm_bytes}}, (
        f"the two norm-weight gradients are all-reduced in one call of 2·h floats, got {sp['norm gradients']}"
    )


def _sp_model_vs_dense(seed: int):
    mesh = Mesh(tp=dist.get_world_size())
    cfg = configs.get("tiny")
    torch.manual_seed(seed)
    dense = Transformer(cfg).to(device())
    model = TPTransformer(dense, mesh, sequence_parallel=True)
    # host: drawn with CPU generators (the same tokens on any machine), then moved to the rank's device
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed)).to(device())
    targets = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed + 1)).to(device())
    want = dense.loss(tokens, targets)
    want.backward()
    got = model.loss(tokens, targets)
    got.backward()
    model.sync_grads()
    worst = max(
        max_rel_diff(p.grad, shard_of(dense.get_parameter(n).grad, p, mesh.group("tp")))
        for n, p in model.named_parameters()
    )
    return got.item(), want.item(), worst


def test_sp_model_loss_and_gradients_equal_dense():
    for rank, (got, want, worst) in enumerate(launch(_sp_model_vs_dense, 2, 0, timeout=60)):
        assert abs(got - want) <= 1e-6 * abs(want), f"rank {rank}: TP+SP loss {got} should equal the dense loss {want}"
        assert worst <= RTOL, f"rank {rank}: a TP+SP gradient differs from dense by {worst:.2e} (relative)"
