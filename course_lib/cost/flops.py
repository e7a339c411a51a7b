"""Compute of training: FLOPs per token, model FLOPs utilisation, arithmetic intensity. Pure arithmetic.

* :func:`matmul_params`, :func:`train_flops_per_token` — the "6N" rule with its attention term
  (Kaplan et al. 2020, §2.1; Chowdhery et al. 2022, PaLM, Appendix B);
* :func:`mfu` — model FLOPs utilisation (PaLM, §4.1 and Appendix B);
* :func:`matmul_flops`, :func:`matmul_bytes`, :func:`arithmetic_intensity` — the arithmetic intensity of
  a matmul, the x-axis of the roofline model (Williams, Waterman & Patterson 2009, "Roofline: an
  insightful visual performance model for multicore architectures", CACM 52(4)); the roofline itself,
  on the accelerators of :mod:`course_lib.cost.hardware`, is :mod:`course_lib.cost.roofline`.

A FLOP here is one floating-point addition or multiplication, so a multiply-add counts 2, as in the
papers and in ``torch.utils.flop_counter.FlopCounterMode``. :mod:`course_lib.measure.flop_counter` counts
and times what these predict; tests/cost/test_flops.py sets them side by side.
"""

from __future__ import annotations

from course_lib.model.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that one token multiplies with: N of the 6N rule.

    ``cfg.n_active_params()`` (which already leaves out the embedding table: a lookup reads one row
    and does no arithmetic) minus the RMSNorm gains, 2 per layer and 1 final, of ``d_model`` each:
    they scale elementwise, O(d) work per token against O(d²) for the matrices. Kaplan et al. (2020,
    §2.1) drop all embedding parameters from N; the output projection is a real d × V matmul, so it
    is counted here, as in PaLM's N. Exact for the course's dense GQA model (a test counts it).
    """
    return cfg.n_active_params() - (2 * cfg.n_layers + 1) * cfg.d_model


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token of the two attention matmuls, QKᵀ and softmax(·)·V, over all layers.

    Forward, per layer and token: 2·T·H·d_qk for the scores of one query against T keys, and
    2·T·H·d_v for the weighted sum of values; backward twice that. For d_qk = d_v = Q (head_dim)
    this is PaLM's 12·L·H·Q·T (Chowdhery et al. 2022, Appendix B). Like PaLM it counts the whole
    T × T score matrix, although a causal mask makes half of it zero and a causal kernel may skip
    that half. Kaplan et al. (2020, §2.1, Table 1) count only the scores: 6·L·T·d_attn. A sliding
    layer sees min(T, window) keys; a linear-attention layer has no T × T term (its O(T·d²) state
    updates are left out).
    """
    d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
    d_v = cfg.v_head_dim if cfg.is_mla else cfg.head_dim
    keys = {"full": seq_len, "sliding": min(seq_len, cfg.sliding_window), "linear": 0}
    return sum(6 * keys[kind] * cfg.n_heads * (d_qk + d_v) for kind in cfg.layer_types)


def train_flops_per_token(cfg: ModelConfig, seq_len: int, attention: bool = True) -> int:
    """Matmul FLOPs of one training step (forward + backward), per token: 6N + 12·L·H·Q·T.

    Every weight matrix W [k, n] is used once per token in the forward pass, 2·k·n FLOPs, and twice
    in the backward pass: once for the gradient of the input (dX = dY·Wᵀ) and once for the gradient
    of the weight (dW = Xᵀ·dY), 2·k·n each. Summed over the matrices that is 2N + 4N = 6N (Kaplan et
    al. 2020, §2.1: C ≈ 6N per token, "C_forward ≈ 2N + 2·n_layer·n_ctx·d_model"). The attention
    matmuls have no weights and are added by :func:`attention_flops_per_token` (PaLM, Appendix B:
    6N + 12·L·H·Q·T). Left out: elementwise work (norms, SiLU, RoPE, softmax, the optimizer), O(d)
    per token, and any recomputation (activation checkpointing), which costs hardware FLOPs but
    not model FLOPs.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be ≥ 1, got {seq_len}")
    return 6 * matmul_params(cfg) + (attention_flops_per_token(cfg, seq_len) if attention else 0)


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops_per_second: float) -> float:
    """Model FLOPs utilisation: the model FLOPs a run achieves per second over the hardware's peak.

    PaLM (Chowdhery et al. 2022, §4.1 and Appendix B) defines it with *model* FLOPs (the formula of
    :func:`train_flops_per_token`), so that recomputation or a wasteful kernel does not raise the
    figure; "hardware FLOPs utilisation" counts what the chips executed. PaLM 540B: 46.2% MFU.
    """
    if peak_flops_per_second <= 0:
        raise ValueError(f"peak_flops_per_second must be > 0, got {peak_flops_per_second}")
    return tokens_per_second * flops_per_token / peak_flops_per_second


def matmul_flops(m: int, n: int, k: int) -> int:
    """C[m, n] = A[m, k]·B[k, n]: m·n dot products of length k, each k multiplies and k adds: 2·m·n·k."""
    return 2 * m * n * k


def matmul_bytes(m: int, n: int, k: int, bytes_per_element: float) -> float:
    """The least bytes C[m, n] = A[m, k]·B[k, n] moves between memory and the chip: read A and B once,
    write C once, bytes_per_element·(mk + kn + mn) (Williams et al. 2009's compulsory traffic).

    The backward pass's two matmuls of a weight, dX = dY·Wᵀ and dW = Xᵀ·dY, touch the same three
    sizes (m·n, n·k, m·k) in another order, so they move the same bytes and do the same FLOPs.
    """
    if min(m, n, k) <= 0 or bytes_per_element <= 0:
        raise ValueError(f"need positive sizes and bytes_per_element, got m={m}, n={n}, k={k}, {bytes_per_element}")
    return bytes_per_element * (m * k + k * n + m * n)


def arithmetic_intensity(m: int, n: int, k: int, bytes_per_element: float) -> float:
    """FLOPs per byte moved for C[m, n] = A[m, k]·B[k, n]: 2mnk / (bytes·(mk + kn + mn)).

    The bytes are the least any kernel must move (:func:`matmul_bytes`; Williams et al. 2009 call the
    ratio the operational intensity). Square n × n matrices: n/3 FLOP/byte in bf16, n/6 in fp32, so
    big matmuls are compute-bound. A matrix-vector product (m = 1, one token decoding) is
    ≈ 2/bytes_per_element FLOP/byte whatever its size: memory-bound. Where that falls on each
    accelerator: :mod:`course_lib.cost.roofline`.
    """
    if min(m, n, k) < 1:
        raise ValueError(f"need positive sizes, got m={m}, n={n}, k={k}")
    return matmul_flops(m, n, k) / matmul_bytes(m, n, k, bytes_per_element)


def gpt_block_forward_flops(tokens: int, hidden: int, seq_len: int) -> float:
    """Forward FLOPs of one GPT block (4h MLP, full attention) for ``tokens`` tokens of length ``seq_len``:
    24·T·h²·(1 + s/(6h)) — the four h×h projections and the MLP, plus the attention scores and their
    weighted sum (Narayanan et al. 2021, §5.1). For the course's own models use :func:`train_flops_per_token`.
    """
    return 24 * tokens * hidden**2 * (1 + seq_len / (6 * hidden))
