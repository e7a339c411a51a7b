"""Linear attention with a fixed-size state: Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta
Networks: Improving Mamba2 with Delta Rule", arXiv:2412.06464, eq. 10), as Qwen3-Next uses it in three
of every four layers.

Softmax attention keeps every past key and value (the KV cache grows with t). A linear-attention
layer keeps one matrix per head instead, S_t ∈ R^{d_v × d_k}, and reads it with the query. Gated
DeltaNet updates that matrix with the *delta rule* (what the state predicts for k_t, S k_t, is moved
towards v_t by a step β_t) after a *gated decay* α_t of everything it held:

    S_t = α_t · S_{t-1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ          o_t = S_t q_t
        = α_t S_{t-1} + β_t (v_t − α_t S_{t-1} k_t) k_tᵀ            (the form computed here)

    α_t = exp(−exp(A_log) · softplus(a_t + dt_bias))  ∈ (0, 1)      (Mamba2's decay, per head)
    β_t = sigmoid(b_t)                                   ∈ (0, 1)      (write strength, per head)

with q_t, k_t L2-normalised (so I − β k kᵀ is a contraction) and q_t scaled by 1/√d_k, as the FLA
kernels that Qwen3-Next calls do. The layer around the recurrence is Qwen3-Next's
(``Qwen3NextGatedDeltaNet`` in Hugging Face transformers):

    [q, k, v, z] = in_proj_qkvz(x)          [b, a] = in_proj_ba(x)        (a, b: one per value head)
    [q, k, v]    = SiLU(causal depthwise conv1d([q, k, v]), kernel linear_conv_kernel)
    key heads repeated to the value heads (linear_n_v_heads / linear_n_k_heads query/key copies)
    y = out_proj(RMSNorm(o) · g ⊙ SiLU(z))    (gated RMSNorm, one weight g of width d_v shared by heads)

Parameters are exactly what ``ModelConfig._attention_params('linear')`` counts. Decoding needs only
:class:`DeltaNetState`: the last (kernel − 1) conv inputs and S, a size fixed in t. The recurrence
is a plain loop over time (fine at course sizes; the chunked parallel form of the paper's §3.3 is
what makes it fast at scale).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.config import ModelConfig

__all__ = ["DeltaNetState", "GatedDeltaNet", "GatedRMSNorm", "gated_delta_rule"]


class DeltaNetState:
    """What a Gated DeltaNet layer carries from one call to the next: ``conv`` [b, channels, kernel − 1]
    (the last inputs of the causal conv) and ``recurrent`` S [b, Hv, dv, dk]. Its size does not grow with t."""

    def __init__(self):
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes of the storage the state keeps alive (not just its elements: a view could hold more)."""
        return sum(t.untyped_storage().nbytes() for t in (self.conv, self.recurrent) if t is not None)


class GatedRMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · g ⊙ SiLU(z), over the last dim (Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        # host: built on the default device like nn.Linear's weight; moved with the module by .to(device)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype)) * F.silu(z)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, one step per token: S_t = α_t S_{t-1} + β_t (v_t − α_t S_{t-1} k_t) k_tᵀ, o_t = S_t q_t.

    q, k [b, t, h, dk]; v [b, t, h, dv]; alpha, beta [b, t, h]; state S [b, h, dv, dk] (None: zeros).
    Returns o [b, t, h, dv] and the last state.
    """
    b, t, h, dk = k.shape
    s = state if state is not None else v.new_zeros(b, h, v.shape[-1], dk)
    out = []
    for i in range(t):
        s = alpha[:, i, :, None, None] * s
        error = v[:, i] - (s @ k[:, i, :, :, None])[..., 0]  # v_t − α_t S_{t-1} k_t: [b, h, dv]
        s = s + beta[:, i, :, None, None] * error[..., None] * k[:, i, :, None, :]
        out.append((s @ q[:, i, :, :, None])[..., 0])  # o_t = S_t q_t
    return torch.stack(out, dim=1), s


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet layer: x [b, t, d] -> [b, t, d]; pass a :class:`DeltaNetState` to continue a sequence."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.linear_n_v_heads:
            raise ValueError(
                "GatedDeltaNet needs the linear_* fields of ModelConfig (Qwen3-Next: 16 k-heads, 32 v-heads)"
            )
        self.hk, self.hv = cfg.linear_n_k_heads, cfg.linear_n_v_heads
        self.dk, self.dv = cfg.linear_k_head_dim, cfg.linear_v_head_dim
        if self.hv % self.hk:
            raise ValueError(
                f"linear_n_v_heads={self.hv} is not a multiple of linear_n_k_heads={self.hk}: each key head "
                f"serves a whole group of value heads"
            )
        d, kd, vd = cfg.d_model, self.hk * self.dk, self.hv * self.dv
        self.kernel = cfg.linear_conv_kernel
        self.in_proj_qkvz = nn.Linear(d, 2 * kd + 2 * vd, bias=False)
        self.in_proj_ba = nn.Linear(d, 2 * self.hv, bias=False)
        channels = 2 * kd + vd  # q, k, v are convolved; the gate z is not
        self.conv1d = nn.Conv1d(channels, channels, self.kernel, groups=channels, bias=False)
        # Qwen3-Next's initialisation: decay rates A spread over (0, 16), dt_bias = 1
        # host: parameters, built on the default device like nn.Linear's; moved with the module by .to(device)
        self.A_log = nn.Parameter(torch.empty(self.hv).uniform_(0, 16).log())
        # host: built on the default device like nn.Linear's weight; moved with the module by .to(device)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.norm_eps)
        self.out_proj = nn.Linear(vd, d, bias=False)

    def forward(self, x: torch.Tensor, state: DeltaNetState | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        kd, vd = self.hk * self.dk, self.hv * self.dv
        qkv, z = self.in_proj_qkvz(x).split([2 * kd + vd, vd], dim=-1)
        beta, a = self.in_proj_ba(x).split([self.hv, self.hv], dim=-1)

        # causal depthwise conv: prepend the previous (kernel - 1) inputs (zeros at the start)
        qkv = qkv.transpose(1, 2)  # [b, channels, t]
        past = None if state is None else state.conv
        if past is None:
            past = qkv.new_zeros(b, qkv.shape[1], self.kernel - 1)
        padded = torch.cat([past, qkv], dim=-1)
        qkv = F.silu(F.conv1d(padded, self.conv1d.weight, groups=qkv.shape[1])).transpose(1, 2)
        q, k, v = qkv.split([kd, kd, vd], dim=-1)

        group = self.hv // self.hk
        q = F.normalize(q.view(b, t, self.hk, self.dk), dim=-1).repeat_interleave(group, dim=2) / math.sqrt(self.dk)
        k = F.normalize(k.view(b, t, self.hk, self.dk), dim=-1).repeat_interleave(group, dim=2)
        v = v.view(b, t, self.hv, self.dv)
        alpha = torch.exp(-self.A_log.exp() * F.softplus(a + self.dt_bias))  # [b, t, hv]
        beta = beta.sigmoid()

        o, s = gated_delta_rule(q, k, v, alpha, beta, None if state is None else state.recurrent)
        if state is not None:
            # a copy, not a view: a view of `padded` would keep all t + kernel - 1 columns alive
            state.conv, state.recurrent = padded[..., padded.shape[-1] - (self.kernel - 1) :].clone(), s
        y = self.norm(o, z.view(b, t, self.hv, self.dv))
        return self.out_proj(y.reshape(b, t, vd))
