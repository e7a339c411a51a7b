"""The quantized KV cache measured on the course model (lecture 06). Tested in tests/inference/test_quantized_kv.py.

:mod:`course_lib.inference.quantized_cache` stores K/V in INT8/INT4 (KIVI), :mod:`course_lib.inference.cachegen` compresses them for sending (CacheGen);
:func:`course_lib.cost.memory.quantized_kv_cache_bytes` predicts the bytes. Here is what they cost in accuracy:

* :func:`train_briefly` — the course model after a short training run, so that its keys have structure (the
  largest channel of a head grows to 2-5x the median, against ~1.5x at random init);
* :func:`record_qkv` — every layer's queries, keys and values (after RoPE) for a token sequence;
* :func:`decode_attention_error` — decode token by token through a :class:`QuantizedCache` with exact inputs,
  and set the attention output's error beside the bound derived below; :func:`compare_key_modes` does it
  for per-channel and per-token keys;
* :func:`decode_logits`, :func:`logit_error` — the whole model: logits along a fixed continuation (teacher
  forcing, so the two caches see the same tokens); greedy generation with any cache is
  :func:`course_lib.inference.generate.generate` given the cache object;
* :func:`cachegen_sizes` — bytes of one K or V tensor raw, INT-b, INT-b entropy-coded and CacheGen-coded.

transformers' ``QuantizedCache`` (backend quanto) beside ours is
:mod:`course_lib.experiments.lecture06.quanto_side_by_side`.

**The bound on the attention output.** One query q attends to keys k_j with weights p = softmax(q·k_j/√d).
The cache returns k̂_j = k_j + e_j and v̂_j = v_j + f_j with |e_jc| ≤ δk_jc and |f_jc| ≤ δv_jc (s/2 of their group,
0 in the full-precision window). Each score moves by at most ε_j = Σ_c |q_c|·δk_jc/√d ≤ ε = max_j ε_j, and

    log p̂_j − log p_j = Δs_j − log Σ_i p_i e^{Δs_i}  ∈ [−2ε, 2ε]   so   |p̂_j − p_j| ≤ p_j (e^{2ε} − 1);
    ô − o = Σ_j p̂_j f_j + Σ_j (p̂_j − p_j)(v_j − m)           for any m, since Σ_j (p̂_j − p_j) = 0;
    |ô_c − o_c| ≤ max_j δv_jc + (e^{2ε} − 1) · (max_j v_jc − min_j v_jc)/2         (m the mid-range).

A rigorous bound per output element (fp32 rounding aside): the test requires every measured error below it.
It is loose, since its worst case puts every error in the same direction.

Measured (``small``: 4 layers, 2 KV heads of 32; fp32; group 32; one thread), for the lecture:

    bytes per token        fp32 2048, bf16 1024; INT8 640, INT4 384, INT2 256 (fp32 scales, as stored here;
                           576, 320, 192 with bf16 scales), plus the window: 32-63 tokens at full precision
    after train_briefly(), 128 tokens (16 in the prompt, then one at a time), window 0 or 32:
                           attention rel. error   worst error/bound   max |Δlogit| (of max |logit|)   same argmax
        INT8               1.0e-3 - 4.1e-3        0.06 - 0.16         0.059 (1.1 %)                   100 %
        INT4               1.8e-2 - 5.7e-2        0.005 - 0.064       0.63 (12 %)                     100 %
        INT2               0.12 - 0.27            0 - 0.022           1.67 (32 %)                     89 % / 93 %
    the same as in a bf16 model (``dtype=torch.bfloat16``: K/V rounded to bf16 on the way in, window and scales bf16;
    window 32; mean over layers, two CPUs): bf16 alone (``bits=None``) 1.4e-3 - 1.6e-3, INT8 1.9e-3 - 2.2e-3, INT4
        2.1e-2 - 2.2e-2, INT2 0.125: INT8 in groups of 32 adds about a third to bf16's own rounding.
    keys per channel against per token (INT4, values exact, :func:`compare_key_modes`): key error 0.06 against
        0.08-0.10, but attention error 0.086, 0.028, 0.028, 0.025 against 0.062, 0.023, 0.023, 0.020. Here the
        largest key channels are RoPE pairs that turn ~1 rad per token, so a channel's range over 32 tokens is its
        whole amplitude and per-channel groups gain nothing. Add one constant channel (4x max |k|, the kind of
        outlier KIVI §3 finds in large models): attention ignores it, per-token error rises to 0.09-0.27,
        per-channel error does not move.
    CacheGen (:func:`cachegen_sizes`, INT4, anchors every 16 tokens, lzma): a random walk along 128 tokens x 64
        channels takes 4,532 bytes against INT4's 6,144 (raw fp32: 32,768; INT4 codes through lzma: 6,116, as
        min-max codes are near uniform), max error 0.036 against 0.029. The course model's own K/V (fp16) take
        4,584-4,652 against 5,120 at 1.5-2x the error: its language changes symbol every token, so neighbouring
        tokens' K/V are not close, the locality CacheGen relies on.
"""

