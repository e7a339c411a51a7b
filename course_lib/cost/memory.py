"""Memory of training: model states under ZeRO, optimizer state per parameter. Pure arithmetic.

The ZeRO paper (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, arXiv:1910.02054, §3.1 and §5) splits what a data-parallel rank holds into *model
states* — parameters, gradients, optimizer state — and *residual states* (activations, temporary
buffers, fragmentation). This module is about the model states:

* :func:`zero_model_state_bytes` — bytes per rank that each ZeRO stage predicts (paper Figure 1);
* :func:`zero3_gathered_peak_bytes` — ZeRO-3's transient: the gathered units held at once, with prefetch;
* :func:`state_bytes`, :func:`training_bytes_per_param` — optimizer state per parameter for each
  optimizer of lecture 01, and the 16 bytes per parameter of mixed-precision Adam;
* memory-lean fine-tuning (lecture 05): :func:`galore_state_elements` (GaLore's low-rank Adam state),
  :func:`nf4_bits_per_parameter` and :func:`nf4_bytes` (QLoRA's 4-bit storage with double quantization),
  :func:`lora_elements` (LoRA's trainable parameters) and :func:`qlora_bytes`, the three together.

Activations are in :mod:`course_lib.cost.activations`, bytes moved in :mod:`course_lib.cost.collective_bytes`.
What a rank really holds is counted by :func:`course_lib.dist.census.held_bytes`, and
:mod:`course_lib.experiments.lecture02.zero_stages` sets the two side by side (tests/measure/test_memory.py); the fine-tuning formulas
meet their measurements in tests/optim/test_lowrank.py, tests/precision/test_nf4.py and tests/precision/test_qlora.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

STAGES = (0, 1, 2, 3)


def check_zero_args(n_params: int, dp_size: int, stage: int) -> None:
    if not isinstance(stage, int) or stage not in STAGES:
        raise ValueError(
            f"ZeRO stage {stage!r} does not exist: choose 0 (plain data parallel), 1 (optimizer "
            "state sharded), 2 (+ gradients) or 3 (+ parameters)"
        )
    if not isinstance(n_params, int) or n_params < 1:
        raise ValueError(f"n_params must be a positive int (Ψ, the model's parameter count), got {n_params!r}")
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int (N_d, the data-parallel ranks), got {dp_size!r}")


def zero_model_state_bytes(
    n_params: int, dp_size: int, stage: int, k: int = 12, param_bytes: int = 2, grad_bytes: int = 2
) -> float:
    """Bytes of model states per rank under ZeRO ``stage`` (ZeRO paper §3.1, §5.1-5.3, Figure 1).

    Mixed-precision Adam keeps, per parameter, a 16-bit parameter (2 bytes) and a 16-bit gradient
    (2 bytes) for the forward and backward passes, and K bytes of optimizer state: fp32 master
    weight, momentum and variance, K = 4 + 4 + 4 = 12. With Ψ parameters and N = ``dp_size`` ranks:

        stage 0 (DDP):               (2 + 2 + K)·Ψ           = 16Ψ
        stage 1 (P_os):   2Ψ + 2Ψ +   K·Ψ/N                  optimizer state sharded
        stage 2 (P_os+g): 2Ψ +      (2 + K)·Ψ/N              + gradients
        stage 3 (P_os+g+p):         (2 + 2 + K)·Ψ/N          + parameters

    The paper's example: Ψ = 7.5B, N = 64 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB. Pure fp32 training
    has no separate master copy: ``param_bytes=4, grad_bytes=4, k=8`` (momentum and variance).

    Where DeepSpeed's own estimators count differently (``estimate_zero2_model_states_mem_needs``,
    ``estimate_zero3_model_states_mem_needs`` in deepspeed.runtime.zero), and why: both charge 18Ψ/N
    for the sharded part. DeepSpeed hands its optimizer an fp32 gradient for the fp32 master weights,
    and keeps that fp32 gradient partition for the whole step: ZeRO-2 counts it next to the 16-bit
    gradient shard (2 + 4 + 12 = 18 instead of the paper's 2 + 12, so +4Ψ/N); ZeRO-3 counts it
    instead of the 16-bit one (2 + 4 + 12 = 18 instead of 2 + 2 + 12, so +2Ψ/N). ZeRO-3 adds
    4·(largest layer's parameters) for the 16-bit parameters and gradients of the layer being
    computed — a temporary buffer, a *residual* state in the paper's terms — and the CPU-side
    figures carry an ``additional_buffer_factor`` of 1.5 for staging buffers. These are costs of an
    implementation, not of the algorithm; this function is the algorithm (course_lib.parallel.data.zero casts a
    shard's gradient to fp32 only for the duration of the update, as the paper accounts).
    """
    check_zero_args(n_params, dp_size, stage)
    n = dp_size
    params = param_bytes * n_params / (n if stage >= 3 else 1)
    grads = grad_bytes * n_params / (n if stage >= 2 else 1)
    optim = k * n_params / (n if stage >= 1 else 1)
    return params + grads + optim


# ------------------------------------------------------------------ measured, for lecture 02's bars


# Elements of optimizer state per parameter element, for a dense (unfactored) parameter.
STATE_ELEMENTS = {"sgd": 0, "momentum": 1, "adagrad": 1, "rmsprop": 1, "adam": 2, "adamw": 2, "lion": 1, "adafactor": 1}


def _state_elements(name: str, shape: tuple[int, ...]) -> int:
    if name not in STATE_ELEMENTS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(STATE_ELEMENTS)}")
    shape = tuple(shape)
    if name == "adafactor" and len(shape) >= 2:
        *batch, n, m = shape
        return math.prod(batch) * (n + m)  # one row statistic per row, one column statistic per column
    return STATE_ELEMENTS[name] * math.prod(shape)


def state_bytes(name: str, shapes: Iterable, bytes_per_element: int = 4) -> int:
    """Bytes of per-element optimizer state for parameters of the given shapes.

    Counts the tensors that grow with the parameters (momentum, m, v, Adafactor's R and C). Scalar
    step counters (one per parameter tensor, not per element) are left out. ``shapes``: tensor
    shapes or the parameters themselves.
    """
    return bytes_per_element * sum(_state_elements(name, getattr(s, "shape", s)) for s in shapes)


def state_bytes_per_param(name: str, shapes: Iterable = ((1,),), bytes_per_element: int = 4) -> float:
    """:func:`state_bytes` divided by the number of parameters: 0, 4, 4, 4, 8, 8, 4 bytes for sgd, momentum,
    adagrad, rmsprop, adam, adamw, lion in fp32; for adafactor 4(n+m)/(nm) for an n×m matrix (≈ 0 for large ones)."""
    shapes = [tuple(getattr(s, "shape", s)) for s in shapes]
    n_params = sum(math.prod(s) for s in shapes)
    if n_params == 0:
        raise ValueError("no parameters given: pass the shapes (or the parameters) to count the state of")
    return state_bytes(name, shapes, bytes_per_element) / n_params


def training_bytes_per_param(
    name: str, param_bytes: int = 2, grad_bytes: int = 2, master_bytes: int = 4, state_bytes_per_element: int = 4
) -> int:
    """Weights + gradients + fp32 master copy + optimizer state, bytes per parameter (dense tensors).

    Mixed-precision Adam: 2 (bf16/fp16 weights) + 2 (grads) + 4 (fp32 master) + 8 (m, v) = 16, the
    "2Ψ + 2Ψ + 12Ψ" of ZeRO (Rajbhandari et al. 2020, §3.1). Pure fp32: param_bytes = grad_bytes = 4,
    master_bytes = 0. Adafactor's factored state is ~0 per parameter for large matrices and is
    counted as 0 here (use :func:`state_bytes` with real shapes for the exact figure).
    """
    per_element = 0 if name == "adafactor" else STATE_ELEMENTS.get(name)
    if per_element is None:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(STATE_ELEMENTS)}")
    return param_bytes + grad_bytes + master_bytes + per_element * state_bytes_per_element


def zero3_gathered_peak_bytes(unit_bytes: Sequence[int], prefetch: int = 0) -> int:
    """Most bytes of gathered ZeRO-3 parameters held at once during a step (ZeRO paper §5.3).

    ``unit_bytes`` are the units' full (padded) 16-bit parameter bytes in execution order. Stage 3
    gathers a unit just before it computes and frees it right after, so without prefetch one unit
    is gathered at a time and the transient is the largest unit. With ``prefetch = k`` the k units
    that compute next are gathered too (forward: the following ones; backward: the preceding
    ones), so the transient is the largest sum over k + 1 consecutive units. This is the memory side
    of the trade DeepSpeed's ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters``
    control: earlier all-gathers overlap compute, and cost this much more.
    """
    sizes = list(unit_bytes)
    if not sizes or any(not isinstance(b, int) or b < 0 for b in sizes):
        raise ValueError(f"unit_bytes must be non-negative ints, one per unit, got {unit_bytes!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (units gathered ahead), got {prefetch!r}")
    window = min(prefetch + 1, len(sizes))
    return max(sum(sizes[i : i + window]) for i in range(len(sizes) - window + 1))


# ------------------------------------------------------------------ memory-lean fine-tuning (lecture 05)


def galore_state_elements(shape: tuple[int, ...], rank: int) -> int:
    """Elements of optimizer state GaLore keeps for a parameter of ``shape`` (Zhao et al. 2024, "GaLore:
    Memory-Efficient LLM Training by Gradient Low-Rank Projection", Table 1): for an m×n matrix projected to
    rank r, Adam's two moments in the projected space and the projector,

        2·r·max(m, n) + r·min(m, n)        against AdamW's 2·m·n,

    and AdamW's 2·numel for vectors and for matrices with min(m, n) ≤ r (projecting them saves nothing;
    :class:`course_lib.optim.lowrank.GaLoreAdamW` keeps full moments for them)."""
    shape = tuple(shape)
    if len(shape) != 2 or min(shape) <= rank:
        return 2 * math.prod(shape)
    m, n = shape
    return 2 * rank * max(m, n) + rank * min(m, n)


def nf4_bits_per_parameter(block_size: int = 64, double_quant: bool = False, dq_block_size: int = 256) -> float:
    """Bits per parameter of NF4 storage (Dettmers et al. 2023, "QLoRA", §3, "Double Quantization"):

        4 + 32/B                      one fp32 absmax c_b per block of B = 64: 4.5 bits
        4 + 8/B + 32/(B·B₂)           c_b in 8 bits, one fp32 scale per B₂ = 256 of them: ≈ 4.127 bits

    The one fp32 mean that double quantization subtracts per tensor is not counted here (it is in
    :func:`nf4_bytes`). What :func:`course_lib.precision.nf4.quantize_nf4` stores."""
    if double_quant:
        return 4 + 8 / block_size + 32 / (block_size * dq_block_size)
    return 4 + 32 / block_size


def nf4_bytes(numel: int, block_size: int = 64, double_quant: bool = False, dq_block_size: int = 256) -> int:
    """Bytes one NF4 tensor of ``numel`` elements holds (QLoRA §3), exactly:

        numel/2 (two 4-bit codes a byte) + n_b·4 (fp32 c_b),   n_b = numel/B blocks
        numel/2 + n_b·1 (8-bit c_b) + ⌈n_b/B₂⌉·4 (fp32 scales) + 4 (fp32 mean)      with double quantization

    :func:`nf4_bits_per_parameter` is 8·this/numel when B₂ divides n_b, without the mean."""
    if numel % block_size or block_size % 2:
        raise ValueError(f"{numel} elements are not a whole number of blocks of {block_size} (an even size)")
    blocks = numel // block_size
    if double_quant:
        return numel // 2 + blocks + 4 * math.ceil(blocks / dq_block_size) + 4
    return numel // 2 + 4 * blocks


def lora_elements(shapes: Iterable, rank: int) -> int:
    """Trainable parameters of LoRA adapters on matrices of the given [d_out, d_in] ``shapes`` (Hu et al.
    2021, "LoRA", §4.1): A is r×d_in and B is d_out×r, so r·(d_in + d_out) per adapted matrix."""
    return sum(rank * sum(getattr(s, "shape", s)) for s in shapes)


def qlora_bytes(
    base_shapes: Iterable,
    adapter_shapes: Iterable,
    rank: int,
    bytes_per_element: int = 4,
    optimizer: str = "adamw",
    block_size: int = 64,
    double_quant: bool = True,
    dq_block_size: int = 256,
) -> int:
    """Bytes of a QLoRA fine-tune's model states (Dettmers et al. 2023, §2 "Memory Requirement of
    Parameter-Efficient Finetuning" and §3): the frozen base matrices in NF4 (double-quantized by default, as
    QLoRA does) plus, for the adapters, their parameters, their gradients and the optimizer's state, each
    ``bytes_per_element`` per element:

        Σ_base nf4_bytes(numel)  +  (1 + 1 + k) · bytes_per_element · Σ_adapted r·(d_in + d_out)

    with k the optimizer's state elements per parameter (2 for AdamW). The frozen base gets no gradient and
    no optimizer state: that is the whole saving. Not counted: parameters left in full precision (embeddings,
    norms, the output head) and activations (the adapter's input gradients dominate at long sequences, §2).
    ``base_shapes``/``adapter_shapes``: [d_out, d_in] shapes or the weight tensors themselves."""
    if optimizer not in STATE_ELEMENTS or optimizer == "adafactor":
        raise ValueError(
            f"optimizer must be one of {[n for n in STATE_ELEMENTS if n != 'adafactor']}, got {optimizer!r}"
        )
    base = sum(
        nf4_bytes(math.prod(getattr(s, "shape", s)), block_size, double_quant, dq_block_size) for s in base_shapes
    )
    adapters = lora_elements(adapter_shapes, rank)
    return base + (2 + STATE_ELEMENTS[optimizer]) * bytes_per_element * adapters


# ------------------------------------------------------------------ quantized KV cache (lecture 06)

KV_QUANT_MODES = ("per_channel", "per_token")


def _kv_tensors(cfg) -> list[tuple[int, int]]:
    """(heads, width) of the two tensors each attention layer caches per token: K and V for GQA (Hkv, hd) each;
    MLA's latent (1, rkv) and shared RoPE key (1, dr). Linear-attention layers cache nothing per token."""
    out = []
    for kind in cfg.layer_types:
        if kind == "linear":
            continue
        if kind == "full" and cfg.is_mla:
            out.append(((1, cfg.kv_lora_rank), (1, cfg.qk_rope_head_dim)))
        else:
            out.append(((cfg.n_kv_heads, cfg.head_dim), (cfg.n_kv_heads, cfg.head_dim)))
    return out


def _scale_groups(heads: int, width: int, group_size: int, mode: str, tokens: int) -> int:
    """(s, m) pairs stored for ``tokens`` quantized tokens of one tensor: per channel, one per channel per group of
    ``group_size`` tokens; per token, one per token per group of min(group_size, width) channels (a group never
    crosses a head)."""
    if mode == "per_channel":
        return heads * width * tokens // group_size
    return heads * tokens * (width // min(group_size, width))


def _check_kv_quant(bits: int, group_size: int, modes) -> None:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits={bits}: choose 2, 4 or 8 (codes that pack evenly into bytes)")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (tokens or channels sharing one scale)")
    for mode in modes:
        if mode not in KV_QUANT_MODES:
            raise ValueError(f"mode {mode!r}: choose one of {KV_QUANT_MODES}")


def quantized_kv_bytes_per_token(
    cfg,
    bits: int,
    group_size: int = 32,
    scale_bytes: int = 2,
    key_mode: str = "per_channel",
    value_mode: str = "per_token",
) -> float:
    """Bytes each *quantized* token adds to a KIVI cache, summed over layers: codes plus the amortised scale and
    zero point of its groups (Liu et al. 2024, "KIVI", ICML, arXiv:2402.02750, §3 and Algorithm 1). For a tensor
    of E = heads·width elements per token,

        E·b/8  +  2·scale_bytes·E/G        per channel (keys: one (s, m) per channel per G tokens)
        E·b/8  +  2·scale_bytes·E/G'       per token (values: one (s, m) per G' = min(G, width) channels)

    i.e. b + 2·16/G bits per element with fp16 scales: 4-bit, G = 32 gives 5 bits, 3.2x below bf16's 16. What
    :class:`course_lib.inference.quantized_cache.QuantizedCache` stores per token once it is out of the full-precision
    window; :func:`quantized_kv_cache_bytes` adds the window. GQA: K and V; MLA: the latent counts as the key
    and the shared RoPE key as the value (``key_mode``, ``value_mode``)."""
    _check_kv_quant(bits, group_size, (key_mode, value_mode))
    total = 0.0
    for pair in _kv_tensors(cfg):
        for (heads, width), mode in zip(pair, (key_mode, value_mode)):
            groups_per_token = (
                heads * width / group_size if mode == "per_channel" else heads * (width // min(group_size, width))
            )
            total += heads * width * bits / 8 + 2 * scale_bytes * groups_per_token
    return total


def kv_window_tokens(context: int, group_size: int = 32, residual: int = 32) -> int:
    """Tokens a KIVI cache of ``context`` tokens keeps in full precision: the newest R = ``residual`` and the
    unfinished group beyond them, R + ((n − R) mod G) once n ≥ R, else all n. The other G·⌊(n − R)/G⌋ are
    quantized, a whole group of G at a time (KIVI Algorithm 1: a key group needs G tokens per channel)."""
    if context < 0 or residual < 0 or group_size < 1:
        raise ValueError(f"need context >= 0, residual >= 0, group_size >= 1; got {context}, {residual}, {group_size}")
    return context - group_size * max(0, (context - residual) // group_size)


def quantized_kv_cache_bytes(
    cfg,
    context: int,
    bits: int,
    group_size: int = 32,
    residual: int = 32,
    scale_bytes: int = 2,
    bytes_per_element: int = 2,
    key_mode: str = "per_channel",
    value_mode: str = "per_token",
) -> int:
    """Bytes a KIVI cache holds for one sequence of ``context`` tokens, exactly:

        quantized tokens × :func:`quantized_kv_bytes_per_token`  +  window tokens × the full-precision bytes per token

    with the window of :func:`kv_window_tokens` held at ``bytes_per_element`` (the model's dtype; scales are
    stored in it too, so ``scale_bytes = bytes_per_element`` describes QuantizedCache). The window is the
    term that does not shrink with b: R + G − 1 tokens at most. Integer arithmetic, so it can equal a
    measurement (:meth:`course_lib.inference.quantized_cache.QuantizedCache.stored_bytes`, divided by the batch)."""
    _check_kv_quant(bits, group_size, (key_mode, value_mode))
    window = kv_window_tokens(context, group_size, residual)
    n_q = context - window
    total = 0
    for pair in _kv_tensors(cfg):
        for (heads, width), mode in zip(pair, (key_mode, value_mode)):
            codes = heads * width * n_q * bits // 8
            scales = 2 * scale_bytes * _scale_groups(heads, width, group_size, mode, n_q)
            total += codes + scales + bytes_per_element * heads * width * window
    return total
