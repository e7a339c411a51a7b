"""The links of one accelerator in the alpha-beta model, and one step's TP and EP traffic on them (lecture 07).

α comes from the latencies DeepSeek measured on its H800 cluster (Zhao et al. 2025, "Insights into DeepSeek-V3:
Scaling Challenges and Reflections on Hardware for AI Architectures", ISCA, Table 5), β = 1 / the per-direction
bandwidth of :mod:`course_lib.cost.hardware` (:func:`link_alpha_beta`). Table 5's α is the end-to-end latency of
one small transfer seen from the CPU, a whole operation; inside a ring collective each step costs less, so
:func:`all_reduce_seconds` charges α once per collective and a per-step latency δ from NCCL's own cost model
(:data:`NCCL_HOP_LATENCY_S`). On them:

* :func:`all_reduce_seconds`: one ring all-reduce on a link, α + 2(N − 1)·δ + 2(N − 1)/N·S·β;
* :func:`tp_step_comm_seconds`: Megatron TP's all-reduces of a step on the scale-up link (2 of T·h per layer
  forward, 2 backward; Shoeybi et al. 2019, §3);
* :func:`step_comm_on`: TP and EP communication of one step on a given part, every figure from the
  hardware table: an H800 (NVLink 400 GB/s) against an H100 (900 GB/s), Zhao et al. §2.3.2, §4.2-4.3.

The planner (:mod:`course_lib.cost.planner`) and lecture 08a take (α, β) from :func:`link_alpha_beta` and charge α
per message of :mod:`course_lib.cost.alpha_beta`'s schedules. Tested in tests/cost/test_comm_model.py.
"""

from __future__ import annotations

from course_lib.cost import hardware
from course_lib.cost.alpha_beta import alpha_beta_terms
from course_lib.cost.expert_dispatch import ep_layer_comm_seconds

LINK_LATENCY_S = {"scale_up": 3.33e-6, "scale_out": 2.8e-6}
"""α per message on each link: Zhao et al. 2025 (ISCA) Table 5, CPU-side end-to-end latency of a 64-byte transfer on
DeepSeek's H800 cluster (NVLink 3.33 µs, InfiniBand within one leaf switch 2.8 µs; 3.7 µs across
leaves). Used for every accelerator: the hardware table has bandwidths only."""

NCCL_HOP_LATENCY_S = {"scale_up": 0.6e-6, "scale_out": 2.7e-6}
"""δ, the latency of one step of a ring collective in NCCL's own cost model: ``hwLat`` in src/graph/tuning.cc (NCCL
2.20) for the ring algorithm with the LL protocol, NCCL's choice for small messages: 0.6 µs over NVLink, 2.7 µs
over the network."""

NCCL_RING_LL_BASE_LATENCY_S = 6.6e-6
"""The latency NCCL's cost model adds once per ring collective with the LL protocol (``baseLat``, the same file):
its ring/LL all-reduce on N GPUs of one NVLink node costs 6.6 µs + 2(N − 1) × 0.6 µs before the bytes."""


def link_alpha_beta(accelerator, link: str = "scale_up", alpha: float | None = None) -> tuple[float, float]:
    """(α, β) of one GPU's ``link`` ("scale_up": NVLink and kin; "scale_out": its share of the NICs) from
    :mod:`course_lib.cost.hardware`: β = 1 / per-direction bandwidth, α from :data:`LINK_LATENCY_S`
    unless given. ``accelerator``: a name in the table or an :class:`~course_lib.cost.hardware.Accelerator`."""
    if link not in LINK_LATENCY_S:
        raise ValueError(f"link {link!r}: choose 'scale_up' or 'scale_out'")
    acc = hardware.get(accelerator)
    figure = acc.scale_up_bytes_per_s if link == "scale_up" else acc.scale_out_bytes_per_s
    if figure.value is None:
        raise ValueError(f"{acc.name} has no published {link} bandwidth ({figure.source}): pass one explicitly")
    return (LINK_LATENCY_S[link] if alpha is None else alpha), 1 / figure.value


