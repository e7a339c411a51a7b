"""Activation memory per transformer layer: Korthikanti et al.'s model, adapted to the course model,
and a measurement of what autograd actually keeps for the backward pass.

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
Reading what each operation saves (``torch.autograd.graph.saved_tensors_hooks``, below), with
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
"""

from __future__ import annotations

from course_lib.cost.comm import check_ulysses_divisible
from course_lib.model.config import ModelConfig

ATTENTION_KERNELS = ("flash", "math")


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
    ``saved`` is checked against autograd's saved tensors in tests/test_ring_attention.py.
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
