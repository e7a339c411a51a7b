"""Seconds of one training step on real accelerators, from the work each rank does: no MFU input.

The planner (:mod:`course_lib.cost.planner`) uses this for devices that each have their own chip. A
rank's time for one micro-batch through its layers is the sum of what it computes and what it
waits for. Each term comes from the model's shapes, the accelerator's table
(:mod:`course_lib.cost.hardware`) and one measured constant:

**GEMMs**, each weight matrix on its own (:func:`layer_gemms`). Its time is the roofline of its shape
(Williams et al. 2009): max(2·M·n·k / (peak · η), bytes / HBM bandwidth), M the rows it multiplies.
η is :data:`GEMM_EFFICIENCY`, the fraction of the datasheet peak a large GEMM sustains at scale, one
constant per accelerator fitted once on published runs (and below what one GPU measured). Backward
runs two GEMMs of the same shape: dX = dY·Wᵀ and dW = Xᵀ·dY. Under FP8 every layer GEMM runs at
the FP8 peak. Attention's core, the router and the output head stay in BF16 (DeepSeek-V3 report §3.3.1).

**Attention's core** (QKᵀ and P·V) runs at the BF16 η. A causal kernel skips the masked half, so a
query sees s/2 keys on average (FlashAttention-2, Dao 2023, §3.1.1). Backward does five matmuls
to forward's two (FlashAttention-2, Algorithm 2): 2.5× forward.

**Memory-bound operations.** Norms, residual adds, RoPE, SwiGLU's product and MoE's permutations
move bytes at HBM bandwidth (:func:`elementwise_bytes_per_token`). Backward moves twice as much.

**Communication.** Each collective uses the α-β model on its group's link
(:func:`course_lib.cost.links.link_alpha_beta`). It is exposed unless a real stack hides it:

* TP with sequence parallelism: 2 all-gathers and 2 reduce-scatters of b·s·h per layer, forward and
  backward alike (Korthikanti et al. 2022, §4.2.2). They are exposed, except with ``tp_overlap``:
  Megatron-Core's ``--tp-comm-overlap`` splits each GEMM to hide them, so only what outlasts the GEMMs shows.
* CP all-gathers K and V forward and reduce-scatters their gradients backward (Llama 3 §3.3.2,
  all-gather-based CP). Exposed.
* EP: the dispatch and combine all-to-alls of each MoE layer, forward and backward. InfiniBand
  carries each token once per node it reaches, NVLink once per expert
  (:func:`course_lib.cost.expert_dispatch.ep_layer_comm_seconds`). Exposed, except under DualPipe: it
  overlaps one micro-batch's communication with another's compute (DeepSeek-V3 §3.2.1). There only
  what outlasts the compute shows, and the compute runs on 112 of the 132 SMs, since 20 are kept for
  communication (§3.2.2).
* PP: one send per micro-batch and boundary, posted asynchronously. Only the pipeline's fill,
  2·(pp − 1) messages, is on the critical path.
* DP: gradients are reduced while backward goes on (PyTorch DDP, Li et al. VLDB 2020, §3.2.3). Only
  what outlasts the backward of the micro-batch that produced them shows: the last one under ZeRO 0/1,
  every one under ZeRO-2 and 3, which reduce-scatter each micro-batch's gradients. ZeRO 1-3
  all-gather parameters, and that gather overlaps a forward pass.

**The step** (:func:`step_seconds`): with F and B the busiest rank's forward and backward of one
micro-batch,

    1F1B, interleaved   (m + (pp − 1)/v)·(F + B)    bubble (p − 1)/(v·m) of the work (Narayanan et al. 2021, §2.2)
    DualPipe            m·(F + B) + (pp/2 − 1)·(F + 2B − 3W)   (DeepSeek-V3 Table 2; W: weight gradients)

plus the pipeline's fill, the exposed DP time and the optimizer step. The optimizer step is memory-bound:
~30 bytes of fp32 state read and written per local parameter. Recomputation adds to B: "full"
repeats F; "selective" repeats the attention core and the memory-bound operations (Korthikanti et al.
§5; DeepSeek-V3 §3.2.3 recomputes RMSNorm and MLA's up-projections).
"""

