"""The roofline model, and where the course model's kernels fall on it. Pure arithmetic.

Williams, Waterman & Patterson 2009 ("Roofline: an insightful visual performance model for multicore
architectures", CACM 52(4)): a kernel that does F FLOPs and must move B bytes between memory and the
chip has **arithmetic intensity** I = F/B (they say *operational* intensity), and no implementation
runs faster than

    attainable(I) = min(peak FLOP/s, I · memory bandwidth)

On log-log axes that is a slanted line (memory-bound) meeting a flat one (compute-bound) at the
**ridge point** I* = peak / bandwidth. Left of I* a kernel waits on memory however well it is written.

* :class:`Roofline`, :func:`of` — one device's roofline in one precision, read from the table of
  :mod:`course_lib.cost.hardware` (a figure is never typed twice); :func:`ridge_point` and
  :func:`roofline_flops` are the two formulas.
* :class:`Kernel` — FLOPs and compulsory bytes of one kernel; :func:`training_kernels` lists the
  forward kernels of a training step of a :class:`~course_lib.model.config.ModelConfig` (the QKV and
  output projections, the MLP or the experts, the LM head: GEMMs; attention, FlashAttention-style
  or naive), :func:`decode_kernels` those of one decoding step (the same weight matrices against a
  batch of one token per sequence: GEMVs; the KV-cache reads).
* :func:`place` — each kernel on a roofline: attainable FLOP/s, memory- or compute-bound, and the
  least time it can take.

Decoding is the lesson: the DeepSeek-V3 hardware paper (Zhao et al., "Insights into DeepSeek-V3", ISCA 2025, §2.1.2)
notes that generating one token at a time turns the GEMMs of training into GEMVs, whose
compute-to-memory ratio is so low that "GEMV quickly becomes limited by memory bandwidth". A GEMV
of a bf16 weight matrix does 2 FLOPs per 2-byte weight it reads: 1 FLOP/byte, against ridge points
of hundreds of FLOP/byte on the accelerators of the table. :mod:`course_lib.measure.cpu_roofline`
measures this CPU's roofline and places the same kernels on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from course_lib.cost.flops import matmul_bytes, matmul_flops
from course_lib.model.config import ModelConfig

# Bytes per element of each precision of the table (tf32 is stored as fp32; fp4 packs two per byte).
BYTES_PER_ELEMENT = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp4": 0.5}


def ridge_point(peak_flops_per_second: float, bytes_per_second: float) -> float:
    """FLOP/byte at which the roofline's two limits meet: peak compute / memory bandwidth
    (Williams et al. 2009). For the H100 SXM, 989.4e12 / 3.35e12 ≈ 295 FLOP/byte in bf16."""
    if peak_flops_per_second <= 0 or bytes_per_second <= 0:
        raise ValueError(f"peak and bandwidth must be > 0, got {peak_flops_per_second}, {bytes_per_second}")
    return peak_flops_per_second / bytes_per_second


def roofline_flops(intensity: float, peak_flops_per_second: float, bytes_per_second: float) -> float:
    """Attainable FLOP/s of a kernel of arithmetic intensity ``intensity`` (FLOP/byte):
    min(peak, intensity · bandwidth) (Williams et al. 2009)."""
    if intensity <= 0:
        raise ValueError(f"intensity must be > 0 FLOP/byte, got {intensity}")
    return min(peak_flops_per_second, intensity * bytes_per_second)


@dataclass(frozen=True)
class Roofline:
    """One device's roofline: its peak FLOP/s in one precision and its memory bandwidth (bytes/s)."""

    name: str
    peak_flops_per_second: float
    bytes_per_second: float
    precision: str = ""

    @property
    def ridge_point(self) -> float:
        return ridge_point(self.peak_flops_per_second, self.bytes_per_second)

    def attainable(self, intensity: float) -> float:
        """min(peak, intensity · bandwidth): the most FLOP/s a kernel of this intensity can reach here."""
        return roofline_flops(intensity, self.peak_flops_per_second, self.bytes_per_second)

    def bound(self, intensity: float) -> str:
        """'memory' left of the ridge point, 'compute' at or right of it."""
        return "memory" if intensity < self.ridge_point else "compute"


