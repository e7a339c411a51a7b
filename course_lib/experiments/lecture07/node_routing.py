"""Node-limited routing measured: how many distinct nodes a routed token's experts live on (lecture 07).

The course MoE router (:class:`course_lib.model.moe.Router`, whose ``n_groups``/``topk_groups`` are
DeepSeek-V3's node-limited routing) on random tokens, and how many distinct nodes each token's k experts
live on: the number of InfiniBand crossings of its dispatch once NVLink forwards inside a node (Zhao et
al., *Insights into DeepSeek-V3*, ISCA 2025, §4.3). Set beside
:func:`course_lib.cost.expert_routing.expected_distinct_nodes`. Tested in tests/cost/test_comm_model.py.
"""

from __future__ import annotations

import math

import torch

from course_lib.model.moe import Router


def route_distinct_nodes(
    n_tokens: int,
    n_experts: int,
    n_nodes: int,
    top_k: int,
    node_limit: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Distinct nodes each of ``n_tokens`` random tokens reaches: [n_tokens] int64.

    Experts sit ``n_experts / n_nodes`` to a node, in order (expert e on node e // (E/n)), as DeepSeek-V3
    deploys its 8 groups of 32 (Zhao et al. 2025, §4.3). The course router (sigmoid scores, DeepSeek-V3's) with
    ``n_groups = n_nodes`` and ``topk_groups = node_limit`` (None: no limit) picks each token's top-k.
    Its gate gets orthonormal rows (d_model = E) and tokens are N(0, I), so every token's logits are
    independent standard normals: each token's top-k is a uniformly random set of k experts, the
    assumption of :func:`course_lib.cost.expert_routing.expected_distinct_nodes`."""
    # host: a Monte Carlo of routing in this process (a fresh CPU router, no rank): the same draws on any machine
    gen = torch.Generator().manual_seed(seed)
    router = Router(n_experts, n_experts, top_k, score="sigmoid", n_groups=n_nodes, topk_groups=node_limit)
    with torch.no_grad():
        q, _ = torch.linalg.qr(torch.randn(n_experts, n_experts, generator=gen))  # host: the CPU router's gate
        router.gate.weight.copy_(q)
        experts = router(torch.randn(n_tokens, n_experts, generator=gen)).experts  # host: tokens for the CPU router
    nodes = (experts // (n_experts // n_nodes)).sort(-1).values
    return 1 + (nodes[:, 1:] != nodes[:, :-1]).sum(-1)


def standard_error(values: torch.Tensor) -> float:
    """Standard error of the mean of independent samples: sd / √T."""
    return values.float().std().item() / math.sqrt(len(values))