from __future__ import annotations

from course_lib.cost.alpha_beta import collective_seconds
from course_lib.cost.expert_dispatch import ep_layer_comm_seconds
from course_lib.cost.expert_routing import expected_distinct_nodes
from course_lib.cost.flops import matmul_bytes, matmul_flops
from course_lib.cost.roofline import roofline_flops
from course_lib.model.config import ModelConfig

GEMM_EFFICIENCY = {"H100": 0.65}
"""η: the fraction of the datasheet peak that a large GEMM sustains in a training run at scale, per
accelerator and for every precision. Fitted once: :func:`course_lib.cost.published.fit_efficiency`
picks the η that minimises the largest error over the calibration runs (Llama 3 405B, Table 4; DeepSeek-V3).
Measured on one H100 80GB HBM3 with ``./course gpu-check`` (2026-11-28, BENCHMARKS.md), one large GEMM
reaches more than that: torch.matmul at 8192³ in bf16 reached 775 TFLOP/s (0.78), and ``torch._scaled_mm``
1.41 PFLOP/s in FP8 (0.71). A run at scale sustains less: clocks under a power cap, GEMMs cut by tensor
parallelism, gaps between kernels. The H800 has the H100's compute (Zhao et al., ISCA 2025, §4.1) and
uses its η. Any other part is assumed to reach the H100's fraction (:func:`efficiency` says so)."""
SAME_SILICON = {"H800": "H100"}
DUALPIPE_COMPUTE_SHARE = 112 / 132  # DeepSeek-V3 §3.2.2: 20 of an H800's 132 SMs run communication
OPTIMIZER_BYTES_PER_PARAM = 30  # fp32 master, m, v read + written (24), fp32 grad read (4), bf16 write (2)
ATTENTION_BACKWARD = 2.5  # FlashAttention-2, Algorithm 2: five matmuls backward, two forward


def efficiency(accelerator: str) -> tuple[float, bool]:
    """(η, fitted for this part?) of ``accelerator``'s GEMMs (:data:`GEMM_EFFICIENCY`)."""
    name = SAME_SILICON.get(accelerator, accelerator)
    if name in GEMM_EFFICIENCY:
        return GEMM_EFFICIENCY[name], True
    return GEMM_EFFICIENCY["H100"], False


def layer_gemms(cfg: ModelConfig, i: int) -> list[tuple[str, int, int, float]]:
    """The weight GEMMs a token goes through in layer ``i``: (name, n_out, k_in, times per token).

    Times per token is k for routed experts (top-k), else 1. Together their n·k·times equal the layer's
    active matmul parameters (:meth:`ModelConfig.layer_params` with ``active=True``, less the norms).
    """
    d, h = cfg.d_model, cfg.n_heads
    kind = cfg.layer_types[i]
    out: list[tuple[str, int, int, float]] = []
    if kind == "linear":  # Gated DeltaNet: the projections; its conv and gains are O(d) a token
        kd, vd = cfg.linear_n_k_heads * cfg.linear_k_head_dim, cfg.linear_n_v_heads * cfg.linear_v_head_dim
        out += [("in_proj", 2 * kd + 2 * vd + 2 * cfg.linear_n_v_heads, d, 1), ("out_proj", d, vd, 1)]
    elif cfg.is_mla:
        qk, rq, rkv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        out += [("q_a", rq, d, 1), ("q_b", h * qk, rq, 1)] if rq else [("q", h * qk, d, 1)]
        out += [
            ("kv_a", rkv + cfg.qk_rope_head_dim, d, 1),
            ("kv_b", h * (cfg.qk_nope_head_dim + cfg.v_head_dim), rkv, 1),
        ]
        out += [("o", d, h * cfg.v_head_dim, 1)]
    else:
        q_out = h * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
        kv = cfg.n_kv_heads * cfg.head_dim
        out += [("q", q_out, d, 1), ("k", kv, d, 1), ("v", kv, d, 1), ("o", d, h * cfg.head_dim, 1)]
    if cfg.is_moe_layer(i):
        f = cfg.moe_d_ff
        out += [("router", cfg.n_routed_experts, d, 1)]
        for name, times in (("expert", cfg.n_activated_experts), ("shared", cfg.n_shared_experts)):
            if times:
                out += [(f"{name}_gate", f, d, times), (f"{name}_up", f, d, times), (f"{name}_down", d, f, times)]
    else:
        out += [("gate", cfg.d_ff, d, 1), ("up", cfg.d_ff, d, 1), ("down", d, cfg.d_ff, 1)]
    return out


