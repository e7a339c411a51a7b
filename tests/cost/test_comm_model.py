"""The alpha-beta communication model (course_lib.cost.alpha_beta, links, expert_dispatch, expert_routing) against hand arithmetic and against gloo.

* every collective's formula against values worked by hand, and the invariants that define them
  (a ring all-reduce is a reduce-scatter plus an all-gather);
* the fit recovers α and β from exact data, and the relative fit is the one that survives noise over
  seven decades of message size;
* the acceptance test against gloo, α and β fitted on 11 of 16 message sizes measured here predicting
  the other 5 within 25% for each collective, is lecture 08a's fit cell under nbval: one measurement per
  CI run (35-40 s alone on the machine), not one here and one there (``time_and_fit`` does both);
* Zhao et al.'s (Insights into DeepSeek-V3, ISCA 2025) worked example (120.96 µs) exactly, H800 against H100 for TP and EP, and the distinct
  nodes a routed token reaches, with and without DeepSeek-V3's node limit.
"""

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from course_lib.cost import alpha_beta
from course_lib.cost.alpha_beta import (
    all_to_all_seconds,
    collective_seconds,
    fit_alpha_beta,
    p2p_seconds,
    relative_errors,
    ring_all_gather_seconds,
    ring_all_reduce_seconds,
    ring_reduce_scatter_seconds,
    tree_all_reduce_seconds,
)
from course_lib.cost.expert_dispatch import ep_comm_time, ep_layer_comm_seconds
from course_lib.cost.expert_routing import distinct_nodes_variance, expected_distinct_nodes
from course_lib.cost.links import (
    NCCL_HOP_LATENCY_S,
    NCCL_RING_LL_BASE_LATENCY_S,
    all_reduce_seconds,
    link_alpha_beta,
    step_comm_on,
    tp_step_comm_seconds,
)
from course_lib.dist import device, launch
from course_lib.experiments.lecture07.node_routing import route_distinct_nodes, standard_error
from course_lib.measure.collective_timing import (
    message_sizes,
    tree_all_reduce,
)

A, B = 1e-5, 1e-9  # 10 µs per message, 1 GB/s: round numbers for the hand-worked values


# ------------------------------------------------------------------------------ formulas by hand


