"""Seconds of Megatron 1D tensor parallelism's all-reduces, and their share of a block (lecture 02).

Shoeybi et al. 2019 ("Megatron-LM", §3): each transformer layer all-reduces its [T, h] activation
twice forward (the g after attention's row-parallel projection and after the MLP's) and twice
backward (the f), each a ring all-reduce of :mod:`course_lib.cost.alpha_beta` on ``tp_size`` ranks,
2(t-1)·α + 2(t-1)/t·T·h·bytes·β. The compute it sets against is
:func:`course_lib.cost.flops.gpt_block_forward_flops`, split over the ``tp_size`` ranks, so the share of
communication grows with the degree. On a real accelerator's link: :func:`course_lib.cost.links.tp_step_comm_seconds`.

Tested in tests/cost/test_comm_model.py.
"""

from __future__ import annotations

from course_lib.cost.alpha_beta import ring_all_reduce_seconds
from course_lib.cost.flops import gpt_block_forward_flops


def tp_layer_comm_seconds(
    tokens: int,
    hidden: int,
    tp_size: int,
    alpha: float,
    beta: float,
    bytes_per_element: int = 2,
    backward: bool = True,
) -> float:
    """Seconds of Megatron 1D TP's all-reduces in one transformer layer (Shoeybi et al. 2019, §3):
    forward, the two g (after attention's row-parallel projection and after the MLP's), each a ring
    all-reduce of the [T, h] activation; backward, the two f, the same size again. Nothing overlapped:
    4 · :func:`~course_lib.cost.alpha_beta.ring_all_reduce_seconds` (T·h·bytes) with ``backward``, 2 without."""
    calls = 4 if backward else 2
    return calls * ring_all_reduce_seconds(tokens * hidden * bytes_per_element, tp_size, alpha, beta)


def tp_block_comm_share(
    tokens: int,
    hidden: int,
    seq_len: int,
    tp_size: int,
    flops_per_second: float,
    alpha: float,
    beta: float,
    bytes_per_element: int = 2,
) -> dict:
    """Forward of one transformer block under Megatron 1D TP: compute and communication seconds per rank.

    Compute: :func:`course_lib.cost.flops.gpt_block_forward_flops`, 24·T·h²·(1 + s/(6h)), split over ``tp_size`` ranks.
    Communication: the two g all-reduces of a [T, h] activation (Shoeybi et al. 2019, §3), each a
    ring all-reduce (:func:`course_lib.cost.alpha_beta.ring_all_reduce_seconds`); nothing overlapped. Returns
    {"compute_s", "comm_s", "share"}, share = comm / (comm + compute).
    """
    compute = gpt_block_forward_flops(tokens, hidden, seq_len) / tp_size / flops_per_second
    comm = tp_layer_comm_seconds(tokens, hidden, tp_size, alpha, beta, bytes_per_element, backward=False)
    return {"compute_s": compute, "comm_s": comm, "share": comm / (comm + compute)}
