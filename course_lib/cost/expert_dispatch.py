"""Expert parallelism's dispatch and combine: bytes per rank and seconds on its links (lectures 03, 05, 07).

An MoE layer on ``ep_size`` ranks sends every token's row to each of its k experts and back (GShard,
Lepikhin et al. 2020, §2.2), T·k·h·bytes each way, of which (ep_size - 1)/ep_size leave the rank:

* :func:`ep_dispatch_bytes` (padding-free, uneven splits) and :func:`padded_dispatch_bytes` (a fixed
  capacity per expert, GShard §2.2 and Switch, Fedus et al. 2021, §2.2);
* :func:`fp8_bytes_per_element`: an FP8 dispatch with one fp32 scale per 128 channels (DeepSeek-AI,
  "DeepSeek-V3 Technical Report" 2024, §3.3);
* :func:`ep_comm_time`: dispatch + combine over one link's bandwidth, bandwidth-bound;
* :func:`ep_layer_comm_seconds`: the same over a GPU's two links, InfiniBand between nodes (one
  crossing per node reached) and NVLink forwarding inside one (Zhao et al. 2025, "Insights into
  DeepSeek-V3: Scaling Challenges and Reflections on Hardware for AI Architectures", ISCA, §4.3).

How many nodes a token reaches is :mod:`course_lib.cost.expert_routing`. Tested in
tests/cost/test_cost_calculators.py, tests/parallel/expert/test_expert_parallel.py and tests/cost/test_comm_model.py.
"""

from __future__ import annotations


def ep_dispatch_bytes(tokens: int, hidden: int, n_experts_per_token: int, bytes_per_element: float = 2) -> float:
    """Bytes one rank's dispatch all-to-all carries for one MoE layer: every token goes once to each
    of its k experts, a row of ``hidden`` elements each (GShard, Lepikhin et al. 2020, §2.2). The
    combine sends as many rows back. DeepSeek-V3 (§3.3) dispatches in FP8 (1 byte, plus scales)
    and combines in BF16 (2 bytes). Of these, (ep - 1)/ep leave the rank when experts are spread
    evenly; the rest stays local."""
    if min(tokens, hidden, n_experts_per_token) < 0 or bytes_per_element <= 0:
        raise ValueError("tokens, hidden and n_experts_per_token must be >= 0 and bytes_per_element > 0")
    return tokens * n_experts_per_token * hidden * bytes_per_element


def padded_dispatch_bytes(n_experts: int, capacity: int, hidden: int, bytes_per_element: float = 2) -> float:
    """Bytes one rank's dispatch carries when every expert receives a fixed buffer of ``capacity`` rows
    (GShard §2.2, Switch §2.2: an all-to-all of equal splits, rows of unused slots sent as zeros):
    E · C · hidden · bytes, whatever the routing. With C = ⌈cf · T · k / E⌉ that is about cf times the
    T · k rows of :func:`ep_dispatch_bytes`, which a padding-free dispatch (uneven splits, as
    course_lib's all_to_all_single with split sizes; X-MoE's "no-padding" routing) sends instead —
    and the padded one also drops what overflows C."""
    if min(n_experts, capacity, hidden) < 0 or bytes_per_element <= 0:
        raise ValueError("n_experts, capacity and hidden must be >= 0 and bytes_per_element > 0")
    return n_experts * capacity * hidden * bytes_per_element


def fp8_bytes_per_element(block: int = 128, scale_bytes: int = 4) -> float:
    """Bytes per element of an FP8 dispatch: the 1-byte e4m3 value plus one fp32 scale per ``block``
    channels, 1 + 4/block (DeepSeek-V3 report, §3.3.2: activations scaled per 1 x 128 tile; §3.3.3:
    the dispatch all-to-all carries them in FP8). Against fp32 rows that is (1 + 4/block)/4 of the
    bytes: 0.2578 at block 128, 0.3125 for a per-row scale of a 64-wide row. Pass it to
    :func:`ep_dispatch_bytes` as ``bytes_per_element``."""
    if block < 1 or scale_bytes < 0:
        raise ValueError(f"block={block} channels per scale must be >= 1 and scale_bytes={scale_bytes} >= 0")
    return 1 + scale_bytes / block


def ep_comm_time(
    tokens: int,
    hidden: int,
    n_experts_per_token: int,
    bytes_dispatch: float,
    bytes_combine: float,
    bandwidth: float,
    remote_fraction: float = 1.0,
) -> float:
    """Seconds of one MoE layer's dispatch + combine all-to-alls on one rank's link: the bytes of
    :func:`ep_dispatch_bytes` each way, times the share that leaves the rank, over ``bandwidth``
    (bytes/s). Bandwidth-bound: no latency term, no overlap with compute (DualPipe hides it)."""
    if bandwidth <= 0 or not 0 <= remote_fraction <= 1:
        raise ValueError(
            f"bandwidth must be > 0 (bytes/s) and 0 <= remote_fraction <= 1; got {bandwidth}, {remote_fraction}"
        )
    moved = ep_dispatch_bytes(tokens, hidden, n_experts_per_token, bytes_dispatch)
    moved += ep_dispatch_bytes(tokens, hidden, n_experts_per_token, bytes_combine)
    return remote_fraction * moved / bandwidth


def ep_layer_comm_seconds(
    tokens: int,
    hidden: int,
    top_k: int,
    ib_copies: float,
    scale_up_bytes_per_s: float,
    scale_out_bytes_per_s: float,
    bytes_dispatch: float = 1,
    bytes_combine: float = 2,
) -> dict:
    """One MoE layer's dispatch + combine on one GPU, over both of its links (Zhao et al. 2025, ISCA, §4.3):

    * InfiniBand: each token crosses it ``ib_copies`` times — k without deduplication (each expert its
      own copy: Zhao et al.'s "8t", §4.3), the distinct nodes it reaches with it
      (:func:`course_lib.cost.expert_routing.expected_distinct_nodes`), at most M with node-limited routing —
      :func:`ep_comm_time` with k → ib_copies on the scale-out bandwidth;
    * NVLink: inside a node the copy is forwarded to each expert's GPU, at most k copies a token (the
      one landing on its expert's GPU needs no hop): :func:`ep_comm_time` on the scale-up bandwidth.

    The two links run at once (DeepEP overlaps them), so the layer takes the slower:
    {"ib_s", "nvlink_s", "seconds": max}. Bandwidth-bound, as :func:`ep_comm_time`: with
    ib_copies = k = 9, 32 tokens of 7K, FP8 dispatch and BF16 combine at 50 GB/s, ib_s is Zhao et al.
    §2.3.2's 120.96 µs.
    """
    if not 0 <= ib_copies <= top_k:
        raise ValueError(f"ib_copies={ib_copies} per token must lie in 0..top_k={top_k}")
    ib = ep_comm_time(tokens, hidden, 1, bytes_dispatch, bytes_combine, scale_out_bytes_per_s) * ib_copies
    nvlink = ep_comm_time(tokens, hidden, top_k, bytes_dispatch, bytes_combine, scale_up_bytes_per_s)
    return {"ib_s": ib, "nvlink_s": nvlink, "seconds": max(ib, nvlink)}