def elementwise_bytes_per_token(cfg: ModelConfig, i: int, bytes_per_element: int = 2) -> float:
    """Bytes the memory-bound operations of layer ``i`` move per token, forward.

    Two RMSNorms read and write d each (4d). Two residual adds read 2d and write d (6d). RoPE reads
    and writes the queries and keys. SwiGLU's product reads two f-wide halves and writes one (3f).
    An MoE layer also permutes each token's k copies to the experts and back, then sums them
    ((3k + 1)·d). Counted at this level, fusion can only lower the figure.
    """
    d = cfg.d_model
    if cfg.is_mla:
        qk = cfg.n_heads * cfg.qk_rope_head_dim + cfg.qk_rope_head_dim  # only the decoupled RoPE part rotates
    else:
        qk = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim
    if cfg.is_moe_layer(i):
        k = cfg.n_activated_experts
        f = (k + cfg.n_shared_experts) * cfg.moe_d_ff
        moe = (3 * k + 1) * d
    else:
        f, moe = cfg.d_ff, 0
    return bytes_per_element * (10 * d + 2 * qk + 3 * f + moe)


def _gemm_seconds(m: float, n: float, k: float, peak: float, eta: float, bandwidth: float, bpe: float) -> float:
    """One GEMM [m, k]·[k, n] at the roofline's attainable rate (:func:`course_lib.cost.roofline.roofline_flops`)
    under the sustained peak η·peak: compute-bound or memory-bound, whichever is slower."""
    flops = matmul_flops(m, n, k)
    return flops / roofline_flops(flops / matmul_bytes(m, n, k, bpe), peak * eta, bandwidth)


def _gemms_seconds(cfg, cluster, layout, i: int, tokens: float) -> float:
    """Forward seconds of layer ``i``'s weight GEMMs on one rank for ``tokens`` rows (:func:`layer_gemms`).

    Dense and shared-expert matrices are split over tp (Megatron: n or k of each matrix, the same FLOPs).
    Routed experts are whole matrices, E/ep of them on each rank, each multiplying the rows routed to it:
    tokens·k·ep/E on average over an ep group that sends its tokens to every rank's experts alike.
    """
    ly, acc = layout, cluster.device
    bw, fp8 = acc.hbm_bytes_per_s.value, cluster.precision == "fp8"
    total = 0.0
    for name, n, k, times in layer_gemms(cfg, i):
        high = name == "router"  # BF16 even in an FP8 run (DeepSeek-V3 §3.3.1: the gating module)
        peak, eta = _peak(cluster, "bf16" if high or not fp8 else "fp8")
        bpe = 1 if fp8 and not high else 2
        if name.startswith("expert"):
            experts = cfg.n_routed_experts / ly.ep
            rows = tokens * times * ly.ep / cfg.n_routed_experts
            total += experts * _gemm_seconds(rows, n, k, peak, eta, bw, bpe)
        else:
            total += _gemm_seconds(tokens * times, n / ly.tp, k, peak, eta, bw, bpe)
    return total


