"""course_lib.cost — every formula of the course, pure arithmetic, each citing its source.

* :mod:`~course_lib.cost.memory`              — model states under ZeRO, optimizer state per parameter; GaLore, NF4, LoRA, QLoRA bytes
* :mod:`~course_lib.cost.activations`         — activation bytes per layer (Korthikanti et al. 2022), attention per rank
* :mod:`~course_lib.cost.collective_bytes`    — bytes each rank moves: ring collectives, ZeRO, ring attention, Ulysses, 2D/3D TP
* :mod:`~course_lib.cost.alpha_beta`          — the alpha-beta time of ring/tree collectives, all-to-all and p2p; α, β fitted
* :mod:`~course_lib.cost.ddp_timeline`        — DDP's buckets: the bucket-size trade-off, one modelled step's timeline
* :mod:`~course_lib.cost.tp_comm_time`        — Megatron TP's all-reduce seconds per layer, their share of a block
* :mod:`~course_lib.cost.expert_dispatch`     — expert parallelism's dispatch/combine bytes (FP8, padded) and seconds
* :mod:`~course_lib.cost.expert_routing`      — distinct nodes a routed token reaches (node-limited routing)
* :mod:`~course_lib.cost.links`               — an accelerator's links as (α, β); one step's TP and EP time on them
* :mod:`~course_lib.cost.compression_payload` — bytes per bucket of Top-K, QSGD, sign and PowerSGD compression
* :mod:`~course_lib.cost.hardware`            — the accelerator table: compute per precision, HBM, links, power, each figure sourced
* :mod:`~course_lib.cost.roofline`            — attainable FLOP/s against intensity; the course model's kernels placed on it
* :mod:`~course_lib.cost.checkpoint`          — checkpoint bytes (full, incremental, quantized), Young/Daly checkpoint interval
* :mod:`~course_lib.cost.alignment`           — padding to a multiple, GEMM tile utilisation
* :mod:`~course_lib.cost.flops`               — FLOPs per token (6N + attention), MFU, matmul FLOPs, bytes and arithmetic intensity
* :mod:`~course_lib.cost.pipeline`            — pipeline bubble, micro-batches in flight per schedule, P2P bytes
* :mod:`~course_lib.cost.dollars`             — GPU-hours and what they cost; total cost of ownership (capex, power, utilisation)
* :mod:`~course_lib.cost.overlap`             — when a transfer hides behind compute (ring attention's block size)
* :mod:`~course_lib.cost.step_time`           — a training step's seconds from each rank's GEMMs, memory traffic and exposed communication
* :mod:`~course_lib.cost.published`           — published runs (Llama 3 405B, DeepSeek-V3) as their papers state them; the η fit
* :mod:`~course_lib.cost.planner`             — the auto-planner: every layout's memory and step time, ranked and explained

Nothing here launches ranks or touches a tensor; :mod:`course_lib.measure` measures what these predict.

The calculators of the frontier-architecture lecture, at the package level:

    cost.param_count(cfg)                         (total, active per token) parameters
    cost.kv_cache_bytes_per_token(cfg, 2)         KV-cache bytes each token adds (MHA, GQA, MQA, MLA)
    cost.train_flops_per_token(cfg, seq_len)      6N + attention (cost.flops)
    cost.training_cost(gpu_hours, usd_per_hour)   dollars (cost.dollars)
    cost.ep_comm_time(tokens, hidden, k, bytes_dispatch, bytes_combine, bandwidth)   (cost.expert_dispatch)
"""

from __future__ import annotations

from course_lib.cost.dollars import training_cost
from course_lib.cost.expert_dispatch import ep_comm_time
from course_lib.cost.flops import train_flops_per_token


def param_count(cfg) -> tuple[int, int]:
    """(total parameters, parameters one token multiplies with): ``ModelConfig.n_params`` and
    ``n_active_params``, where the formulas live."""
    return cfg.n_params(), cfg.n_active_params()


def kv_cache_bytes_per_token(cfg, bytes_per_element: int = 2) -> int:
    """KV-cache bytes per token of context: ``ModelConfig.kv_cache_bytes_per_token``."""
    return cfg.kv_cache_bytes_per_token(bytes_per_element)


__all__ = ["ep_comm_time", "kv_cache_bytes_per_token", "param_count", "train_flops_per_token", "training_cost"]
