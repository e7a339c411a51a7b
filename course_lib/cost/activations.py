"""Activation memory per transformer layer: Korthikanti et al.'s model, adapted to the course model,
and what each recomputation policy keeps and costs. What autograd actually keeps is measured by
:class:`course_lib.measure.saved_tensors.SavedTensorMeter`; tests/measure/test_activation_memory.py sets the two
side by side.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4) count
the bytes a GPT layer stores for backward, with 16-bit activations, 1-byte dropout masks, LayerNorm
and a 4h GeLU MLP (s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size):

    no parallelism      sbh·(34 + 5as/h)                    (eq. 1)
    tensor parallel     sbh·(10 + 24/t + 5as/(ht))          (eq. 2: 10 = what stays replicated)
    TP + sequence par.  sbh·(34/t + 5as/(ht))               (eq. 3: everything split)

The 5as/h term is the a·s×s attention matrix (softmax output, dropout mask and dropout output).

The course model (``course_lib.model.transformer.Block``) differs: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU, no dropout, fp32 on CPU, and ``F.scaled_dot_product_attention``, which on CPU
runs a FlashAttention-style kernel that keeps only a log-sum-exp per row, never the s×s matrix.
Reading what each operation saves (``torch.autograd.graph.saved_tensors_hooks``, as the meter does), with
d = d_model, q = n_heads·head_dim, f = d_ff, a = n_heads, in elements:

    each RMSNorm: its input (for x²), the rsqrt statistic [b, s, 1], the normalised x·rsqrt
        (for ∂g), so 2 norms → 4·bsd + 2·bs; the output x̂·g is a new tensor, saved by the
        linears that read it → 2·bsd (q, k, v share one; gate and up share one)
    attention: q after RoPE, k and v repeated to all a heads (GQA's repeat_interleave copies
        them), the output o (which is also wo's input: the CPU kernel lays it out [b, s, a, hd])
        → 4·bsq; plus a·s·b log-sum-exp values ("flash"), or with the math kernel the softmax
        probabilities a·s²·b ("math": Korthikanti's 5as/h term, without dropout)
    SwiGLU: the gate before SiLU, SiLU's output, up, and their product (w2's input) → 4·bsf
    RoPE, the residual adds and the views save nothing that is an activation.

    dense           E = 6·bsd + 2·bs + 4·bsq + 4·bsf + stat
    TP              E = 6·bsd + 2·bs + (4·bsq + 4·bsf + stat)/t     norms and their outputs replicated
    TP + SP         E = (6·bsd + 2·bs + 4·bsq + 4·bsf + stat)/t     the shard kept by each column
                                                                     region, re-gathered in backward

    bytes = E · bytes_per_element (4 in fp32), stat = a·s·b (flash) or a·s²·b (math).

For the tiny config (q = d, f = 3d) this is 4·sbd·(22 + 2/d) + 4·stat bytes. Of Korthikanti's 10
replicated units, ours are 6 elements: two norm inputs, two normalised copies (a fused RMSNorm kernel
would keep only the input and rsqrt), two linear inputs. The measurement counts each saved storage
once (the same x̂·g saved by wq, wk and wv is one tensor) and leaves out parameters and buffers.

**Recomputation (lecture 06).** :func:`recompute_terms` counts what one block keeps under each
policy of :mod:`course_lib.model.recompute` (kv = n_kv_heads·head_dim):

    none        K = E (above)
    selective   K = bsd (x) + bsq + 2·bs·kv (wq, wk, wv) + bsd (wo) + 2·bsf (w1, w3) + bsd (w2)
                    + bsq + stat (o, log-sum-exp)         flash: the SDPA kernel's two outputs
                    + bsq + a·s²·b (P·V, QKᵀ)             math: its two bmm outputs
    full        K = bsd                                   the block input (Korthikanti §5: 2sbh in 16 bits)

:func:`recompute_peak_bytes`: after the forward pass the L blocks hold Σ K; the peak comes in the
backward pass of the last block, when it has recomputed its full set E and is in its SwiGLU backward
(w2's input P already freed, the gradients of P, SiLU(gate) and up alive: W = 2·bsf more):

    peak = (L − 1)·K + E + W + U,   U = bsd for selective (w2's output: cached, never read), else 0

so none: L·E + W, full: (L − 1)·bsd + E + W. Chen et al. 2016 (§4) give the same shape: memory
O(L) for the checkpoints plus one segment's activations. :func:`recompute_flops` is the price: full
recomputation runs each block's forward again in backward (Korthikanti §5: +33% of the step, 4F/3F),
less w2's matmul, which torch's early-stopping recompute never reaches; selective recomputes no
matmul (only O(bs·(d + f)) pointwise work). The counts assume the course's dense GQA block.
"""

