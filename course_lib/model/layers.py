"""Pieces every attention variant shares: RMSNorm and rotary position embeddings (RoPE).

They live apart from :mod:`~course_lib.model.transformer` so that each attention variant
(:mod:`~course_lib.model.mla`, :mod:`~course_lib.model.linear_attention`) can use them and the
transformer can import those variants, with imports pointing one way only.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["RMSNorm", "apply_rope", "cached_attention_mask", "rope_cos_sin"]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · g   (Zhang & Sennrich 2019, eq. 4).

    Like LayerNorm without the mean subtraction and bias. The statistic is computed in fp32 whatever
    the input dtype (as Hugging Face's LlamaRMSNorm does): a bf16 mean of squares loses the digits
    that the normalisation then amplifies.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        # host: built on the default device like nn.Linear's weight; moved with the module by .to(device)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles m·θ_i, θ_i = theta^(-2i/head_dim)  (RoFormer, Su et al. 2021, eq. 34).

    Shape [seq_len, head_dim]: the head_dim/2 frequencies are repeated for the two halves of a head,
    the layout that :func:`apply_rope`'s ``rotate_half`` pairs up (channel i with channel i + head_dim/2).
    On ``device`` (None: the default device; the Transformer keeps them as buffers, moved with it).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
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


def cached_attention_mask(q_positions: torch.Tensor, n_keys: int, window: int = 0) -> torch.Tensor:
    """Boolean mask [batch, 1, t, n_keys] for queries at ``q_positions`` [batch, t] against cached keys.

    Key column j holds position j of its sequence, so query position p sees j ≤ p (causal) and, with
    ``window > 0``, only p − j < window (sliding window). Columns past a sequence's length hold
    padding; they are never visible because every query position is below its sequence's length.
    """
    keys = torch.arange(n_keys, device=q_positions.device)
    distance = q_positions[:, :, None] - keys[None, None, :]
    mask = distance >= 0
    if window:
        mask &= distance < window
    return mask[:, None]