def _peak(cluster, precision: str) -> tuple[float, float]:
    """(peak FLOP/s, η) of the cluster's device in ``precision``; a given ``peak_flops`` is already sustained."""
    if cluster.peak_flops is not None:
        return cluster.peak_flops, 1.0
    eta = cluster.gemm_efficiency if cluster.gemm_efficiency is not None else efficiency(cluster.device.name)[0]
    return cluster.device.peak_flops(precision), eta


def rank_pass_seconds(cfg: ModelConfig, cluster, layout, layers, seq_len: int) -> dict[str, float]:
    """One micro-batch through ``layers`` (indices) on one rank: {"F", "B", "W" (backward's weight-gradient
    GEMMs), "compute" (F + B without communication), "exposed" (communication on the critical path, by
    axis), "parts" (forward seconds of "gemm", "attention", "memory"; one pass of "tp", "cp", "ep")}.
    ``cluster``, ``layout``: the planner's."""
    ly, acc = layout, cluster.device
    tokens = ly.micro_batch * seq_len / ly.cp  # rows this rank multiplies (SP gathers them before a GEMM)
    bw = acc.hbm_bytes_per_s.value
    peak16, eta16 = _peak(cluster, "bf16")
    parts = dict.fromkeys(("gemm", "attention", "memory", "tp", "cp", "ep"), 0.0)
    act = tokens * cfg.d_model * 2  # one micro-batch's hidden state in bf16, whole (SP splits it over tp)
    d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
    d_v = cfg.v_head_dim if cfg.is_mla else cfg.head_dim
    # Layers of one kind (attention type, dense or MoE) cost the same: each kind is timed once, times its count.
    kinds: dict[tuple[str, bool], list[int]] = {}
    for i in layers:
        kinds.setdefault((cfg.layer_types[i], cfg.is_moe_layer(i)), []).append(i)
    for (kind, moe), same in kinds.items():
        i, n = same[0], len(same)
        parts["gemm"] += n * _gemms_seconds(cfg, cluster, ly, i, tokens)
        keys = {"full": seq_len / 2, "sliding": min(seq_len / 2, cfg.sliding_window), "linear": 0}[kind]
        parts["attention"] += n * 2 * tokens * keys * cfg.n_heads / ly.tp * (d_qk + d_v) / (peak16 * eta16)
        parts["memory"] += n * tokens * elementwise_bytes_per_token(cfg, i) / ly.tp / bw
        if ly.tp > 1:
            ab = cluster.link(ly.tp)[1]
            parts["tp"] += n * sum(
                collective_seconds(name, nbytes, ly.tp, *ab) for name, nbytes in tp_layer_collectives(act)
            )
        if ly.cp > 1:  # K and V of the whole sequence, bf16; MLA gathers its compressed latent (DeepSeek-V2 §2.1)
            per_token = (
                cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.is_mla else 2 * cfg.n_kv_heads * cfg.head_dim / ly.tp
            )
            kv = ly.micro_batch * seq_len * per_token * 2
            parts["cp"] += n * collective_seconds("all_gather", kv, ly.cp, *cluster.link(ly.tp * ly.cp)[1])
        if ly.ep > 1 and moe:
            parts["ep"] += n * _ep_layer_seconds(cfg, cluster, ly, tokens)
    share = DUALPIPE_COMPUTE_SHARE if (ly.schedule == "dualpipe" and ly.ep > 1) else 1.0
    f_compute = (parts["gemm"] + parts["attention"] + parts["memory"]) / share
    w = parts["gemm"] / share  # the weight-gradient GEMMs: one of backward's two
    b_compute = (2 * parts["gemm"] + ATTENTION_BACKWARD * parts["attention"] + 2 * parts["memory"]) / share
    if ly.recompute == "full":
        b_compute += f_compute
    elif ly.recompute == "selective":
        b_compute += (parts["attention"] + parts["memory"]) / share
    tp_f, tp_b = parts["tp"], parts["tp"]
    if ly.tp_overlap:  # Megatron-Core's --tp-comm-overlap: hidden behind the GEMMs they feed
        tp_f, tp_b = max(0.0, tp_f - parts["gemm"]), max(0.0, tp_b - 2 * parts["gemm"])
    exposed = {"tp": tp_f + tp_b, "cp": 2 * parts["cp"]}
    F = f_compute + tp_f + parts["cp"]  # EP's all-to-alls are added per schedule, in step_seconds
    B = b_compute + tp_b + parts["cp"]
    return {
        "F": F,
        "B": B,
        "W": w,
        "compute": f_compute + b_compute,
        "exposed": exposed,
        "ep": parts["ep"],
        "parts": parts,
    }