def of(accelerator, precision: str = "bf16") -> Roofline:
    """The roofline of an :class:`~course_lib.cost.hardware.Accelerator` in ``precision``: its dense peak
    (``accelerator.peak_flops(precision)``, a clear error when the part lacks the format) and its HBM
    bandwidth, both read from the table."""
    return Roofline(accelerator.name, accelerator.peak_flops(precision), accelerator.hbm_bytes_per_s.value, precision)


def rooflines(accelerators: Iterable, precision: str = "bf16") -> tuple[dict[str, Roofline], list[str]]:
    """({name: roofline} of the accelerators that have a published dense ``precision`` peak, [names of
    those that do not]): the second list says, rather than hides, which parts were left out."""
    have, lack = {}, []
    for acc in accelerators:
        if acc.flops[precision].value is None:
            lack.append(acc.name)
        else:
            have[acc.name] = of(acc, precision)
    return have, lack


# ---------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class Kernel:
    """One kernel: ``flops`` and compulsory ``bytes_moved`` per call, run ``count`` times per step.

    ``kind``: 'gemm' (a weight matrix against many tokens), 'gemv' (against the few tokens of one
    decoding step), 'attention' (scores and weighted sum over a sequence), 'kv-read' (one new token's
    attention over the KV cache). ``shape`` is (m, n, k) of C[m, n] = A[m, k]·B[k, n] for matmuls; m
    may be fractional for routed experts (the tokens an expert gets on average).
    """

    name: str
    kind: str
    flops: float
    bytes_moved: float
    count: float = 1
    shape: tuple = ()

    @property
    def intensity(self) -> float:
        """FLOP per byte: flops / bytes_moved."""
        return self.flops / self.bytes_moved


def gemm(name: str, m: float, n: int, k: int, bytes_per_element: float, kind: str = "gemm", count: float = 1) -> Kernel:
    """C[m, n] = A[m, k]·B[k, n]: 2mnk FLOPs (:func:`~course_lib.cost.flops.matmul_flops`) over
    bytes·(mk + kn + mn) (:func:`~course_lib.cost.flops.matmul_bytes`)."""
    return Kernel(name, kind, matmul_flops(m, n, k), matmul_bytes(m, n, k, bytes_per_element), count, (m, n, k))


def _layer_matrices(cfg: ModelConfig, kind: str, moe: bool) -> list[tuple[str, int, int, str]]:
    """(name, k = inputs, n = outputs, who) of one layer's weight matrices, named as in the course model;
    ``who`` is 'all' (every token), 'shared' (one per shared expert, every token) or 'routed' (one
    per routed expert, the tokens routed to it)."""
    if kind == "linear":
        raise NotImplementedError(
            "Gated DeltaNet layers (ModelConfig.layer_types 'linear') are not placed on the roofline: their "
            "chunked recurrence is neither a GEMM nor attention over a KV cache. Use a config without them "
            "(full_attention_interval=1)."
        )
    d, h = cfg.d_model, cfg.n_heads
    if cfg.is_mla:  # DeepSeek-V2 §2.1.2-2.1.3, the names of course_lib.model.mla
        qk, rq, rkv, dr = (
            cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
            cfg.q_lora_rank,
            cfg.kv_lora_rank,
            cfg.qk_rope_head_dim,
        )
        mats = [("wq_a", d, rq), ("wq_b", rq, h * qk)] if rq else [("wq", d, h * qk)]
        mats += [("wkv_a", d, rkv + dr), ("wkv_b", rkv, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))]
        mats += [("wo", h * cfg.v_head_dim, d)]
    else:
        q_out = h * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
        kv_out = cfg.n_kv_heads * cfg.head_dim
        mats = [("wq", d, q_out), ("wk", d, kv_out), ("wv", d, kv_out), ("wo", h * cfg.head_dim, d)]
    out = [(name, k, n, "all") for name, k, n in mats]
    if not moe:
        return out + [("w1", d, cfg.d_ff, "all"), ("w3", d, cfg.d_ff, "all"), ("w2", cfg.d_ff, d, "all")]
    f = cfg.moe_d_ff
    out.append(("router", d, cfg.n_routed_experts, "all"))
    for who in (["shared"] if cfg.n_shared_experts else []) + ["routed"]:
        out += [(f"{who} w1", d, f, who), (f"{who} w3", d, f, who), (f"{who} w2", f, d, who)]
    return out


