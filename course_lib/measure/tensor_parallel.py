"""Collectives one rank issues in one tensor-parallel block, TP against TP+SP (lecture 02)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.dist import Mesh, counter, device, launch
from course_lib.model import config as configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.tensor.model import TPBlock, TPTransformer
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


def _tp_step_rank(n_layers: int, batch: int, seq_len: int, seed: int):
    mesh = Mesh(tp=dist.get_world_size())
    torch.manual_seed(seed)
    cfg = configs.get("tiny", n_layers=n_layers)
    dense = Transformer(cfg)
    model = TPTransformer.from_dense(dense, mesh)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen) for _ in range(2))
    with counter.count() as fwd:
        loss = model.loss(tokens, targets)
    with counter.count() as bwd:
        loss.backward()
    dense_loss = dense.loss(tokens, targets).item()
    return fwd.calls("all_reduce"), bwd.calls("all_reduce"), fwd.bytes() + bwd.bytes(), loss.item() - dense_loss


def tp_step_collectives(n_layers: int, tp_size: int = 2, batch: int = 2, seq_len: int = 16, seed: int = 0):
    """One training step of the tiny model under 1D TP (vocabulary included), counted on rank 0.

    Returns (forward all-reduces, backward all-reduces, all bytes moved, TP loss − dense loss).
    """
    return launch(_tp_step_rank, tp_size, n_layers, batch, seq_len, seed, timeout=120)[0]