from __future__ import annotations

import math

import torch

from course_lib.experiments import small_run
from course_lib.inference.cache import ContiguousCache
from course_lib.inference.cachegen import (
    CODERS,
    cachegen_compress,
    cachegen_decompress,
    cachegen_entropy_bytes,
    cachegen_error_bound,
)
from course_lib.inference.quantized_cache import (
    QuantizedCache,
    dequantize,
    error_bound,
    fake_quantize_kv,
    quantize,
    unpack_codes,
)
from course_lib.model.configs import get
from course_lib.model.layers import apply_rope
from course_lib.model.transformer import Transformer
from course_lib.optim.optimizers import AdamW

__all__ = [
    "attention_bound",
    "cachegen_sizes",
    "compare_key_modes",
    "decode_attention_error",
    "decode_logits",
    "logit_error",
    "record_qkv",
    "train_briefly",
]


def train_briefly(
    name: str = "small", steps: int = 150, batch: int = 16, seq_len: int = 64, seed: int = 0
) -> Transformer:
    """The course model ``name`` after ``steps`` AdamW steps (lr 3e-3) on the course language, in eval mode.
    150 steps of ``small`` take ~11 s on one thread and leave it on the bigram plateau (loss ~2.70), enough for
    its keys to grow outlier channels."""
    torch.manual_seed(seed)
    model = Transformer(get(name))
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    small_run.train(model, opt, small_run.batches(steps, batch, seq_len, seed))
    return model.eval()