from __future__ import annotations

from course_lib.cost.collective_bytes import check_ulysses_divisible
from course_lib.cost.flops import attention_flops_per_token, train_flops_per_token
from course_lib.model.config import ModelConfig

ATTENTION_KERNELS = ("flash", "math")
# What course_lib.model.recompute.set_recompute accepts (tests/model/test_recompute.py checks they agree).
RECOMPUTE_POLICIES = ("none", "selective", "full")


def korthikanti_bytes_per_layer(
    s: int, b: int, h: int, a: int, tp_size: int = 1, sequence_parallel: bool = False
) -> float:
    """Korthikanti et al. 2022, eqs. 1–3: bytes per layer for a GPT layer in 16-bit with dropout.

    The paper's symbols: s sequence, b micro-batch, h hidden, a heads; t = ``tp_size``.
    """
    t = tp_size
    attention = 5 * a * s / h
    if sequence_parallel:
        return s * b * h * (34 / t + attention / t)
    return s * b * h * (10 + 24 / t + attention / t) if t > 1 else s * b * h * (34 + attention)


def activation_terms(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    attention: str = "flash",
) -> dict[str, float]:
    """Elements one rank saves for backward in one ``Block`` of the course model, by term (see module doc)."""
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION_KERNELS} (the kernel SDPA runs)")
    b, s, d, f, a = batch, seq_len, cfg.d_model, cfg.d_ff, cfg.n_heads
    q = cfg.n_heads * cfg.head_dim
    tp = tp_size
    rep = tp if sequence_parallel else 1  # what divides the parts that plain TP replicates
    stat = a * s * b if attention == "flash" else a * s * s * b
    return {
        "norm inputs": 2 * b * s * d / rep,
        "normalised x·rsqrt": 2 * b * s * d / rep,
        "rsqrt statistics": 2 * b * s / rep,
        "column-parallel inputs": 2 * b * s * d / rep,
        "q, k, v (k, v repeated to all heads)": 3 * b * s * q / tp,
        "attention output (wo input)": b * s * q / tp,
        "log-sum-exp" if attention == "flash" else "softmax probabilities": stat / tp,
        "SwiGLU gate, SiLU(gate), up, product": 4 * b * s * f / tp,
    }


def activation_bytes_per_layer(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    attention: str = "flash",
    bytes_per_element: int = 4,
) -> float:
    """Bytes one rank keeps for backward in one layer: the sum of :func:`activation_terms`."""
    return bytes_per_element * sum(
        activation_terms(cfg, batch, seq_len, tp_size, sequence_parallel, attention).values()
    )