def _merge(kernels: list[Kernel]) -> list[Kernel]:
    """One entry per distinct kernel (same name and shape), counts added, first-seen order."""
    merged: dict[tuple, Kernel] = {}
    for kern in kernels:
        key = (kern.name, kern.kind, kern.flops, kern.bytes_moved)
        if key in merged:
            merged[key] = dataclasses.replace(merged[key], count=merged[key].count + kern.count)
        else:
            merged[key] = kern
    return list(merged.values())


def _head_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(K/V heads as attention reads them in training, d_qk, d_v). MLA up-projects its latent to a K
    and a V for every head in training (course_lib.model.mla), so it reads n_heads of them."""
    if cfg.is_mla:
        return cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.n_kv_heads, cfg.head_dim, cfg.head_dim


def attention_kernel(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    bytes_per_element: float = 2,
    flash: bool = True,
    keys: int | None = None,
) -> Kernel:
    """softmax(QKᵀ)·V of one layer's forward pass for ``batch`` sequences of ``seq_len`` tokens.

    FLOPs: 2·T·keys·H·(d_qk + d_v) per sequence (the scores and the weighted sum; ``keys`` = T for full
    attention, the window for a sliding layer), the whole T × keys matrix as in
    :func:`~course_lib.cost.flops.attention_flops_per_token` (a causal kernel may skip half).

    Bytes, ``flash=True``: the compulsory traffic, Q and O of every query head and K and V of every
    K/V head once — what FlashAttention approaches by keeping the score tiles on chip (Dao et al. 2022,
    §3.2, Theorem 2: Θ(T²d²/M) accesses for on-chip memory M, near T·d when d² ≪ M). ``flash=False``:
    standard attention as Dao et al.'s Algorithm 0 runs it, per query head: read Q, K; write S (T ×
    keys); read S, write P; read P and V; write O. A T × keys matrix is written and read back twice,
    so the intensity stops growing with T: about d/bytes FLOP/byte for d_qk = d_v = d (64 in bf16 at
    d = 128), below the ridge point of every NVIDIA part of the table.
    """
    kv_heads, d_qk, d_v = _head_dims(cfg)
    h, t = cfg.n_heads, seq_len
    keys = t if keys is None else keys
    flops = batch * 2 * t * keys * h * (d_qk + d_v)
    if flash:
        elements = t * h * (d_qk + d_v) + t * kv_heads * (d_qk + d_v)
    else:
        elements = h * (t * d_qk + keys * d_qk + 4 * t * keys + keys * d_v + t * d_v)
    name = f"attention ({'flash' if flash else 'naive'}, {keys} keys)"
    return Kernel(name, "attention", flops, batch * elements * bytes_per_element, 1, (batch, t, keys))


def training_kernels(
    cfg: ModelConfig, batch: int, seq_len: int, bytes_per_element: float = 2, flash: bool = True
) -> list[Kernel]:
    """The forward kernels of one training step on ``batch`` × ``seq_len`` tokens, with ``count`` = calls
    per step (layers, experts). The backward pass runs each weight's GEMM twice more (dX = dY·Wᵀ,
    dW = Xᵀ·dY) with the same FLOPs and bytes (:func:`~course_lib.cost.flops.matmul_bytes`), so it has
    the same intensities: 3 × Σ count·flops is the step's matmul FLOPs, 6N + 12·L·H·Q·T per token
    (:func:`~course_lib.cost.flops.train_flops_per_token`; a test checks the sum).

    Routed experts get m = tokens·k/E tokens each (a balanced router), which is why fine-grained MoE
    GEMMs are narrower than the dense model's. Elementwise work (norms, SiLU, RoPE, softmax) is left
    out, as in the FLOP formulas.
    """
    tokens = batch * seq_len
    b = bytes_per_element
    kernels = []
    for i, kind in enumerate(cfg.layer_types):
        moe = cfg.is_moe_layer(i)
        for name, k, n, who in _layer_matrices(cfg, kind, moe):
            if who == "routed":
                kernels.append(
                    gemm(
                        name,
                        tokens * cfg.n_activated_experts / cfg.n_routed_experts,
                        n,
                        k,
                        b,
                        count=cfg.n_routed_experts,
                    )
                )
            else:
                kernels.append(gemm(name, tokens, n, k, b, count=cfg.n_shared_experts if who == "shared" else 1))
        keys = min(seq_len, cfg.sliding_window) if kind == "sliding" else seq_len
        kernels.append(attention_kernel(cfg, batch, seq_len, b, flash, keys))
    kernels.append(gemm("output", tokens, cfg.vocab_size, cfg.d_model, b))
    return _merge(kernels)


def experts_touched(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts that ``tokens`` tokens, each routed to ``top_k`` of
    ``n_experts`` uniformly, touch: E·(1 − (1 − k/E)^t). One token touches k; a large batch all E."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def _kv_read(cfg: ModelConfig, kind: str, batch: int, context: int, b: float) -> Kernel:
    """One new token per sequence attending to ``context`` cached tokens, one layer.

    GQA: each sequence reads its 2·Hkv·d cache elements per token; the FLOPs are 2·context·H·2d, so the
    intensity is about 2·(H/Hkv)/bytes whatever the batch (each sequence reads its own cache).
    MLA, in the absorbed form DeepSeek-V2 (§2.1.2) describes for inference (W_UK folded into the query,
    W_UV into the output): every head attends over the shared latent and RoPE key, rkv + dr elements
    per token, with 2·context·H·(2·rkv + dr) FLOPs, so the intensity grows with the heads, about
    4H/bytes. (course_lib.model.mla up-projects the cached latent every step instead, which is simpler
    and slower.)
    """
    h = cfg.n_heads
    seen = min(context, cfg.sliding_window) if kind == "sliding" else context
    if cfg.is_mla:
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        flops = 2 * seen * h * (latent + cfg.kv_lora_rank)
        elements = seen * latent + h * latent + h * cfg.kv_lora_rank  # cache, absorbed q, latent output
    else:
        flops = 2 * seen * h * 2 * cfg.head_dim
        elements = seen * 2 * cfg.n_kv_heads * cfg.head_dim + 2 * h * cfg.head_dim  # cache, q, o
    return Kernel(f"kv-read ({seen} tokens)", "kv-read", batch * flops, batch * elements * b, 1, (batch, seen))


def decode_kernels(cfg: ModelConfig, batch: int, context: int, bytes_per_element: float = 2) -> list[Kernel]:
    """The kernels of one decoding step: ``batch`` sequences, one new token each, ``context`` tokens cached.

    Every weight matrix is multiplied by ``batch`` token vectors (a GEMV for batch 1), so its intensity
    is about batch·2/bytes FLOP/byte: batching is what lifts decoding off the memory roof, and only for
    the weights (Zhao et al., ISCA 2025, §2.1.2). Routed experts: the batch touches :func:`experts_touched` of them,
    each with batch·k/touched tokens. The KV-cache reads do not batch (each sequence has its own
    cache); their bytes over all layers are ``cfg.kv_cache_bytes(context)`` per sequence (a test
    checks it).
    """
    b = bytes_per_element
    kernels = []
    for i, kind in enumerate(cfg.layer_types):
        for name, k, n, who in _layer_matrices(cfg, kind, cfg.is_moe_layer(i)):
            if who == "routed":
                touched = experts_touched(cfg.n_routed_experts, cfg.n_activated_experts, batch)
                m = batch * cfg.n_activated_experts / touched
                kernels.append(gemm(name, m, n, k, b, kind="gemv", count=touched))
            else:
                kernels.append(
                    gemm(name, batch, n, k, b, kind="gemv", count=cfg.n_shared_experts if who == "shared" else 1)
                )
        kernels.append(_kv_read(cfg, kind, batch, context, b))
    kernels.append(gemm("output", batch, cfg.vocab_size, cfg.d_model, b, kind="gemv"))
    return _merge(kernels)


# ---------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """A kernel on a roofline: the FLOP/s it can reach, which limit binds, the least time its
    ``count`` calls take (count · max(flops/peak, bytes/bandwidth)), and its share of the peak."""

    kernel: Kernel
    roof: Roofline
    attainable_flops_per_second: float
    bound: str
    seconds: float

    @property
    def fraction_of_peak(self) -> float:
        return self.attainable_flops_per_second / self.roof.peak_flops_per_second


def place(kernels: Iterable[Kernel], roof: Roofline) -> list[Placement]:
    """Each kernel on ``roof``: attainable FLOP/s, 'memory' or 'compute' bound, and a lower bound on its time."""
    out = []
    for kern in kernels:
        attainable = roof.attainable(kern.intensity)
        out.append(Placement(kern, roof, attainable, roof.bound(kern.intensity), kern.count * kern.flops / attainable))
    return out
