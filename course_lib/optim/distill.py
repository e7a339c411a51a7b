"""Knowledge distillation: train a student on a teacher's softened distribution (Hinton et al. 2015).

"Distilling the Knowledge in a Neural Network", §2: with temperature T the teacher's probabilities
p_t = softmax(z_t / T) are "soft targets" that say which wrong answers are almost right; the student
matches them with its own softmax(z_s / T), and also learns the true labels:

    L = w · T² · KL(softmax(z_t/T) ‖ softmax(z_s/T))  +  (1 − w) · CE(z_s, y)

The T² keeps the soft term's gradient the same size as T changes: ∂KL/∂z_s = (p_s − p_t)/T, and for
large T that difference itself shrinks like 1/T, so the gradient goes as 1/T² (§2.1). KL and CE are
means over positions (every row of the logits is one prediction). The soft term is zero, and so is
its gradient, exactly when the student's logits equal the teacher's up to a constant per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["distillation_loss", "soft_target_loss"]


def soft_target_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 2.0
) -> torch.Tensor:
    """T² · KL(softmax(z_t/T) ‖ softmax(z_s/T)), averaged over positions (all dims but the last).

    The teacher is a target: it is detached, no gradient flows into it.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "must have the same shape (same positions, same vocabulary)"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (T = 1 is the plain softmax), got {temperature!r}")
    log_p_s = F.log_softmax(student_logits.flatten(0, -2).float() / temperature, dim=-1)
    log_p_t = F.log_softmax(teacher_logits.detach().flatten(0, -2).float() / temperature, dim=-1)
    # F.kl_div(input=log q, target=log p, log_target=True) = Σ p (log p − log q); "batchmean" divides by rows
    return temperature**2 * F.kl_div(log_p_s, log_p_t, reduction="batchmean", log_target=True)


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 2.0,
    soft_weight: float = 0.5,
) -> torch.Tensor:
    """w · :func:`soft_target_loss` + (1 − w) · cross-entropy with the hard labels ``targets``
    (w = ``soft_weight``; targets of shape logits.shape[:-1], -100 ignored as in
    :func:`~course_lib.model.transformer.next_token_loss`)."""
    if not 0 <= soft_weight <= 1:
        raise ValueError(f"soft_weight must be in [0, 1] (1: teacher only, 0: labels only), got {soft_weight!r}")
    hard = F.cross_entropy(student_logits.flatten(0, -2).float(), targets.flatten(), ignore_index=-100)
    return soft_weight * soft_target_loss(student_logits, teacher_logits, temperature) + (1 - soft_weight) * hard
