"""Activation memory per transformer layer: Korthikanti et al.'s model, adapted to the course model,
and a measurement of what autograd actually keeps for the backward pass.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4) count
the bytes a GPT layer stores for backward, with 16-bit activations, 1-byte dropout masks, LayerNorm
and a 4h GeLU MLP (s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size):

    no parallelism      sbh·(34 + 5as/h)                    (eq. 1)
    tensor parallel     sbh·(10 + 24/t + 5as/(ht))          (eq. 2: 10 = what stays replicated)
    TP + sequence par.  sbh·(34/t + 5as/(ht))               (eq. 3: everything split)

The 5as/h term is the a·s×s attention matrix (softmax output, dropout mask and dropout output).

The course model (``course_lib.model.Block``) differs: RMSNorm, rotary embeddings, grouped-query
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

import contextlib

import torch

from course_lib.configs import ModelConfig

ATTENTION_KERNELS = ("flash", "math")


def korthikanti_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Korthikanti et al. 2022, eqs. 1–3: bytes per layer for a GPT layer in 16-bit with dropout."""
    attention = 5 * a * s / h
    if sequence_parallel:
        return s * b * h * (34 / t + attention / t)
    return s * b * h * (10 + 24 / t + attention / t) if t > 1 else s * b * h * (34 + attention)


def activation_terms(cfg: ModelConfig, batch: int, seq_len: int, tp: int = 1, sequence_parallel: bool = False,
                     attention: str = "flash") -> dict[str, float]:
    """Elements one rank saves for backward in one ``Block`` of the course model, by term (see module doc)."""
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION_KERNELS} (the kernel SDPA runs)")
    b, s, d, f, a = batch, seq_len, cfg.d_model, cfg.d_ff, cfg.n_heads
    q = cfg.n_heads * cfg.head_dim
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


def activation_bytes_per_layer(cfg: ModelConfig, batch: int, seq_len: int, tp: int = 1,
                               sequence_parallel: bool = False, attention: str = "flash",
                               bytes_per_element: int = 4) -> float:
    """Bytes one rank keeps for backward in one layer: the sum of :func:`activation_terms`."""
    return bytes_per_element * sum(activation_terms(cfg, batch, seq_len, tp, sequence_parallel, attention).values())


# ----------------------------------------------------------------------------------- measuring


class SavedTensorMeter:
    """Counts the bytes of distinct storages that autograd saves for backward while active.

        with SavedTensorMeter(exclude=model) as meter:
            y = model(x)
        meter.bytes

    Tensors are kept alive by the graph until backward, so a storage address seen once cannot be
    reused by another saved tensor during the forward pass: counting by address is counting by
    tensor. Storages of ``exclude``'s parameters and buffers are left out (weights are not
    activations, and ``w.t()`` saved by a linear is a view of the weight), and so are the storages
    of ``constants`` (the RoPE tables passed to a block).
    """

    def __init__(self, exclude: torch.nn.Module | None = None, constants: tuple = ()):
        tensors = list(exclude.parameters()) + list(exclude.buffers()) if exclude is not None else []
        tensors += list(constants)
        self._excluded = {t.untyped_storage().data_ptr() for t in tensors}
        self.storages: dict[int, int] = {}
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._excluded and storage.nbytes() > 0:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def sdpa_kernel(attention: str):
    """A context that makes ``F.scaled_dot_product_attention`` run the named kernel."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as choose

    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION_KERNELS}")
    return choose(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()


def measure_block(block: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attention: str = "flash") -> int:
    """Bytes of activations ``block(x, cos, sin)`` saves for backward on this rank (x counts: it is saved).

    ``x`` is copied first: a slice of a larger tensor would be counted with its whole storage.
    """
    x = x.detach().clone().requires_grad_(True)
    with sdpa_kernel(attention), SavedTensorMeter(exclude=block, constants=(cos, sin)) as meter:
        block(x, cos, sin)
    return meter.bytes


def _measure_rank(cfg, batch, seq_lens, settings, attention, seed):
    """On each rank of a TP group: measured bytes for every (seq_len, sequence_parallel) asked for."""
    import torch.distributed as dist

    from course_lib.dist import Mesh, device
    from course_lib.model import Transformer
    from course_lib.sequence_parallel import shard_sequence
    from course_lib.tp_model import TPBlock

    mesh = Mesh(tp=dist.get_world_size())
    torch.manual_seed(seed)
    dense = Transformer(cfg).to(device())
    out = {}
    for sp in settings:
        block = TPBlock(dense.layers[0], mesh, sequence_parallel=sp)
        for s in seq_lens:
            x = torch.randn(batch, s, cfg.d_model, generator=torch.Generator().manual_seed(seed + s)).to(device())
            x = shard_sequence(x, mesh.group("tp")) if sp else x
            out[(s, sp)] = measure_block(block, x, dense.rope_cos[:s], dense.rope_sin[:s], attention)
    return out


def measure_layer_bytes(cfg: ModelConfig, batch: int, seq_lens, tp: int = 1, settings=(False,),
                        attention: str = "flash", seed: int = 0) -> dict:
    """Measured bytes per rank for one layer: {(seq_len, sequence_parallel): bytes}.

    tp = 1 measures ``course_lib.model.Block`` in this process; tp > 1 launches tp ranks that each
    measure their ``TPBlock`` (one launch for all seq_lens and settings; rank 0's numbers, since
    every rank holds the same shapes).
    """
    seq_lens = list(seq_lens)
    if tp == 1:
        from course_lib.dist import device
        from course_lib.model import Transformer

        torch.manual_seed(seed)
        dense = Transformer(cfg).to(device())
        return {(s, False): measure_block(dense.layers[0], torch.randn(batch, s, cfg.d_model, device=device()),
                                          dense.rope_cos[:s], dense.rope_sin[:s], attention) for s in seq_lens}
    from course_lib.dist import launch

    return launch(_measure_rank, tp, cfg, batch, seq_lens, tuple(settings), attention, seed, timeout=120)[0]


def model_vs_measurement(cfg: ModelConfig, seq_lens, batch: int = 1, tp: int = 2, attention: str = "flash") -> list[dict]:
    """For the lecture: one row per (layout, seq_len) with the model's and the measured bytes per rank.

    Layouts: "dense" (t = 1), "TP" and "TP+SP" (t = ``tp``). Two launches at most in all.
    """
    measured = {("dense", s): v for (s, _), v in measure_layer_bytes(cfg, batch, seq_lens, 1, attention=attention).items()}
    for (s, sp), v in measure_layer_bytes(cfg, batch, seq_lens, tp, (False, True), attention).items():
        measured[("TP+SP" if sp else "TP", s)] = v
    rows = []
    for (layout, s), got in sorted(measured.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        t = 1 if layout == "dense" else tp
        model = activation_bytes_per_layer(cfg, batch, s, t, layout == "TP+SP", attention)
        rows.append({"layout": layout, "tp": t, "seq_len": s, "model_bytes": model, "measured_bytes": got,
                     "rel_error": (got - model) / model})
    return rows