def attention_memory_per_rank(
    seq_len: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    cp_size: int = 1,
    method: str = "ring",
    batch: int = 1,
    bytes_per_element: int = 4,
) -> dict:
    """Bytes one rank holds for one attention layer's core (between the projections), per method.

    ``saved`` — what autograd keeps for the backward: q, k, v, out and the fp32 log-sum-exp.
        none (N = 1) and ulysses: the full sequence s, but ulysses only h/N heads (after its all-to-all);
        ring: s/N tokens, all heads (its out is the fp32 merge accumulator).
    ``scores`` — the largest fp32 score matrix of a kernel that materialises one:
        none b·h·s², ulysses b·(h/N)·s², ring b·h·(s/N)² (its first step's diagonal block). A tiled
        FlashAttention kernel never builds more than a tile, which removes this term for all three.
    ``buffers`` — communication staging: ulysses the send and receive copies of its largest
        all-to-all (2·b·(s/N)·h·d); ring the K/V block in flight (2·b·h_kv·(s/N)·d).
    ``saved`` is checked against autograd's saved tensors in tests/parallel/context/test_ring_attention.py.
    """
    b, s, h, hk, d, e, n = batch, seq_len, n_heads, n_kv_heads, head_dim, bytes_per_element, cp_size
    if method == "none":
        n = 1
    elif method == "ulysses":
        check_ulysses_divisible(h, hk, n, s)
    if method in ("none", "ulysses"):
        saved = b * s * (2 * h + 2 * hk) * d * e // n + b * (h // n) * s * 4
        scores = b * (h // n) * s * s * 4
        buffers = 2 * b * (s // n) * h * d * e if n > 1 else 0
    elif method == "ring":
        saved = b * (s // n) * ((h + 2 * hk) * d * e + h * d * 4 + h * 4)
        scores = b * h * (s // n) ** 2 * 4
        buffers = 2 * b * hk * (s // n) * d * e if n > 1 else 0
    else:
        raise ValueError(f"unknown method {method!r}: use 'none', 'ulysses' or 'ring'")
    return {"saved": saved, "scores": scores, "buffers": buffers, "total": saved + scores + buffers}


def _check_recompute_args(cfg: ModelConfig, policies) -> list[str]:
    """One policy per layer (a name for all of them, or a list of cfg.n_layers names), validated."""
    policies = [policies] * cfg.n_layers if isinstance(policies, str) else list(policies)
    if len(policies) != cfg.n_layers or any(p not in RECOMPUTE_POLICIES for p in policies):
        raise ValueError(
            f"policy {policies!r}: give one of {RECOMPUTE_POLICIES}, or a list of {cfg.n_layers} of them "
            "(one per layer)"
        )
    unsupported = cfg.is_mla or cfg.is_moe or cfg.attn_output_gate or cfg.sliding_window or "linear" in cfg.layer_types
    if unsupported:
        raise NotImplementedError(
            "the recomputation counts read the course's dense GQA block (course_lib.model.transformer.Block with "
            "Attention and MLP); this config has MLA, MoE, an output gate, sliding or linear layers. Measure it with "
            "course_lib.experiments.lecture06.recompute_memory.measure_recompute instead"
        )
    return policies


def recompute_terms(
    cfg: ModelConfig, batch: int, seq_len: int, policy: str, attention: str = "flash"
) -> dict[str, float]:
    """Elements one dense course ``Block`` keeps for backward under a recompute ``policy`` (see module doc).

    ``"none"`` is :func:`activation_terms`; ``"full"`` the block input (Chen et al. 2016; Korthikanti
    et al. 2022, §5); ``"selective"`` the input and the outputs of the ops that
    :func:`course_lib.model.recompute.selective_policy` saves (matmuls and the attention kernel).
    """
    if not isinstance(policy, str):
        raise TypeError(
            f"recompute_terms counts one block: give one policy name of {RECOMPUTE_POLICIES}, not {policy!r}"
        )
    _check_recompute_args(cfg, policy)
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION_KERNELS} (the kernel SDPA runs)")
    b, s, d, f, a = batch, seq_len, cfg.d_model, cfg.d_ff, cfg.n_heads
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    if policy == "none":
        return activation_terms(cfg, batch, seq_len, attention=attention)
    if policy == "full":
        return {"block input x": b * s * d}
    core = (
        {"attention output o": b * s * q, "log-sum-exp": a * s * b}
        if attention == "flash"
        else {"P·V (bmm)": b * s * q, "scores QKᵀ (bmm)": a * s * s * b}
    )
    return {
        "block input x": b * s * d,
        "wq output": b * s * q,
        "wk, wv outputs": 2 * b * s * kv,
        "wo output": b * s * d,
        "w1, w3 outputs (gate, up)": 2 * b * s * f,
        "w2 output (cached, never read)": b * s * d,
        **core,
    }


def recompute_bytes_per_layer(
    cfg: ModelConfig, batch: int, seq_len: int, policy: str, attention: str = "flash", bytes_per_element: int = 4
) -> float:
    """Bytes one block keeps for backward under ``policy``: the sum of :func:`recompute_terms`."""
    return bytes_per_element * sum(recompute_terms(cfg, batch, seq_len, policy, attention).values())


def recompute_peak_bytes(
    cfg: ModelConfig, batch: int, seq_len: int, policy, attention: str = "flash", bytes_per_element: int = 4
) -> dict[str, float]:
    """Activation bytes of the L blocks after the forward pass and at the peak of the backward pass.

    ``policy``: one name for every layer, or a list of ``cfg.n_layers`` names (as
    :func:`course_lib.model.recompute.set_recompute` can set them). Returns the terms of
    peak = Σ_{i<L−1} K_i + E + W + U (module doc), and ``"saved"`` = Σ K_i, ``"peak"``.

    Counted as the measurement counts (:func:`course_lib.experiments.lecture06.recompute_memory.measure_recompute`): the
    tensors that the blocks' ops create, so each block's input belongs to the block below (the
    first block's to whoever made it) and the last block's output is counted. Parameter gradients,
    the incoming gradient and a kernel's internal scratch are not activations and are left out.
    The peak is the last block's SwiGLU backward: every block below still holds its K there, and
    each block's own working set (E + W + U) is the same. Measured exact for the course configs.
    """
    policies = _check_recompute_args(cfg, policy)
    kept = [recompute_bytes_per_layer(cfg, batch, seq_len, p, attention, bytes_per_element) for p in policies]
    e = bytes_per_element
    last = policies[-1]
    terms = {
        "kept by the blocks below": sum(kept[:-1]),
        "last block's full set E": recompute_bytes_per_layer(cfg, batch, seq_len, "none", attention, e),
        "SwiGLU backward working set W": e * 2 * batch * seq_len * cfg.d_ff,
        "cached, never read U": e * batch * seq_len * cfg.d_model if last == "selective" else 0,
    }
    return {**terms, "saved": sum(kept), "peak": sum(terms.values())}


def recompute_flops(cfg: ModelConfig, batch: int, seq_len: int, policy) -> dict[str, float]:
    """FLOPs of one training step with recomputation: {"step", "recompute_matmul", "recompute_attention",
    "recompute", "ratio"}.

    ``step``: the model FLOPs of forward + backward, (6N + attention)·tokens
    (:func:`course_lib.cost.flops.train_flops_per_token`). ``recompute``: what the backward pass
    runs again. For each fully recomputed block, its forward matmuls 2·bs·(dq + 2d·kv + qd + 2df)
    (wq, wk, wv, wo, w1, w3: w2 is not rerun, torch's recompute stops once backward has w2's input)
    and its attention core's forward (a third of :func:`~course_lib.cost.flops.attention_flops_per_token`
    per layer); selective reruns no matmul and no attention, only O(bs·(d + f)) pointwise work, not
    counted. ``ratio`` = (step + recompute) / step: Korthikanti et al. 2022 (§5) put full
    recomputation at 4/3, one more forward of every layer; here the head and w2 are not rerun.
    """
    policies = _check_recompute_args(cfg, policy)
    tokens, full = batch * seq_len, policies.count("full")
    d, f = cfg.d_model, cfg.d_ff
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    matmul = full * 2 * tokens * (d * q + 2 * d * kv + q * d + 2 * d * f)
    attention = full * tokens * attention_flops_per_token(cfg, seq_len) / (3 * cfg.n_layers)
    step = tokens * train_flops_per_token(cfg, seq_len)
    return {
        "step": step,
        "recompute_matmul": matmul,
        "recompute_attention": attention,
        "recompute": matmul + attention,
        "ratio": (step + matmul + attention) / step,
    }


# ------------------------------------------------------------------ the device's attention kernel

# Bytes per element of the inputs SDPA may get, and which CUDA kernel each dtype runs.
SDPA_DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2}


def sdpa_saved_statistics(
    device_type: str, attention: str, batch: int, n_heads: int, seq_len: int, dtype: str = "fp32"
) -> dict[str, int]:
    """Bytes that ``F.scaled_dot_product_attention`` saves for backward besides q, k, v and its output,
    by tensor, for ``n_heads`` heads of ``batch`` sequences of ``seq_len`` on a ``device_type`` device.

    * ``"math"``, any device: the softmax probabilities P = softmax(QKᵀ/√d), [b, a, s, s] in ``dtype``;
      so does ``"flash"`` on the meta device, which has no fused kernel (SDPA falls back to math).
    * ``"flash"`` lets SDPA choose the device's fused kernel, which keeps one log-sum-exp per row
      (fp32) instead of P (Dao et al. 2022, FlashAttention §3.1):

      - cpu: a FlashAttention-style kernel; log-sum-exp [b, a, s] (the terms above).
      - cuda, fp32: FlashAttention takes only 16-bit inputs, so SDPA runs the memory-efficient kernel
        (Rabe & Staats 2021; xFormers' CUTLASS kernel), whose log-sum-exp is padded to its 32-row tiles
        (``kAlignLSE`` = 32), [b, a, ⌈s/32⌉·32], plus the dropout RNG's seed and offset (two int64
        scalars, saved even at dropout 0).
      - cuda, fp16/bf16: FlashAttention-2; log-sum-exp [b, a, s] and the RNG state, a uint64 pair
        and a uint64 offset.

    The CUDA shapes are those PyTorch's own shape functions allocate (``torch/_meta_registrations.py``,
    ``_scaled_dot_product_{efficient,flash}_attention``; tests/measure/test_device_measure.py runs them on
    meta tensors). They assume a head_dim the fused kernels accept (a multiple of 8). Another device
    type raises: measure its kernel first.
    """
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION_KERNELS} (the kernel SDPA runs)")
    if dtype not in SDPA_DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(SDPA_DTYPES)}")
    b, a, s = batch, n_heads, seq_len
    if attention == "math" or device_type == "meta":  # meta tensors have no fused kernel: SDPA runs math
        return {"softmax probabilities": b * a * s * s * SDPA_DTYPES[dtype]}
    fp32, int64 = 4, 8
    if device_type == "cpu":
        return {"log-sum-exp": b * a * s * fp32}
    if device_type == "cuda" and dtype == "fp32":
        padded = -(-s // 32) * 32  # kAlignLSE = 32: one log-sum-exp row per query row of a 32-row tile
        return {"log-sum-exp (padded to 32 rows)": b * a * padded * fp32, "philox seed and offset": 2 * int64}
    if device_type == "cuda":
        return {"log-sum-exp": b * a * s * fp32, "RNG state (seed pair, offset)": 3 * int64}
    raise ValueError(
        f"no model of what SDPA's {attention!r} kernel saves on {device_type!r} (known: cpu, cuda, meta): measure "
        "it with course_lib.measure.saved_tensors.SavedTensorMeter around F.scaled_dot_product_attention, then add it here"
    )


def sdpa_extra_bytes(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    attention: str = "flash",
    device_type: str = "cpu",
    tp_size: int = 1,
    dtype: str = "fp32",
) -> int:
    """Bytes one attention call saves on ``device_type`` beyond the terms above, which read the CPU
    kernel: :func:`sdpa_saved_statistics` on that device minus on the CPU, for the a/t heads of one
    tensor-parallel rank (sequence parallelism gathers the whole sequence for attention). In fp32:

        extra = 4·(a/t)·b·(⌈s/32⌉·32 − s) + 2·8 bytes      (CUDA, "flash"; 0 on the CPU and for "math")

    Read from PyTorch's source and its shape functions; the course's machines had no GPU to measure it
    on (``./course gpu-check`` runs the measurements that would show it)."""
    heads = cfg.n_heads // tp_size
    here = sdpa_saved_statistics(device_type, attention, batch, heads, seq_len, dtype)
    cpu = sdpa_saved_statistics("cpu", attention, batch, heads, seq_len, dtype)
    return sum(here.values()) - sum(cpu.values())


def recompute_kernel_extra(
    cfg: ModelConfig, batch: int, seq_len: int, policy, attention: str = "flash", device_type: str = "cpu"
) -> dict[str, int]:
    """{"saved", "peak"}: bytes to add to :func:`recompute_peak_bytes` on ``device_type``: one
    :func:`sdpa_extra_bytes` for each block whose K keeps the attention kernel's outputs ("none",
    "selective"; "full" keeps only its input) and, at the peak, one more for the last block's E."""
    policies = _check_recompute_args(cfg, policy)
    extra = sdpa_extra_bytes(cfg, batch, seq_len, attention, device_type)
    keeps = [p != "full" for p in policies]
    return {"saved": extra * sum(keeps), "peak": extra * (sum(keeps[:-1]) + 1)}
