"""Multi-token prediction (DeepSeek-V3 Technical Report, arXiv:2412.19437, §2.2, Figure 3).

Besides the next token, the model learns to predict the tokens 2, 3, … D+1 ahead, *sequentially*:
module k (k = 1..D) keeps the causal chain by starting from module k−1's representation h^{k-1}
(h^0: the main model's last hidden state, before its final norm) and the embedding of the token it
may now see, t_{i+k}:

    h'^k_i = M_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))]        (eq. 21; M_k: a 2d -> d projection)
    h^k_{1:T-k} = TRM_k(h'^k_{1:T-k})                                   (eq. 22; one transformer block)
    P^k_{i+k+1} = OutHead(RMSNorm(h^k_i))                               (eq. 23)
    L^k_MTP = CrossEntropy(P^k_{2+k:T+1}, t_{2+k:T+1})                  (eq. 24)
    L = L_main + λ/D · Σ_k L^k_MTP                                      (eq. 25)

The embedding and the output head are the main model's (shared, not copied); each module has its own
three RMSNorms, projection and block: 3·d + 2·d·d + block parameters, as ``ModelConfig`` counts them.
At inference the modules are dropped (or used for speculative decoding); ``Transformer.forward``
ignores them. DeepSeek-V3 uses D = 1 and λ = 0.3 for the first 10T tokens, then 0.1 (§4.2).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.config import ModelConfig
from course_lib.model.layers import RMSNorm

__all__ = ["MTPModule", "mtp_losses"]


class MTPModule(nn.Module):
    """One prediction depth: h^{k-1} [b, n, d] and Emb(t_{i+k}) [b, n, d] -> h^k [b, n, d].

    ``block`` is a transformer block built by the caller (``course_lib.model.transformer.Block``,
    MoE when the main model is MoE): this module does not import the transformer that owns it.
    """

    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        d = cfg.d_model
        self.hnorm = RMSNorm(d, cfg.norm_eps)
        self.enorm = RMSNorm(d, cfg.norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)  # M_k
        self.block = block
        self.norm = RMSNorm(d, cfg.norm_eps)  # before the shared output head

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # the paper's order, h first (DeepSeek's released weights put the embedding first; a convention)
        return self.block(self.proj(torch.cat([self.hnorm(h), self.enorm(emb)], dim=-1)), cos, sin)


def mtp_losses(
    modules: nn.ModuleList,
    h: torch.Tensor,
    targets: torch.Tensor,
    embed: nn.Module,
    head: nn.Module,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ignore_index: int = -100,
) -> list[torch.Tensor]:
    """[L^1, …, L^D]: module k's mean cross-entropy for the token k+1 ahead of each position.

    ``h`` [b, T, d] is the main model's last hidden state over the inputs; ``targets`` [b, T] the
    next tokens (``targets[:, i]`` = t_{i+1}), so module k reads t_{i+k} = ``targets[:, i+k-1]`` and
    predicts t_{i+k+1} = ``targets[:, i+k]`` for the T − k positions that have one. Ignored targets
    are embedded as token 0 (their own predictions are ignored; padding sits at the end).
    """
    t = h.shape[1]
    if t <= len(modules):
        raise ValueError(
            f"sequence length {t} leaves no position for multi-token prediction depth {len(modules)}: "
            f"module k predicts the token k+1 ahead, so it needs at least k+1 tokens"
        )
    losses = []
    for k, module in enumerate(modules, start=1):
        n = t - k
        h = module(h[:, :n], embed(targets[:, k - 1 : k - 1 + n].clamp(min=0)), cos[:n], sin[:n])
        logits = head(module.norm(h))
        predict = targets[:, k : k + n]
        losses.append(F.cross_entropy(logits.flatten(0, -2).float(), predict.flatten(), ignore_index=ignore_index))
    return losses