def all_reduce_seconds(
    accelerator,
    nbytes: float,
    world_size: int,
    link: str = "scale_up",
    alpha: float | None = None,
    hop_latency: float | None = None,
) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` over ``world_size`` GPUs on ``accelerator``'s ``link``:

        α + 2(N − 1)·δ + 2(N − 1)/N · S·β

    α once per collective (:data:`LINK_LATENCY_S`: Table 5's end-to-end latency of one small transfer, the
    launch, a transfer and its completion as the CPU sees them), δ per ring step (:data:`NCCL_HOP_LATENCY_S`,
    NCCL's per-step latency with its small-message protocol LL), the bytes at the link's per-direction bandwidth
    (β = 1/bandwidth). NCCL's cost model has the same form with its own base latency
    (:data:`NCCL_RING_LL_BASE_LATENCY_S`). LL buys its latency with bandwidth (that model gives a ring with LL a
    quarter of the bus bandwidth) and NCCL moves to LL128 and Simple as messages grow, so pairing LL's latency with
    the full bandwidth is a lower bound for mid-size messages.

    ``alpha`` and ``hop_latency`` replace the defaults: ``alpha=0, hop_latency=LINK_LATENCY_S[link]`` is Thakur et
    al.'s ring with Table 5's α on each of its 2(N − 1) messages
    (:func:`course_lib.cost.alpha_beta.ring_all_reduce_seconds`); ``alpha=0, hop_latency=0`` the bytes alone.
    One GPU: nothing to send, 0 s."""
    a, beta = link_alpha_beta(accelerator, link, alpha)
    hop = NCCL_HOP_LATENCY_S[link] if hop_latency is None else hop_latency
    steps, bytes_on_path = alpha_beta_terms("ring_all_reduce", nbytes, world_size)
    return 0.0 if world_size == 1 else a + steps * hop + bytes_on_path * beta


def tp_step_comm_seconds(
    accelerator,
    tokens: int,
    hidden: int,
    n_layers: int,
    tp_size: int,
    bytes_per_element: int = 2,
    alpha: float | None = None,
    backward: bool = True,
    hop_latency: float | None = None,
) -> float:
    """Seconds of TP all-reduces in one step on ``accelerator``'s scale-up link: ``n_layers`` × (2 all-reduces of
    T·h forward, 2 more backward when ``backward``; Shoeybi et al. 2019, §3), each :func:`all_reduce_seconds` on
    ``tp_size`` GPUs of one node (``alpha``, ``hop_latency`` passed on). The bytes do not depend on the hardware, so
    the bandwidth-bound part scales as 1/bandwidth: an H800 (200 GB/s each way) takes 450/200 = 2.25× an H100's
    time, less only the latency terms."""
    calls = 4 if backward else 2
    nbytes = tokens * hidden * bytes_per_element
    return n_layers * calls * all_reduce_seconds(accelerator, nbytes, tp_size, "scale_up", alpha, hop_latency)


def step_comm_on(
    accelerator,
    *,
    tokens: int,
    hidden: int,
    n_layers: int,
    tp_size: int,
    top_k: int,
    ib_copies: float,
    moe_tokens: int | None = None,
    bytes_per_element: int = 2,
    bytes_dispatch: float = 1,
    bytes_combine: float = 2,
    passes: int = 2,
) -> dict:
    """TP and EP communication of one step on ``accelerator``, every figure from the hardware table.

    TP: :func:`tp_step_comm_seconds` for ``tokens`` per TP group (2 all-reduces forward, 2 backward,
    when ``passes`` = 2; forward only with 1). EP: ``passes`` × ``n_layers`` ×
    :func:`~course_lib.cost.expert_dispatch.ep_layer_comm_seconds` for ``moe_tokens`` per GPU (default ``tokens``; the backward moves
    the same bytes as the forward, gradients instead of activations). Returns {"tp_s", "ep_s",
    "ep_ib_s", "ep_nvlink_s"}: what the same model and batch cost on different parts.
    """
    if passes not in (1, 2):
        raise ValueError(f"passes={passes}: 1 (forward, inference) or 2 (forward and backward, training)")
    acc = hardware.get(accelerator)
    up, out = acc.scale_up_bytes_per_s.value, acc.scale_out_bytes_per_s.value
    if up is None or out is None:
        raise ValueError(f"{acc.name} lacks a published scale-up or scale-out bandwidth")
    tp = tp_step_comm_seconds(acc, tokens, hidden, n_layers, tp_size, bytes_per_element, backward=passes == 2)
    ep = ep_layer_comm_seconds(
        tokens if moe_tokens is None else moe_tokens, hidden, top_k, ib_copies, up, out, bytes_dispatch, bytes_combine
    )
    scale = passes * n_layers
    return {
        "tp_s": tp,
        "ep_s": scale * ep["seconds"],
        "ep_ib_s": scale * ep["ib_s"],
        "ep_nvlink_s": scale * ep["nvlink_s"],
    }
