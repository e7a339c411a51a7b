"""Low-rank optimizer state: Adam's moments kept in an r-dimensional projection of each matrix's gradient.

GaLore (Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection",
Alg. 2) for a weight W of shape m×n with m ≤ n and gradient G:

    every T steps:  U, S, Vᵀ = SVD(G),   P = U[:, :r]                    (the top-r left singular vectors)
    every step:     R = Pᵀ G                                               r×n, the gradient in the subspace
                    M ← β₁ M + (1−β₁) R,   V ← β₂ V + (1−β₂) R²          Adam's moments, r×n each
                    N = M̂ / (√V̂ + ε)                                      the Adam direction, in the subspace
                    W ← W (1 − ηλ) − η · s · P N                           projected back, scaled by s

For m > n the projection is taken from the other side (Q = V[:, :r], R = G Q, m×r), so the state is
always r × max(m, n). State per matrix, in elements (GaLore Table 1):

    AdamW:  2·m·n                 GaLore:  2·r·max(m, n) + r·min(m, n)     (moments + projector)

(the formula is :func:`course_lib.cost.memory.galore_state_elements`; tests/optim/test_lowrank.py measures it)

which for m = n = 4096, r = 128 is 4.7% of AdamW's (the moments alone are r/m = 3.1%). Unlike LoRA
(:mod:`course_lib.model.lora`) every weight still trains, and over many refreshes the sum of the updates
is not low-rank; but between two refreshes each matrix moves only inside its r-dimensional subspace
(a test checks this).

Vectors (norm gains) and matrices with min(m, n) ≤ r get the full AdamW update: projecting them would
save nothing. The moments are kept across a refresh, although they were accumulated in the previous
subspace, as GaLore does; LDAdam (Robert et al. 2024, arXiv:2410.16103) instead rotates them into the
new subspace and feeds the projection error back into the next gradient, a refinement left out here.
"""

from __future__ import annotations

import torch

from course_lib.optim.optimizers import _Optimizer, check_adam_args

__all__ = ["GaLoreAdamW"]


class GaLoreAdamW(_Optimizer):
    """AdamW whose moments for each matrix live in the top-``rank`` singular subspace of its gradient,
    refreshed every ``update_proj_gap`` steps (T; GaLore uses 200 for LLaMA pre-training), and whose
    projected-back update is scaled by ``scale`` (s, GaLore's α; 0.25 in the paper).

    Bias correction and the order of operations are those of :func:`course_lib.optim.optimizers.adamw_`,
    applied to the r×n projected gradient instead of the m×n one.
    """

    def __init__(
        self,
        params,
        rank: int = 8,
        update_proj_gap: int = 200,
        scale: float = 0.25,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        check_adam_args(lr, betas, eps, weight_decay)
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1 (the dimension of the projected gradient), got {rank!r}")
        if not isinstance(update_proj_gap, int) or update_proj_gap < 1:
            raise ValueError(f"update_proj_gap must be an int >= 1 (steps between SVDs), got {update_proj_gap!r}")
        defaults = dict(
            rank=rank,
            update_proj_gap=update_proj_gap,
            scale=scale,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults)

    @staticmethod
    def _projects(p: torch.Tensor, rank: int) -> bool:
        return p.dim() == 2 and min(p.shape) > rank

    def _update(self, p, g, state, group):
        (beta1, beta2), lr, rank = group["betas"], group["lr"], group["rank"]
        projects = self._projects(p, rank)
        left = projects and p.shape[0] <= p.shape[1]  # project the shorter side: P is m×r (left) or Q is n×r (right)
        if not state:
            state["step"] = 0
            if projects:
                shape = (rank, p.shape[1]) if left else (p.shape[0], rank)
                state["projector"] = torch.empty(
                    p.shape[0] if left else p.shape[1], rank, dtype=p.dtype, device=p.device
                )
            else:
                shape = p.shape
            state["exp_avg"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        if projects and state["step"] % group["update_proj_gap"] == 0:
            # full_matrices=False: only the min(m, n) singular vectors exist to choose from anyway
            u, _, vh = torch.linalg.svd(g.float(), full_matrices=False)
            state["projector"].copy_(u[:, :rank] if left else vh[:rank].T)
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        if projects:
            proj = state["projector"]
            g = proj.T @ g if left else g @ proj  # R: the gradient's coordinates in the subspace
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])  # decoupled, on the full W (AdamW)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
        direction = m / denom
        if projects:
            direction = (proj @ direction if left else direction @ proj.T) * group["scale"]
        p.add_(direction, alpha=-lr / (1 - beta1**t))
