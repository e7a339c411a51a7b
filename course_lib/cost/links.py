"""The links of one accelerator in the alpha-beta model, and one step's TP and EP traffic on them (lecture 07).

α per message comes from the latencies DeepSeek measured on its H800 cluster (Zhao et al. 2025,
"Insights into DeepSeek-V3: Scaling Challenges and Reflections on Hardware for AI Architectures",
ISCA, Table 5), β = 1 / the per-direction bandwidth of :mod:`course_lib.cost.hardware`
(:func:`link_alpha_beta`). On them:

* :func:`tp_step_comm_seconds`: Megatron TP's all-reduces of a step on the scale-up link
  (:func:`course_lib.cost.tp_comm_time.tp_layer_comm_seconds` per layer);
* :func:`step_comm_on`: TP and EP communication of one step on a given part, every figure from the
  hardware table: an H800 (NVLink 400 GB/s) against an H100 (900 GB/s), Zhao et al. §2.3.2, §4.2-4.3.

Tested in tests/cost/test_comm_model.py.
"""

from __future__ import annotations

from course_lib.cost import hardware
from course_lib.cost.expert_dispatch import ep_layer_comm_seconds
from course_lib.cost.tp_comm_time import tp_layer_comm_seconds

LINK_LATENCY_S = {"scale_up": 3.33e-6, "scale_out": 2.8e-6}
"""α per message on each link: Zhao et al. 2025 (ISCA) Table 5, CPU-side end-to-end latency of a 64-byte transfer on
DeepSeek's H800 cluster (NVLink 3.33 µs, InfiniBand within one leaf switch 2.8 µs; 3.7 µs across
leaves). Used for every accelerator: the hardware table has bandwidths only."""


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


def tp_step_comm_seconds(
    accelerator,
    tokens: int,
    hidden: int,
    n_layers: int,
    tp_size: int,
    bytes_per_element: int = 2,
    alpha: float | None = None,
    backward: bool = True,
) -> float:
    """Seconds of TP all-reduces in one step on ``accelerator``'s scale-up link: ``n_layers`` ×
    :func:`~course_lib.cost.tp_comm_time.tp_layer_comm_seconds` (2 all-reduces of T·h forward, 2 backward), the TP group inside one
    node. The bytes do not depend on the hardware, so the bandwidth-bound part scales as 1/bandwidth:
    an H800 (200 GB/s each way) takes 450/200 = 2.25× an H100's time, less only the latency terms."""
    a, b = link_alpha_beta(accelerator, "scale_up", alpha)
    return n_layers * tp_layer_comm_seconds(tokens, hidden, tp_size, a, b, bytes_per_element, backward)


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
