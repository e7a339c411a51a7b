"""The course model: a Llama-style decoder-only transformer (lecture 01, Foundations), with the
frontier variants of its pieces (lecture 04).

    tokens -> tok_embeddings -> n_layers x Block -> norm -> output -> logits

    Block:  h = x + Mixer(RMSNorm(x))            pre-norm residual stream
            y = h + FFN(RMSNorm(h))

The pieces follow LLaMA (Touvron et al. 2023, §2.2): RMSNorm before each sub-layer, rotary position
embeddings, SwiGLU feed-forward, no biases; with grouped-query attention as in Llama 2/3. Each piece
is its own small ``nn.Module`` with the names Meta's Llama code uses (``wq``/``wk``/``wv``/``wo``,
``w1``/``w3``/``w2``), because later chapters cut exactly these apart: tensor parallelism splits
``wq``/``wk``/``wv``/``w1``/``w3`` by columns and ``wo``/``w2`` by rows, pipeline parallelism splits
``layers``. RoPE uses Hugging Face's convention (rotate the two halves of a head, not interleaved
pairs), so :func:`export_hf` can hand the weights to ``transformers.LlamaForCausalLM`` unchanged.

What ``ModelConfig`` describes beyond that runs here in miniature, each piece in its own file:

* mixer per layer, from ``cfg.layer_types``: ``'full'`` causal GQA (optionally with Qwen3-Next's
  sigmoid output gate, ``attn_output_gate``), or MLA (:mod:`~course_lib.model.mla`) when
  ``cfg.is_mla``; ``'sliding'`` GQA that sees the last ``sliding_window`` tokens (gpt-oss);
  ``'linear'`` Gated DeltaNet (:mod:`~course_lib.model.linear_attention`, Qwen3-Next);
* feed-forward: SwiGLU, or from layer ``first_k_dense`` on a mixture of experts (:mod:`~course_lib.model.moe`);
* multi-token prediction modules trained beside the model when ``mtp_depth > 0``
  (:mod:`~course_lib.model.mtp`), ignored by ``forward``.

Every built model holds exactly ``cfg.n_params(include_mtp=True)`` parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.config import ModelConfig
from course_lib.model.hf_export import export_hf
from course_lib.model.layers import RMSNorm, apply_rope, cached_attention_mask, rope_cos_sin
from course_lib.model.linear_attention import GatedDeltaNet
from course_lib.model.mla import MLA
from course_lib.model.moe import Expert, MoE
from course_lib.model.mtp import MTPModule, mtp_losses

__all__ = ["MLP", "Attention", "Block", "Transformer", "export_hf", "next_token_loss"]

# A published config built by mistake would take the machine's memory (DeepSeek-V3: 2.7 TB in fp32);
# the course never trains more than this. The meta device builds any size without memory.
MAX_PARAMS = 2 * 10**9


class Attention(nn.Module):
    """Causal grouped-query attention (Ainslie et al. 2023): softmax(QKᵀ/√d_h + M)·V, then wo.

    ``n_kv_heads`` K/V heads serve ``n_heads`` query heads; query head h reads K/V head
    h // (n_heads / n_kv_heads). With n_kv_heads = n_heads this is multi-head attention
    (Vaswani et al. 2017, §3.2.2); with 1 it is multi-query attention (Shazeer 2019).

    ``window > 0``: sliding-window attention, query i sees keys i − window < j ≤ i (gpt-oss's
    alternate layers; Hugging Face's ``sliding_window`` convention). ``cfg.attn_output_gate``: ``wq``
    also emits, beside each head's query, a gate G and the output is wo(y ⊙ sigmoid(G)) (Qwen3-Next;
    Qiu et al. 2025, "Gated Attention for Large Language Models").
    """

    def __init__(self, cfg: ModelConfig, window: int = 0):
        super().__init__()
        self.head_dim, self.window, self.gated = cfg.head_dim, window, cfg.attn_output_gate
        q_out = cfg.n_heads * cfg.head_dim * (2 if self.gated else 1)
        self.wq = nn.Linear(cfg.d_model, q_out, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """``cache``: one layer's view of a KV cache (see :class:`Transformer`); ``cos``/``sin`` are then
        the RoPE rows of the new tokens' positions, [batch, 1, t, head_dim]."""
        b, t, _ = x.shape
        # Head counts come from the projections' sizes, not from cfg, so a tensor-parallel rank that
        # holds a column slice of wq/wk/wv runs this same code on its local heads.
        q = self.wq(x)
        if self.gated:  # each head's query and gate side by side, as in Qwen3-Next's q_proj
            q, gate = q.view(b, t, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None
        if cache is not None:  # store the new K/V (n_kv_heads of them: GQA's saving), read all of them
            k, v, positions = cache.update(k, v)
            mask = cached_attention_mask(positions, k.shape[2], self.window)
        group = q.shape[1] // k.shape[1]
        if group > 1:  # give each query head its group's K/V head (a copy here; the cache stores one)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.window and self.window < t:
            i = torch.arange(t, device=x.device)
            distance = i[:, None] - i[None, :]  # query position − key position
            mask = (distance >= 0) & (distance < self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)
        if self.gated:
            y = y * gate.reshape(b, t, -1).sigmoid()
        return self.wo(y)


class MLP(Expert):
    """SwiGLU feed-forward (Shazeer 2020, eq. 6): w2(SiLU(w1·x) ⊙ w3·x); w1 = gate, w3 = up, w2 = down.
    The same module as one MoE expert (:class:`course_lib.model.moe.Expert`), of width ``d_ff``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.d_model, cfg.d_ff)


LAYER_TYPES = ("full", "sliding", "linear")


class Block(nn.Module):
    """One pre-norm transformer layer: x + Mixer(RMSNorm(x)), then h + FFN(RMSNorm(h)).

    The mixer (kept under the name ``attention``) follows ``kind``, one of ``cfg.layer_types``:
    ``'full'`` is :class:`Attention` (or :class:`~course_lib.model.mla.MLA` when ``cfg.is_mla``),
    ``'sliding'`` is :class:`Attention` with ``window=cfg.sliding_window``, ``'linear'`` is
    :class:`~course_lib.model.linear_attention.GatedDeltaNet` (which needs no RoPE: its state
    accumulates in order).

    The FFN is the dense SwiGLU, or with ``moe=True`` a mixture of experts as DeepSeek-V3 builds it
    (:class:`course_lib.model.moe.MoE`): ``n_shared_experts`` always-on experts and the top
    ``n_activated_experts`` of ``n_routed_experts``, sigmoid router scores, balanced by the
    router's bias (the training loop calls ``update_bias``)."""

    def __init__(self, cfg: ModelConfig, moe: bool = False, kind: str = "full"):
        super().__init__()
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer kind {kind!r}: choose one of {LAYER_TYPES} (see ModelConfig.layer_types)")
        self.kind = kind
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if kind == "linear":
            self.attention = GatedDeltaNet(cfg)
        elif cfg.is_mla:
            self.attention = MLA(cfg)
        else:
            self.attention = Attention(cfg, window=cfg.sliding_window if kind == "sliding" else 0)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if moe:
            self.feed_forward = MoE(
                cfg.d_model,
                cfg.moe_d_ff,
                cfg.n_routed_experts,
                cfg.n_activated_experts,
                n_shared=cfg.n_shared_experts,
                score="sigmoid",
            )
        else:
            self.feed_forward = MLP(cfg)

    # Activation checkpointing: when set (course_lib.model.recompute does it), a callable
    # recompute(forward, x, cos, sin) that runs forward and decides which activations backward keeps.
    recompute = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        if self.recompute is not None and cache is None and torch.is_grad_enabled():
            return self.recompute(self._forward, x, cos, sin)
        return self._forward(x, cos, sin, cache)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        x_norm = self.attention_norm(x)
        if self.kind == "linear":
            mixed = self.attention(x_norm)
        elif cache is not None:
            mixed = self.attention(x_norm, cos, sin, cache)
        else:
            mixed = self.attention(x_norm, cos, sin)
        h = x + mixed
        return h + self.feed_forward(self.ffn_norm(h))


def _check_runnable(cfg: ModelConfig) -> None:
    """Refuse, with the reason, what the course model does not build: combinations that no published
    model uses (and ``ModelConfig`` would count as something else), and sizes beyond memory."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"Transformer expects a course_lib.model.config.ModelConfig, got {type(cfg).__name__}; "
            f"use course_lib.model.configs.get('tiny') or build a ModelConfig"
        )
    unsupported = [
        (
            cfg.is_mla and cfg.sliding_window > 0,
            f"sliding-window MLA (kv_lora_rank={cfg.kv_lora_rank} with sliding_window={cfg.sliding_window})",
        ),
        (
            cfg.is_mla and cfg.attn_output_gate,
            "an output gate on MLA (attn_output_gate=True with kv_lora_rank > 0; the gate is Qwen3-Next's, on GQA)",
        ),
    ]
    missing = [why for flag, why in unsupported if flag]
    if missing:
        raise NotImplementedError(
            "course_lib.model.transformer.Transformer does not build "
            + "; ".join(missing)
            + ": no published model combines them. Drop one of the two, or use the config's numbers with "
            "n_params()/n_active_params() only."
        )
    n = cfg.n_params(include_mtp=True)
    # host: probes the default device (a meta-device context builds without memory); meets no tensor
    if n > MAX_PARAMS and torch.empty(()).device.type != "meta":
        raise ValueError(
            f"this config has {n / 1e9:.1f}B parameters ({4 * n / 1e9:.0f} GB in fp32), more than "
            f"Transformer builds in memory (MAX_PARAMS = {MAX_PARAMS / 1e9:.0f}B). Shrink it, e.g. "
            f"configs.get(name, d_model=64, n_layers=4, n_routed_experts=8, ...), or build it on the meta "
            f"device to inspect its modules without memory: `with torch.device('meta'): Transformer(cfg)`"
        )


class Transformer(nn.Module):
    """Decoder-only language model: tokens [batch, seq] (int64) -> logits [batch, seq, vocab_size].

    With ``cfg.mtp_depth > 0`` it also holds the multi-token-prediction modules ``mtp``, which
    :meth:`loss` trains with weight ``mtp_weight`` (λ, DeepSeek-V3 §2.2) and :meth:`forward` ignores.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        _check_runnable(cfg)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, cfg.is_moe_layer(i), kind) for i, kind in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one matrix both reads tokens in and scores them out (Press & Wolf 2017)
            self.output.weight = self.tok_embeddings.weight
        # each module: its own norms, projection and block (MoE when the model is MoE); embedding and head shared
        # (not registered at all without MTP: a dense model prints and checkpoints as before)
        self.mtp = (
            nn.ModuleList(MTPModule(cfg, Block(cfg, cfg.is_moe, "full")) for _ in range(cfg.mtp_depth))
            if cfg.mtp_depth
            else None
        )
        self.mtp_weight = 0.3  # λ: DeepSeek-V3 uses 0.3 for its first 10T tokens, then 0.1 (§4.2)
        # Non-persistent: the table is a pure function of cfg, so it stays out of checkpoints.
        # MLA rotates only its decoupled qk_rope_head_dim channels (DeepSeek-V2 §2.1.3).
        rope_dim = cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
        cos, sin = rope_cos_sin(cfg.max_seq_len, rope_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02) for every matrix; residual-branch outputs (wo, w2, out_proj) scaled by 1/√(2·n_layers).

        The scaling is GPT-2's (Radford et al. 2019, §2.3): each layer adds two branches to the
        residual stream, so without it the stream's variance grows with depth. RMSNorm gains start
        at 1. Gated DeltaNet's conv, decay rates and gated-norm gain keep the values they were built
        with. Draws come from torch's global generator in module order: the same seed, the same model.
        """
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.output and self.cfg.tie_embeddings:
                    continue  # already drawn as the embedding
                residual = name.endswith(("wo", "w2", "out_proj"))
                scale = 1 / math.sqrt(2 * self.cfg.n_layers) if residual else 1.0
                nn.init.normal_(module.weight, mean=0.0, std=std * scale)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def hidden(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """The last block's output [batch, seq, d_model], before the final norm (h^0 of the MTP modules).

        With a KV ``cache`` (course_lib.inference), ``tokens`` are the *new* tokens of each sequence in
        the cache's batch, and every attention layer stores their keys and values and reads all earlier
        ones. The cache is duck-typed, so the model does not depend on the inference package:

            positions = cache.begin_step(t)     [batch, t] positions of the new tokens (room reserved)
            view = cache.layer(i)               layer i's view, for each attention layer
            k_all, v_all, positions = view.update(k, v)   store [batch, heads, t, dim], read [.., n, dim]
            cache.end_step()                    the new tokens count as cached from now on

        MLA stores its latent and shared RoPE key through the same ``update`` (one "head" each).
        """
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"tokens must be an integer tensor [batch, seq]; got dtype {tokens.dtype}, "
                f"shape {tuple(tokens.shape)} (add a batch dimension with tokens[None])"
            )
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}, the length of "
                f"the RoPE table; crop the input or build the config with a larger max_seq_len"
            )
        h = self.tok_embeddings(tokens)
        if cache is None:
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
            for layer in self.layers:
                h = layer(h, cos, sin)
            return h
        if "linear" in self.cfg.layer_types:
            raise NotImplementedError(
                "a KV cache serves attention layers; this model has Gated DeltaNet layers, whose decoding "
                "state is a fixed matrix (course_lib.model.linear_attention.DeltaNetState), not a KV cache. "
                "Use a config without linear layers (full_attention_interval=1)"
            )
        positions = cache.begin_step(t)
        if int(positions.max()) >= self.cfg.max_seq_len:
            raise ValueError(
                f"position {int(positions.max())} is past max_seq_len={self.cfg.max_seq_len}, the length of the "
                f"RoPE table; generate fewer tokens or build the config with a larger max_seq_len"
            )
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]  # [b, 1, t, d]
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache.layer(i))
        cache.end_step()
        return h

    def forward(self, tokens: torch.Tensor, return_hidden: bool = False, cache=None):
        """Logits [batch, seq, vocab]; with ``return_hidden`` also :meth:`hidden`'s output (for MTP).
        :meth:`loss` goes through here too, so hooks on the model's forward (FSDP's, a profiler's) fire.
        ``cache``: a KV cache of course_lib.inference (see :meth:`hidden`)."""
        h = self.hidden(tokens, cache)
        logits = self.output(self.norm(h))
        return (logits, h) if return_hidden else logits

    def loss_terms(self, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The pieces of :meth:`loss`, unweighted by λ: ``'main'`` (next-token cross-entropy), ``'mtp_k'``
        for each MTP depth k (cross-entropy of the token k+1 ahead), ``'moe'`` (the MoE layers'
        balancing losses, already times their coefficients; only when the model has MoE layers)."""
        if self.mtp is None:
            return self._with_moe_losses({"main": next_token_loss(self(tokens), targets)})
        logits, h = self(tokens, return_hidden=True)
        terms = {"main": next_token_loss(logits, targets)}
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for k, loss in enumerate(mtp_losses(self.mtp, h, targets, self.tok_embeddings, self.output, cos, sin)):
            terms[f"mtp_{k + 1}"] = loss
        return self._with_moe_losses(terms)

    def _with_moe_losses(self, terms: dict) -> dict:
        """``terms`` plus ``'moe'``, the balancing losses every MoE layer kept from this forward."""
        moes = [module for module in self.modules() if isinstance(module, MoE)]  # the MTP blocks' too
        if moes:
            zero = torch.zeros((), device=next(iter(terms.values())).device)  # the losses' device
            terms["moe"] = sum((sum(m.losses.values(), zero) for m in moes), zero)
        return terms

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; ``targets[b, t]`` is the token that follows ``tokens[b, t]``;
        plus λ/D · Σ_k L^k of the multi-token-prediction modules (λ = ``mtp_weight``, D = ``cfg.mtp_depth``)
        and the MoE layers' balancing losses, when they have any (coefficients set on each MoE)."""
        terms = self.loss_terms(tokens, targets)
        loss = terms.pop("main")
        mtp = [terms.pop(f"mtp_{k}") for k in range(1, self.cfg.mtp_depth + 1)]
        if mtp:
            loss = loss + self.mtp_weight / len(mtp) * sum(mtp)
        for term in terms.values():
            loss = loss + term
        return loss

    def moe_layers(self) -> list[MoE]:
        """The mixture-of-experts feed-forwards, in layer order (empty for a dense model)."""
        return [layer.feed_forward for layer in self.layers if isinstance(layer.feed_forward, MoE)]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """L = -1/N · Σ log softmax(logits)[target], over every position whose target is not ignore_index.

    Computed in fp32 even for bf16 logits: log-sum-exp over the vocabulary is where low precision bites.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: expected "
            f"targets of shape logits.shape[:-1]; targets are the inputs shifted left by one"
        )
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index)