@torch.no_grad()
def record_qkv(model: Transformer, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer (q [b, H, n, hd], k [b, Hkv, n, hd], v [b, Hkv, n, hd]) of ``tokens`` [b, n], q and k after RoPE: what
    the attention multiplies and a cache stores (GQA models; MLA caches a latent instead)."""
    if model.cfg.is_mla or model.cfg.attn_output_gate:
        raise ValueError("record_qkv reads plain GQA attention (wq, wk, wv); this model uses MLA or a gated query")
    outputs, hooks = {}, []
    for i, layer in enumerate(model.layers):
        for name in ("wq", "wk", "wv"):
            record = lambda m, a, out, key=(i, name): outputs.__setitem__(key, out)
            hooks.append(getattr(layer.attention, name).register_forward_hook(record))
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    b, n = tokens.shape
    cos, sin = model.rope_cos[:n], model.rope_sin[:n]
    heads = lambda i, name: outputs[i, name].view(b, n, -1, model.cfg.head_dim).transpose(1, 2)
    return [
        (apply_rope(heads(i, "wq"), cos, sin), apply_rope(heads(i, "wk"), cos, sin), heads(i, "wv"))
        for i in range(len(model.layers))
    ]


def attention_bound(q, k, v, dk, dv) -> torch.Tensor:
    """The bound of the module docstring for one query per (batch, head): q [b, H, d]; k, v, dk, dv [b, Hkv, n, d]
    (true keys and values, per-element error bounds). Returns [b, H, d]."""
    group = q.shape[1] // k.shape[1]
    dk, dv, v = (x.float().repeat_interleave(group, dim=1) for x in (dk, dv, v))
    eps = (torch.einsum("bhd,bhnd->bhn", q.float().abs(), dk) / math.sqrt(q.shape[-1])).amax(-1, keepdim=True)
    spread = (v.amax(2) - v.amin(2)) / 2
    return dv.amax(2) + torch.expm1(2 * eps) * spread


def _attend(q, k, v) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v for one query per (batch, head), fp32: q [b, H, d], k, v [b, Hkv, n, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    p = (torch.einsum("bhd,bhnd->bhn", q.float(), k) / math.sqrt(q.shape[-1])).softmax(-1)
    return torch.einsum("bhn,bhnd->bhd", p, v)


@torch.no_grad()
def decode_attention_error(q, k, v, prompt_len: int = 1, dtype: torch.dtype | None = None, **cache_kwargs) -> dict:
    """One layer's attention decoded through a :class:`QuantizedCache` (``cache_kwargs``: bits, group_size, residual,
    key_mode, value_mode): the first ``prompt_len`` tokens of k, v [b, Hkv, n, d] in one step, then one per step;
    at every step the query of the new token attends to what the cache returns and to the exact K/V.

    ``dtype``: the K/V reach the cache in this dtype, as in a bf16 model (its window and scales are then bf16 too);
    the reference stays exact fp32 attention on k, v, so the error includes the rounding to ``dtype``. ``bits=None``
    stores them in ``dtype`` and nothing else: a plain bf16 cache, measured the same way. The bound adds the
    rounding: u·|k| for the cast, and 2u·|k̂| where a dequantized value is cast back (u = eps/2 of ``dtype``,
    round to nearest).

    Returns ``error`` and ``bound`` [steps, b, H, d] (|ô − o| and :func:`attention_bound`), ``worst_ratio``
    (max error/bound), ``relative`` (rms |ô − o| / rms o)."""
    b, n = k.shape[0], k.shape[2]
    u = 0.0 if dtype is None else torch.finfo(dtype).eps / 2
    k_in, v_in = (k, v) if dtype is None else (k.to(dtype), v.to(dtype))
    if cache_kwargs.get("bits", 4) is None:
        if dtype is None:
            raise ValueError("bits=None keeps the K/V unquantized: give the dtype they are rounded to (dtype=...)")
        cache = None
    else:
        cache = QuantizedCache(b, n, **cache_kwargs, device=k.device)
    errors, bounds, exact = [], [], []
    steps = [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, n)]
    for start, end in steps:
        if cache is None:
            k_hat, v_hat = k_in[:, :, :end], v_in[:, :, :end]
            dk = dv = torch.zeros_like(k_hat, dtype=torch.float32)
        else:
            dk, dv = cache.error_bounds(0) if len(cache) else (k.new_zeros(b, k.shape[1], 0, k.shape[3]),) * 2
            dk = torch.cat([dk, torch.zeros_like(k[:, :, start:end])], dim=2).float()
            dv = torch.cat([dv, torch.zeros_like(v[:, :, start:end])], dim=2).float()
            cache.begin_step(end - start)
            k_hat, v_hat, _ = cache.layer(0).update(k_in[:, :, start:end], v_in[:, :, start:end])
            cache.end_step()
        if u:  # the cast of the inputs, then that of each dequantized value (the window's are returned as stored)
            dk = dk + u * k[:, :, :end].abs() + 2 * u * k_hat.float().abs() * (dk > 0)
            dv = dv + u * v[:, :, :end].abs() + 2 * u * v_hat.float().abs() * (dv > 0)
        qi = q[:, :, end - 1]  # the newest token's query sees every key
        o = _attend(qi, k[:, :, :end], v[:, :, :end])
        errors.append((_attend(qi, k_hat, v_hat) - o).abs())
        bounds.append(attention_bound(qi, k[:, :, :end], v[:, :, :end], dk, dv))
        exact.append(o)
    error, bound, exact = torch.stack(errors), torch.stack(bounds), torch.stack(exact)
    return {
        "error": error,
        "bound": bound,
        "worst_ratio": (error / bound.clamp_min(1e-30)).amax().item(),
        "relative": (error.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item(),
    }


def _causal_attention(q, k, v) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@torch.no_grad()
def compare_key_modes(qkv, bits: int = 4, group_size: int = 32) -> dict[str, dict[str, list[float]]]:
    """Keys quantized per channel (KIVI) and per token, per layer of ``qkv`` (:func:`record_qkv`): every complete
    group quantized, values exact, so only the keys' grouping differs. For each mode: ``key_error`` (rms
    |k̂ − k| / rms k), ``attention_error`` (rms |ô − o| / rms o over every query of a causal pass)."""
    out = {mode: {"key_error": [], "attention_error": []} for mode in ("per_channel", "per_token")}
    for q, k, v in qkv:
        o = _causal_attention(q, k, v)
        for mode, errors in out.items():
            k_hat = fake_quantize_kv(k, v, bits, group_size, 0, key_mode=mode)[0]
            errors["key_error"].append(((k_hat - k).pow(2).mean().sqrt() / k.pow(2).mean().sqrt()).item())
            o_hat = _causal_attention(q, k_hat, v)
            errors["attention_error"].append(((o_hat - o).pow(2).mean().sqrt() / o.pow(2).mean().sqrt()).item())
    return out


# ---------------------------------------------------------------------------------------------------- the whole model
@torch.no_grad()
def decode_logits(model: Transformer, tokens: torch.Tensor, prompt_len: int, cache) -> torch.Tensor:
    """Logits [b, n − prompt_len + 1, vocab] that predict tokens prompt_len … n: the prompt in one step, then
    ``tokens`` fed one at a time (teacher forcing: every cache sees the same tokens)."""
    out = [model(tokens[:, :prompt_len], cache=cache)[:, -1]]
    for t in range(prompt_len, tokens.shape[1]):
        out.append(model(tokens[:, t : t + 1], cache=cache)[:, -1])
    return torch.stack(out, dim=1)


def logit_error(model: Transformer, tokens: torch.Tensor, prompt_len: int, **cache_kwargs) -> dict:
    """The quantized cache against the full-precision one along ``tokens``: ``max_abs`` and ``relative``
    (max |Δlogit| over max |logit|), ``agreement`` (fraction of positions with the same argmax) and
    ``min_margin`` (smallest top-2 gap of the full-precision logits: below 2·max_abs an argmax may flip)."""
    b, n = tokens.shape
    on = tokens.device  # the model's: decode_logits feeds it the tokens
    full = decode_logits(model, tokens, prompt_len, ContiguousCache(b, n, on))
    quant = decode_logits(model, tokens, prompt_len, QuantizedCache(b, n, **cache_kwargs, device=on))
    top2 = full.topk(2, dim=-1).values
    diff = (quant - full).abs()
    return {
        "max_abs": diff.max().item(),
        "relative": (diff.max() / full.abs().max()).item(),
        "agreement": (quant.argmax(-1) == full.argmax(-1)).float().mean().item(),
        "min_margin": (top2[..., 0] - top2[..., 1]).min().item(),
    }


# ---------------------------------------------------------------------------------------------------- CacheGen
def cachegen_sizes(
    x: torch.Tensor, bits: int = 4, tokens_per_group: int = 16, group_size: int = 32, coder: str = "lzma"
) -> dict:
    """One K or V tensor x [..., tokens, channels] four ways, bytes and errors:

    ``raw`` (its dtype); ``quantized`` (INT-``bits`` per channel in groups of ``group_size`` tokens, KIVI's keys:
    packed codes + scales); ``quantized_coded`` (the same codes, one a byte, and scales through ``coder``: what
    entropy coding alone gains); ``cachegen`` (anchors + deltas + ``coder``, :func:`cachegen_compress`);
    ``entropy`` (the delta codes at their per-channel zeroth-order entropy, CacheGen's arithmetic coder with a
    model per channel, plus the rest uncoded). Errors: ``*_max_error`` and ``*_worst_ratio`` (error / bound)."""
    q = quantize(x, bits, group_size, dim=-2)
    codes = unpack_codes(q.codes, bits).transpose(-1, -2).contiguous()  # channel-major, one code a byte
    side = torch.cat([q.scale.flatten(), q.zero.flatten()]).view(torch.uint8)
    coded = CODERS[coder][0](codes.numpy().tobytes() + side.numpy().tobytes())
    c = cachegen_compress(x, bits, tokens_per_group, coder)
    x_hat, bound = cachegen_decompress(c), cachegen_error_bound(c)
    q_err = (dequantize(q) - x).abs()
    c_err = (x_hat - x).abs()
    return {
        "raw": x.numel() * x.element_size(),
        "quantized": q.nbytes(),
        "quantized_coded": len(coded),
        "cachegen": c.nbytes(),
        "entropy": cachegen_entropy_bytes(c),
        "quantized_max_error": q_err.max().item(),
        "quantized_worst_ratio": (q_err / error_bound(q).clamp_min(1e-30)).max().item(),
        "cachegen_max_error": c_err.max().item(),
        "cachegen_worst_ratio": (c_err / bound.clamp_min(1e-30)).max().item(),
    }
