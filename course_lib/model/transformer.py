"""The course model: a Llama-style decoder-only transformer (lecture 01, Foundations).

    tokens -> tok_embeddings -> n_layers x Block -> norm -> output -> logits

    Block:  h = x + Attention(RMSNorm(x))        pre-norm residual stream
            y = h + MLP(RMSNorm(h))

The pieces follow LLaMA (Touvron et al. 2023, §2.2): RMSNorm before each sub-layer, rotary position
embeddings, SwiGLU feed-forward, no biases; with grouped-query attention as in Llama 2/3. Each piece
is its own small ``nn.Module`` with the names Meta's Llama code uses (``wq``/``wk``/``wv``/``wo``,
``w1``/``w3``/``w2``), because later chapters cut exactly these apart: tensor parallelism splits
``wq``/``wk``/``wv``/``w1``/``w3`` by columns and ``wo``/``w2`` by rows, pipeline parallelism splits
``layers``. RoPE uses Hugging Face's convention (rotate the two halves of a head, not interleaved
pairs), so :func:`export_hf` can hand the weights to ``transformers.LlamaForCausalLM`` unchanged.

MoE, MLA, sliding-window and linear attention, and multi-token prediction are described by
``ModelConfig`` but not run here; asking for them raises ``NotImplementedError`` naming the chapter.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.config import ModelConfig
from course_lib.model.hf_export import export_hf
from course_lib.model.moe import Expert, MoE

__all__ = ["MLP", "Attention", "Block", "RMSNorm", "Transformer", "export_hf", "generate", "next_token_loss"]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · g   (Zhang & Sennrich 2019, eq. 4).

    Like LayerNorm without the mean subtraction and bias. The statistic is computed in fp32 whatever
    the input dtype (as Hugging Face's LlamaRMSNorm does): a bf16 mean of squares loses the digits
    that the normalisation then amplifies.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles m·θ_i, θ_i = theta^(-2i/head_dim)  (RoFormer, Su et al. 2021, eq. 34).

    Shape [seq_len, head_dim]: the head_dim/2 frequencies are repeated for the two halves of a head,
    the layout that :func:`apply_rope`'s ``rotate_half`` pairs up (channel i with channel i + head_dim/2).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair (x_i, x_{i+d/2}) of every head by its angle: x·cos + rotate_half(x)·sin.

    ``x`` is [batch, heads, seq, head_dim]. Because the same rotation by m·θ is applied to q at
    position m and k at position n, q·k depends only on m - n: relative position for free.
    """
    x1, x2 = x.chunk(2, dim=-1)
    rotate_half = torch.cat([-x2, x1], dim=-1)
    return x * cos.to(x.dtype) + rotate_half * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention (Ainslie et al. 2023): softmax(QKᵀ/√d_h + M)·V, then wo.

    ``n_kv_heads`` K/V heads serve ``n_heads`` query heads; query head h reads K/V head
    h // (n_heads / n_kv_heads). With n_kv_heads = n_heads this is multi-head attention
    (Vaswani et al. 2017, §3.2.2); with 1 it is multi-query attention (Shazeer 2019).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts come from the projections' sizes, not from cfg, so a tensor-parallel rank that
        # holds a column slice of wq/wk/wv runs this same code on its local heads.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = q.shape[1] // k.shape[1]
        if group > 1:  # give each query head its group's K/V head (a copy here; a KV cache stores one)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(Expert):
    """SwiGLU feed-forward (Shazeer 2020, eq. 6): w2(SiLU(w1·x) ⊙ w3·x); w1 = gate, w3 = up, w2 = down.
    The same module as one MoE expert (:class:`course_lib.model.moe.Expert`), of width ``d_ff``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.d_model, cfg.d_ff)


class Block(nn.Module):
    """One pre-norm transformer layer: x + Attention(RMSNorm(x)), then h + FFN(RMSNorm(h)).

    The FFN is the dense SwiGLU, or with ``moe=True`` a mixture of experts as DeepSeek-V3 builds it
    (:class:`course_lib.model.moe.MoE`): ``n_shared_experts`` always-on experts and the top
    ``n_activated_experts`` of ``n_routed_experts``, sigmoid router scores, balanced by the
    router's bias (the training loop calls ``update_bias``)."""

    def __init__(self, cfg: ModelConfig, moe: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def _check_runnable(cfg: ModelConfig) -> None:
    """The course model is dense GQA; the other features arrive in later chapters."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"Transformer expects a course_lib.model.config.ModelConfig, got {type(cfg).__name__}; "
            f"use course_lib.model.config.get('tiny') or build a ModelConfig"
        )
    other = "sliding-window" if cfg.sliding_window else "linear"
    later = [
        (cfg.is_mla, f"multi-head latent attention (kv_lora_rank={cfg.kv_lora_rank}): lecture 04, DeepSeek-V3"),
        (
            cfg.full_attention_interval > 1,
            f"{other} attention layers (full_attention_interval={cfg.full_attention_interval}): lecture 04",
        ),
        (cfg.attn_output_gate, "gated attention output (attn_output_gate=True): lecture 04"),
        (cfg.mtp_depth > 0, f"multi-token prediction (mtp_depth={cfg.mtp_depth}): lecture 04"),
    ]
    missing = [why for flag, why in later if flag]
    if missing:
        raise NotImplementedError(
            "course_lib.model.transformer.Transformer runs dense grouped-query attention only; this config also asks for "
            + "; ".join(missing)
            + ". Use its numbers with n_params()/n_active_params(), or a course config "
            "such as configs.get('tiny')."
        )


class Transformer(nn.Module):
    """Decoder-only language model: tokens [batch, seq] (int64) -> logits [batch, seq, vocab_size]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        _check_runnable(cfg)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, cfg.is_moe_layer(i)) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one matrix both reads tokens in and scores them out (Press & Wolf 2017)
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: the table is a pure function of cfg, so it stays out of checkpoints.
        cos, sin = rope_cos_sin(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02) for every matrix; residual-branch outputs (wo, w2) scaled by 1/√(2·n_layers).

        The scaling is GPT-2's (Radford et al. 2019, §2.3): each layer adds two branches to the
        residual stream, so without it the stream's variance grows with depth. RMSNorm gains start
        at 1. Draws come from torch's global generator in module order: the same seed, the same model.
        """
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.output and self.cfg.tie_embeddings:
                    continue  # already drawn as the embedding
                scale = 1 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo", "w2")) else 1.0
                nn.init.normal_(module.weight, mean=0.0, std=std * scale)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
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
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; ``targets[b, t]`` is the token that follows ``tokens[b, t]``;
        plus the MoE layers' balancing losses, when they have any (coefficients set on each MoE)."""
        loss = next_token_loss(self(tokens), targets)
        for layer in self.moe_layers():
            loss = loss + sum(layer.losses.values(), torch.zeros(()))
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


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy decoding without a KV cache: append argmax(logits[-1]) n_new times.

    Every step recomputes the whole prefix (O(t²) work per token); lecture 06 adds the KV cache and
    checks it against this function. ``prompt`` is [seq] or [batch, seq]; the result has the same
    rank with n_new more tokens.
    """
    tokens = prompt[None] if prompt.dim() == 1 else prompt
    if tokens.shape[1] + n_new > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt length {tokens.shape[1]} + n_new {n_new} exceeds max_seq_len="
            f"{model.cfg.max_seq_len}; shorten the prompt or generate fewer tokens"
        )
    for _ in range(n_new):
        next_token = model(tokens)[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens[0] if prompt.dim() == 1 else tokens