def tp_layer_collectives(act_bytes: float) -> list[tuple[str, float]]:
    """The collectives of one layer's forward (or backward) on a TP group, with sequence parallelism: an
    all-gather of the hidden state before attention and before the MLP, a reduce-scatter after each
    (Korthikanti et al. 2022, §4.2.2). ``act_bytes``: the whole hidden state, b·s·h elements. Without
    sequence parallelism Megatron runs 2 all-reduces instead, which move the same bytes per rank
    (2(N − 1)/N of the buffer each, :mod:`course_lib.cost.alpha_beta`): tests/measure/test_simulated_ranks.py
    compares the composed step's all-reduces with these."""
    return [("all_gather", act_bytes), ("reduce_scatter", act_bytes)] * 2


def _ep_layer_seconds(cfg: ModelConfig, cluster, layout, tokens: float) -> float:
    """One MoE layer's dispatch and combine on one rank, one pass. The ep group's ranks fill whole nodes
    (DeepSeek-V3 §3.2: EP 64 over 8 nodes), so it spans ep·tp·cp / devices_per_node of them; each token
    crosses the network once per node it reaches (at most ``ep_node_limit``), NVLink once per expert."""
    ly = layout
    nodes = max(1, ly.ep * ly.tp * ly.cp // cluster.devices_per_node)
    k = cfg.n_activated_experts
    copies = 0.0
    if nodes > 1:
        copies = expected_distinct_nodes(cfg.n_routed_experts, nodes, k, ly.ep_node_limit or None)
    up = 1 / cluster.link(1)[1][1]
    out = 1 / cluster.link(cluster.devices_per_node + 1)[1][1]
    dispatch = 1 if cluster.precision == "fp8" else 2  # DeepSeek-V3 §3.3: FP8 dispatch, BF16 combine
    return ep_layer_comm_seconds(int(tokens), cfg.d_model, k, copies, up, out, dispatch, 2)["seconds"]


def step_seconds(cfg: ModelConfig, cluster, layout, global_batch: int, seq_len: int, stage_params: float) -> dict:
    """Seconds of one step by term, on the busiest pipeline rank (module docstring).

    ``stage_params``: the parameters that rank holds (its ZeRO shard is what the optimizer updates).
    Returns {"compute", "bubble", "optimizer"} and, where they are not zero, the exposed communication
    {"tp", "cp", "ep", "pp", "dp"}: their sum is the step."""
    ly = layout
    m = global_batch // (ly.dp * ly.micro_batch)
    passes = [rank_pass_seconds(cfg, cluster, ly, _rank_layers(cfg, ly, r), seq_len) for r in range(ly.pp)]
    head = _head_seconds(cfg, cluster, ly, seq_len)
    last = passes[-1]  # the output layer and the loss run on the last rank: forward, and two backward GEMMs
    last["F"], last["B"], last["W"], last["compute"] = (
        last["F"] + head,
        last["B"] + 2 * head,
        last["W"] + head,
        last["compute"] + 3 * head,
    )
    if ly.balanced:  # stages sized so every rank does the same work (Llama 3 §3.3.2 moved blocks off the ends)
        busy = {k: sum(p[k] for p in passes) / ly.pp for k in ("F", "B", "W", "compute")}
        busy["exposed"] = {k: sum(p["exposed"][k] for p in passes) / ly.pp for k in passes[0]["exposed"]}
        busy["ep"] = sum(p["ep"] for p in passes) / ly.pp
    else:
        busy = max(passes, key=lambda p: p["F"] + p["B"] + 2 * p["ep"])
    F, B, W, ep = busy["F"], busy["B"], busy["W"], busy["ep"]
    out = {"compute": m * busy["compute"]}
    out.update({k: m * v for k, v in busy["exposed"].items() if v > 0})
    if ly.schedule == "dualpipe":
        # DualPipe's first rank runs 3·pp/2 − 1 forward chunks and as many backward chunks alone (its
        # steps 1-3 and 5-7: deepseek-ai/DualPipe, dualpipe.py), their all-to-alls exposed; the other
        # m − (3·pp/2 − 1) pair a forward with a backward, whose compute hides the pair's all-to-alls.
        alone = min(m, 3 * ly.pp // 2 - 1)
        out["ep"] = alone * 2 * ep + (m - alone) * max(0.0, 2 * ep - (F + B))
        out["bubble"] = max(0.0, ly.pp / 2 - 1) * (F + 2 * B - 3 * W)  # DeepSeek-V3 Table 2, F&B = F + B
    else:
        out["ep"] = m * 2 * ep
        out["bubble"] = (ly.pp - 1) / ly.virtual_stages * (F + B + 2 * ep)
    if out["ep"] == 0:
        del out["ep"]
    if ly.pp > 1:
        act = ly.micro_batch * seq_len / ly.cp * cfg.d_model * 2 / ly.tp
        out["pp"] = 2 * (ly.pp - 1) * collective_seconds("p2p", act, 2, *cluster.link(ly.tp * ly.cp * ly.pp)[1])
    out["dp"] = _dp_exposed(cluster, ly, m, stage_params, F, B)
    shard = ly.dp if ly.zero >= 1 else 1
    out["optimizer"] = OPTIMIZER_BYTES_PER_PARAM * stage_params / shard / cluster.device.hbm_bytes_per_s.value
    return out


def _rank_layers(cfg: ModelConfig, layout, r: int) -> list[int]:
    """The layers pipeline rank ``r`` holds: its v chunks of L/(pp·v) consecutive layers, r, r + pp, ..."""
    chunks = layout.pp * layout.virtual_stages
    return [
        i
        for c in range(r, chunks, layout.pp)
        for i in range(c * cfg.n_layers // chunks, (c + 1) * cfg.n_layers // chunks)
    ]


def _head_seconds(cfg: ModelConfig, cluster, layout, seq_len: int) -> float:
    """Forward of the output layer (d → V, BF16, split over tp) on the last rank."""
    tokens = layout.micro_batch * seq_len / layout.cp
    peak, eta = _peak(cluster, "bf16")
    bw = cluster.device.hbm_bytes_per_s.value
    return _gemm_seconds(tokens, cfg.vocab_size / layout.tp, cfg.d_model, peak, eta, bw, 2)


def _dp_exposed(cluster, layout, m: int, params: float, F: float, B: float) -> float:
    """What data parallelism adds to the step: gradient reductions that outlast the backward they
    overlap, and parameter gathers that outlast a forward (module docstring)."""
    ly = layout
    if ly.dp == 1:
        return 0.0
    ab = cluster.link(cluster.n_devices)[1]
    grads = params * 2  # bf16 gradients
    if ly.zero == 0:
        return max(0.0, collective_seconds("ring_all_reduce", grads, ly.dp, *ab) - B)
    rs = collective_seconds("reduce_scatter", grads, ly.dp, *ab)
    gather = max(0.0, collective_seconds("all_gather", grads, ly.dp, *ab) - F)
    if ly.zero == 1:
        return max(0.0, rs - B) + gather
    per_microbatch = max(0.0, rs - B) + (
        max(0.0, collective_seconds("all_gather", grads, ly.dp, *ab) - B) if ly.zero == 3 else 0.0
    )
    return m * per_microbatch + gather
