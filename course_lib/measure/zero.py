"""Measured next to predicted: one training step of each ZeRO stage on N ranks — the bars of lecture 02.

Bytes held come from :func:`course_lib.dist.census.held_bytes` (via ``Zero.model_state_bytes``),
bytes moved from :mod:`course_lib.dist.counter`; the formulas from :mod:`course_lib.cost.memory`
and :mod:`course_lib.cost.comm`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.cost.comm import ring_wire_bytes, zero_comm_bytes
from course_lib.cost.memory import STAGES, zero_model_state_bytes
from course_lib.dist import counter, device, launch
from course_lib.model import config as configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.data.zero import Zero


def _measure_rank(config: str, precision: str, stages, seed: int, batch: int, seq: int) -> dict:

    out = {}
    for stage in stages:
        torch.manual_seed(seed)
        model = Transformer(configs.get(config)).to(device())
        zero = Zero(model, stage, lr=1e-3, precision=precision)
        g = torch.Generator().manual_seed(seed + dist.get_rank())
        x = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), generator=g).to(device())
        with counter.count() as c:
            model.loss(x[:, :-1], x[:, 1:]).backward()
            zero.step()
        out[stage] = {
            "state": zero.model_state_bytes(),
            "counts": c.as_dict(),
            "n_params": sum(u.numel for u in zero.units),
        }
    return out


def measured_state_bytes(world_size: int = 2, config: str = "tiny", precision: str = "bf16") -> dict[int, tuple]:
    """{stage: (measured bytes of model states on rank 0, formula)} — one bar pair per stage."""
    return {s: (m["state_bytes"], m["state_formula"]) for s, m in measure_stages(world_size, config, precision).items()}


def measured_comm_bytes(world_size: int = 2, config: str = "tiny", precision: str = "bf16") -> dict[int, tuple]:
    """{stage: (measured ring bytes rank 0 moves in one step, formula)} — one bar pair per stage."""
    return {s: (m["comm_bytes"], m["comm_formula"]) for s, m in measure_stages(world_size, config, precision).items()}


def measure_stages(
    world_size: int = 2,
    config: str = "tiny",
    precision: str = "bf16",
    stages=STAGES,
    seed: int = 0,
    batch: int = 2,
    seq: int = 16,
) -> dict[int, dict]:
    """Run one training step of each stage on ``world_size`` ranks; measurement next to formula.

    Returns {stage: {"n_params", "state_bytes" (rank 0's census), "state_bytes_per_rank",
    "state_formula", "state_breakdown" (params/grads/optimizer), "comm_bytes" (rank 0, ring wire
    bytes from the counter), "comm_bytes_per_rank", "comm_formula"}} — the numbers for a bar chart.
    """
    per_rank = launch(_measure_rank, world_size, config, precision, tuple(stages), seed, batch, seq, timeout=120)
    width = {"fp32": dict(k=8, param_bytes=4, grad_bytes=4), "bf16": dict(k=12, param_bytes=2, grad_bytes=2)}[precision]
    result = {}
    for stage in stages:
        psi = per_rank[0][stage]["n_params"]
        comm = [ring_wire_bytes(r[stage]["counts"], world_size) for r in per_rank]
        result[stage] = {
            "n_params": psi,
            "state_bytes": per_rank[0][stage]["state"]["total"],
            "state_bytes_per_rank": [r[stage]["state"]["total"] for r in per_rank],
            "state_breakdown": {k: v for k, v in per_rank[0][stage]["state"].items() if k != "total"},
            "state_formula": zero_model_state_bytes(psi, world_size, stage, **width),
            "comm_bytes": comm[0],
            "comm_bytes_per_rank": comm,
            "comm_formula": zero_comm_bytes(psi, world_size, stage, width["param_bytes"]),
        }
    return result