def test_formulas_against_hand_worked_values():
    s = 1000
    # ring all-reduce, N = 4: 2·3 = 6 steps of α + S/4·β
    assert ring_all_reduce_seconds(s, 4, A, B) == pytest.approx(6 * A + 6 * 250 * B)
    # binomial tree, N = 8: 3 levels up, 3 down, each a whole message
    assert tree_all_reduce_seconds(s, 8, A, B) == pytest.approx(6 * A + 6 * s * B)
    # N = 5 still needs 3 levels: ⌈log2 5⌉ = 3
    assert tree_all_reduce_seconds(s, 5, A, B) == pytest.approx(6 * A + 6 * s * B)
    # double binary tree, pipelined: the same 6 latencies, the ring's 2S bytes
    assert tree_all_reduce_seconds(s, 8, A, B, pipelined=True) == pytest.approx(6 * A + 2 * s * B)
    # all-gather, reduce-scatter, all-to-all, N = 4: 3 steps of a quarter each
    for f in (ring_all_gather_seconds, ring_reduce_scatter_seconds, all_to_all_seconds):
        assert f(s, 4, A, B) == pytest.approx(3 * A + 750 * B), f.__name__
    assert p2p_seconds(s, A, B) == pytest.approx(A + s * B)
    for name in ("ring_all_reduce", "tree_all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert collective_seconds(name, s, 1, A, B) == 0.0, f"{name} on one rank sends nothing"


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_ring_all_reduce_is_reduce_scatter_then_all_gather(n):
    s = 12_345_678
    halves = ring_reduce_scatter_seconds(s, n, A, B) + ring_all_gather_seconds(s, n, A, B)
    assert ring_all_reduce_seconds(s, n, A, B) == pytest.approx(halves), "the ring all-reduce is the two halves"


def test_tree_beats_ring_on_latency_and_loses_on_bytes():
    # 64 ranks: the ring pays 126 α, the tree 12; on 1 GiB the binomial tree moves 12 S, the ring ~2 S
    assert tree_all_reduce_seconds(8, 64, A, B) < ring_all_reduce_seconds(8, 64, A, B) / 10
    assert tree_all_reduce_seconds(2**30, 64, A, B) > 5 * ring_all_reduce_seconds(2**30, 64, A, B)
    # the double binary tree has both: the tree's latency and, in the limit, the ring's 2(N-1)/N·S ≈ 2S bytes
    pipelined = tree_all_reduce_seconds(2**30, 64, A, B, pipelined=True)
    assert pipelined == pytest.approx(ring_all_reduce_seconds(2**30, 64, A, B), rel=0.02)
    assert tree_all_reduce_seconds(8, 64, A, B, pipelined=True) < ring_all_reduce_seconds(8, 64, A, B) / 10


@pytest.mark.parametrize("name", sorted(alpha_beta.ALPHA_BETA))
@pytest.mark.parametrize("relative", [False, True])
def test_fit_recovers_alpha_beta_from_exact_times(name, relative):
    sizes = message_sizes()
    seconds = [collective_seconds(name, s, 4, 3e-5, 2e-9) for s in sizes]
    alpha, beta = fit_alpha_beta(sizes, seconds, 4, collective=name, relative=relative)
    assert alpha == pytest.approx(3e-5, rel=1e-6) and beta == pytest.approx(2e-9, rel=1e-6), name


def test_relative_fit_weighs_small_and_large_messages_alike():
    # ±10% multiplicative noise, alternating in sign, on 16 sizes from 8 B to 24 MiB. Plain least squares
    # fits the large messages' seconds and lets the small ones miss by ~30%; the relative fit keeps every
    # size near the noise level (10%, plus what the fit's two parameters cannot follow: 0.11 here)
    sizes = message_sizes()
    exact = [collective_seconds("all_to_all", s, 2, 1e-4, 5e-10) for s in sizes]
    noisy = dict(zip(sizes, (t * (1.1 if i % 2 else 0.9) for i, t in enumerate(exact))))
    plain = fit_alpha_beta(sizes, list(noisy.values()), 2, collective="all_to_all")
    rel = fit_alpha_beta(sizes, list(noisy.values()), 2, collective="all_to_all", relative=True)
    worst_plain = max(abs(e) for e in relative_errors(noisy, "all_to_all", 2, *plain).values())
    worst_rel = max(abs(e) for e in relative_errors(noisy, "all_to_all", 2, *rel).values())
    assert worst_rel < 0.15, f"the relative fit should miss no size by much more than the 10% noise: {worst_rel}"
    assert worst_plain > 2 * worst_rel, f"plain least squares should do worse on small messages: {worst_plain}"
    assert rel[0] == pytest.approx(1e-4, rel=0.05) and rel[1] == pytest.approx(5e-10, rel=0.05), rel


def test_fit_needs_two_sizes_and_clips_negative_values():
    with pytest.raises(ValueError, match="two different message sizes"):
        fit_alpha_beta([100, 100], [1.0, 1.0], 2, collective="p2p", relative=True)
    # times falling with size: β would be negative, so β = 0 and α is their (weighted) mean
    alpha, beta = fit_alpha_beta([10, 1000], [2.0, 1.0], 2, collective="p2p")
    assert beta == 0.0 and alpha == pytest.approx(1.5)


# ------------------------------------------------------------------------------ the acceptance test


def _tree_vs_all_reduce():
    g = torch.Generator().manual_seed(dist.get_rank())
    # host: drawn on the host (the generator is a CPU one), then moved to the rank's device
    x = torch.randint(-100, 100, (12,), generator=g).float().to(device())
    want = x.clone()
    dist.all_reduce(want)
    tree_all_reduce(x, torch.empty_like(x))
    return torch.equal(x, want)


def test_tree_all_reduce_sums_on_three_ranks():
    # three ranks: rank 2 has no partner in the first round, the case a power-of-two world never meets
    assert all(launch(_tree_vs_all_reduce, 3, timeout=60)), "the binomial tree must give dist.all_reduce's sums"


# ------------------------------------------------------------------------------ hardware: Zhao et al. 2025, H800 vs H100


def test_insights_into_deepseek_v3_ep_example_is_120_96_us():
    # Insights into DeepSeek-V3 §2.3.2: (1 B + 2 B) x 32 tokens x 9 experts x 7K / 50 GB/s = 120.96 µs
    assert ep_comm_time(32, 7000, 9, 1, 2, 50e9) == pytest.approx(120.96e-6, rel=1e-12)
    layer = ep_layer_comm_seconds(32, 7000, 9, ib_copies=9, scale_up_bytes_per_s=200e9, scale_out_bytes_per_s=50e9)
    assert layer["ib_s"] == pytest.approx(120.96e-6, rel=1e-12), "the same figure through the two-link model"
    assert layer["seconds"] == layer["ib_s"], "InfiniBand is the bottleneck: NVLink forwards 9 copies at 4x the speed"


def test_a_small_all_reduce_pays_the_measured_latency_once_and_nccls_per_step_latency():
    """Table 5's 3.33 µs is one small transfer end to end: all_reduce_seconds charges it once, plus NCCL's per-step
    latency δ on each of the ring's 2(N − 1) steps (NCCL's own model: 6.6 µs + 14 × 0.6 µs at N = 8). Charging α on
    every message (Thakur et al.'s form) is the same function with alpha=0, hop_latency=α."""
    alpha, beta = link_alpha_beta("H800")
    hop = NCCL_HOP_LATENCY_S["scale_up"]
    assert all_reduce_seconds("H800", 0, 8) == pytest.approx(alpha + 14 * hop)
    assert all_reduce_seconds("H800", 1e6, 8) == pytest.approx(alpha + 14 * hop + 14 / 8 * 1e6 * beta)
    per_message = all_reduce_seconds("H800", 1e6, 8, alpha=0, hop_latency=alpha)
    assert per_message == pytest.approx(ring_all_reduce_seconds(1e6, 8, alpha, beta)), (
        "the per-message form is Thakur's"
    )
    nccl = NCCL_RING_LL_BASE_LATENCY_S + 14 * hop
    assert all_reduce_seconds("H800", 0, 8) < nccl < per_message / 3, "the measured α once sits below NCCL's own base"
    assert all_reduce_seconds("H800", 1e6, 1) == 0.0, "one GPU sends nothing"


def test_h800_tp_comm_is_h100_times_the_bandwidth_ratio():
    kw = dict(tokens=4096, hidden=7168, n_layers=61, tp_size=8)
    assert link_alpha_beta("H800")[1] == 1 / 200e9 and link_alpha_beta("H100")[1] == 1 / 450e9
    bytes_only = dict(alpha=0, hop_latency=0)
    ratio = tp_step_comm_seconds("H800", **kw, **bytes_only) / tp_step_comm_seconds("H100", **kw, **bytes_only)
    assert ratio == pytest.approx(450 / 200), "bandwidth-bound TP time scales with 1/bandwidth"
    with_latency = tp_step_comm_seconds("H800", **kw) / tp_step_comm_seconds("H100", **kw)
    assert 1 < with_latency < 450 / 200, "the latency terms do not scale with the bandwidth: the ratio falls short"
    small = tp_step_comm_seconds("H800", 8, 7168, 61, 8) / tp_step_comm_seconds("H100", 8, 7168, 61, 8)
    assert small < with_latency, "on a few tokens (decode) the latency dominates and the NVLink cut matters less"


def test_h800_ep_time_is_set_by_infiniband_like_h100():
    kw = dict(tokens=4096, hidden=7168, n_layers=61, tp_size=8, top_k=8, ib_copies=4)
    h800, h100 = step_comm_on("H800", **kw), step_comm_on("H100", **kw)
    assert h800["ep_s"] == h100["ep_s"] == h800["ep_ib_s"], "same 50 GB/s NIC per GPU: EP time unchanged"
    assert h800["ep_nvlink_s"] == pytest.approx(450 / 200 * h100["ep_nvlink_s"]), "only the forwarding slows"
    assert h800["tp_s"] > 1.9 * h100["tp_s"], "while TP time roughly doubles"


# ------------------------------------------------------------------------------ node-limited routing


def _enumerate_distinct(n_experts, n_nodes, top_k):
    per = n_experts // n_nodes
    counts = [len({e // per for e in c}) for c in itertools.combinations(range(n_experts), top_k)]
    mean = sum(counts) / len(counts)
    return mean, sum((c - mean) ** 2 for c in counts) / len(counts)


@pytest.mark.parametrize("n_experts, n_nodes, top_k", [(8, 4, 3), (12, 3, 4), (16, 8, 2), (10, 5, 10)])
def test_expected_distinct_nodes_by_enumeration(n_experts, n_nodes, top_k):
    mean, var = _enumerate_distinct(n_experts, n_nodes, top_k)
    assert expected_distinct_nodes(n_experts, n_nodes, top_k) == pytest.approx(mean)
    assert distinct_nodes_variance(n_experts, n_nodes, top_k) == pytest.approx(var, abs=1e-12)
    # with a node limit M = n the formula is the unlimited one
    assert expected_distinct_nodes(n_experts, n_nodes, top_k, node_limit=n_nodes) == pytest.approx(mean)


def test_deepseek_v3_distinct_nodes():
    # 256 experts on 8 nodes, k = 8: a node is missed with probability C(224, 8)/C(256, 8) ≈ 0.338
    assert expected_distinct_nodes(256, 8, 8) == pytest.approx(8 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert 5.29 < expected_distinct_nodes(256, 8, 8) < 5.30
    assert expected_distinct_nodes(256, 8, 8, node_limit=4) < 4


def test_routed_tokens_reach_the_expected_number_of_nodes():
    # DeepSeek-V3's shape: 256 experts on 8 nodes, top-8, T = 4096 random tokens. The tokens are
    # independent and each one's top-8 is a uniformly random set (route_distinct_nodes makes the logits
    # i.i.d.), so the mean of D over T tokens has standard error sd(D)/√T with sd(D) from
    # distinct_nodes_variance (0.887): 0.014. Four standard errors (0.055) bound the miss; a correct
    # router falls outside them with probability ~6e-5.
    tokens = 4096
    d = route_distinct_nodes(tokens, 256, 8, 8, seed=0)
    se = math.sqrt(distinct_nodes_variance(256, 8, 8) / tokens)
    assert standard_error(d) == pytest.approx(se, rel=0.1), "the measured spread should match the formula's"
    assert abs(d.float().mean().item() - expected_distinct_nodes(256, 8, 8)) < 4 * se


@pytest.mark.parametrize("limit", [1, 2, 4, 6])
def test_node_limited_routing_never_exceeds_its_limit(limit):
    d = route_distinct_nodes(4096, 256, 8, 8, node_limit=limit, seed=1)
    assert d.max().item() <= limit, f"node-limited routing (M = {limit}) sent a token to {d.max().item()} nodes"
    # DeepSeek's rule picks nodes for their strongest experts, so chosen nodes are used: the mean lies
    # at or above the uniform-within-M value (equal when M = 1), and below M
    uniform = expected_distinct_nodes(256, 8, 8, node_limit=limit)
    assert uniform - 4 * standard_error(d) <= d.float().mean().item() <= limit
    assert d.float().mean().item() < expected_distinct_nodes(256, 8, 8), "the limit must cut IB crossings"
