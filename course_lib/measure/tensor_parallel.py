"""Collectives one rank issues in one tensor-parallel block, TP against TP+SP (lecture 02)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.dist import Mesh, counter, device, launch
from course_lib.model.transformer import Transformer
from course_lib.parallel.tensor.model import TPBlock
from course_lib.parallel.tensor.sequence import shard_sequence, sync_sequence_parallel_grads


def _count_block_rank(cfg, batch, seq_len, settings, seed):

    mesh = Mesh(tp=dist.get_world_size())
    torch.manual_seed(seed)
    dense = Transformer(cfg).to(device())
    cos, sin = dense.rope_cos[:seq_len], dense.rope_sin[:seq_len]
    results = {}
    for sp in settings:
        block = TPBlock(dense.layers[0], mesh, sequence_parallel=sp)
        x = torch.randn(batch, seq_len, cfg.d_model, generator=torch.Generator().manual_seed(seed)).to(device())
        x = (shard_sequence(x, mesh.group("tp")) if sp else x).clone().requires_grad_(True)
        with counter.count() as fwd:
            y = block(x, cos, sin)
        with counter.count() as bwd:
            y.sum().backward()
        with counter.count() as sync:
            sync_sequence_parallel_grads(block, mesh.group("tp")) if sp else None
        results["TP+SP" if sp else "TP"] = {
            "forward": fwd.as_dict(),
            "backward": bwd.as_dict(),
            "norm gradients": sync.as_dict(),
        }
    return results


def collectives_per_layer(cfg, tp_size: int = 2, batch: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """For the lecture: collectives one rank issues in one ``TPBlock``, TP and TP+SP, from the counter.

    Returns {"TP": {"forward": {...}, "backward": {...}, "norm gradients": {...}}, "TP+SP": {...}},
    each a ``CommCounter.as_dict()`` ({"all_reduce@tp": {"calls": 2, "bytes": ...}, ...}); feed one to
    :func:`course_lib.cost.comm.ring_wire_bytes` for the ring traffic. One launch of ``tp_size`` ranks.
    """

    return launch(_count_block_rank, tp_size, cfg, batch, seq_len, (False, True), seed, timeout=120)[0]
