"""Node-limited routing: how many distinct nodes a token's experts live on (lecture 07).

A token's k experts, drawn uniformly without replacement from E experts spread evenly over n nodes,
reach D distinct nodes, 𝔼[D] = n·(1 − C(E − E/n, k)/C(E, k)) (:func:`expected_distinct_nodes`), with
the variance of :func:`distinct_nodes_variance`. With InfiniBand traffic deduplicated per node (Zhao
et al. 2025, "Insights into DeepSeek-V3: Scaling Challenges and Reflections on Hardware for AI
Architectures", ISCA, §4.3) D is the InfiniBand copies a token costs; DeepSeek-V3's node-limited
routing (DeepSeek-AI, "DeepSeek-V3 Technical Report" 2024, §2.1.2) caps it at M nodes. The seconds
those copies take are :func:`course_lib.cost.expert_dispatch.ep_layer_comm_seconds`.

Tested in tests/cost/test_comm_model.py.
"""

from __future__ import annotations

import math


def expected_distinct_nodes(n_experts: int, n_nodes: int, top_k: int, node_limit: int | None = None) -> float:
    """Expected number of distinct nodes a token's ``top_k`` experts live on, the experts drawn uniformly
    without replacement from ``n_experts`` spread evenly over ``n_nodes`` (E/n to a node):

        𝔼[D] = n · (1 − C(E − E/n, k) / C(E, k))

    by linearity: a node is missed when all k experts fall among the other E − E/n, with probability
    C(E − E/n, k)/C(E, k). With IB traffic deduplicated per node (one crossing per node, then NVLink
    forwarding; Zhao et al., *Insights into DeepSeek-V3*, ISCA 2025, §4.3) this is the IB copies per
    token; DeepSeek-V3 (E = 256, n = 8, k = 8): 5.30 instead of 8.

    ``node_limit`` M (DeepSeek-V3's node-limited routing, report §2.1.2): the same formula over the M
    allowed nodes, M · (1 − C((M−1)·E/n, k) / C(M·E/n, k)), as if the k experts were uniform among
    their M·E/n experts. DeepSeek's rule picks the M nodes *for* their strongest experts, so each
    chosen node almost always receives one: the measured mean lies between this value and M (3.63 and
    4 for M = 4; measured ≈ 3.97: :func:`course_lib.experiments.lecture07.node_routing.route_distinct_nodes`), and
    never above M, which is the bound that matters.
    """
    if n_experts % n_nodes or not 0 < top_k <= n_experts:
        raise ValueError(f"need E={n_experts} divisible by n_nodes={n_nodes} and 1 <= k={top_k} <= E")
    per_node = n_experts // n_nodes
    nodes = n_nodes if node_limit is None else node_limit
    if not 1 <= nodes <= n_nodes or top_k > nodes * per_node:
        raise ValueError(f"node_limit={node_limit}: need 1 <= M <= {n_nodes} and M·E/n >= k={top_k}")
    pool = nodes * per_node
    return nodes * (1 - math.comb(pool - per_node, top_k) / math.comb(pool, top_k))


def distinct_nodes_variance(n_experts: int, n_nodes: int, top_k: int) -> float:
    """Variance of the distinct nodes D of :func:`expected_distinct_nodes` (no node limit), from the
    indicators of the nodes hit: Var D = Σ_i Var 1_i + Σ_{i≠j} Cov(1_i, 1_j), with P(miss i) = q₁ =
    C(E − m, k)/C(E, k) and P(miss i and j) = q₂ = C(E − 2m, k)/C(E, k), m = E/n:

        Var D = n(1 − q₁) + n(n − 1)(1 − 2q₁ + q₂) − (n(1 − q₁))²

    sd/√T is then the standard error of a mean over T independent tokens."""
    m, total = n_experts // n_nodes, math.comb(n_experts, top_k)
    q1 = math.comb(n_experts - m, top_k) / total
    q2 = math.comb(n_experts - 2 * m, top_k) / total if n_nodes > 1 else 0.0
    mean = n_nodes * (1 - q1)
    return mean + n_nodes * (n_nodes - 1) * (1 - 2 * q1 + q2) - mean**2
