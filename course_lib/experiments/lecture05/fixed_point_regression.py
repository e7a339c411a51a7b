"""The fixed-point worked example of lecture 05: least squares trained with 16-bit fixed-point weights.

y = X w* with X [256, 16] Gaussian and w* uniform in [−1, 1]; full-batch gradient descent on the mean
squared error, the weights *stored* as 16-bit integers with ``frac_bits`` fractional bits
(:mod:`course_lib.precision.fixed_point`) and rounded back to the grid after every update — with
round to nearest or stochastically. The gradient itself is computed in fp32: the point is where the
update lands, on a grid of fixed spacing.

Tested in tests/precision/test_fixed_point.py.
"""

# device-guard: host-only: a 256 x 16 worked example computed in this process on the CPU generator, no rank and no device

from __future__ import annotations

import torch

from course_lib.precision.fixed_point import from_fixed, to_fixed

N, D = 256, 16


def train_regression(rounding: str, steps: int = 300, lr: float = 0.01, frac_bits: int = 8, seed: int = 0) -> dict:
    """{"loss": MSE per step, "weights": the fixed-point integers per step, "w_star": the target}."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w_star = torch.rand(D, generator=g) * 2 - 1
    y = x @ w_star
    q = to_fixed(torch.zeros(D), frac_bits)
    losses, weights = [], []
    for _ in range(steps):
        w = from_fixed(q, frac_bits)
        residual = x @ w - y
        losses.append(residual.pow(2).mean().item())
        weights.append(q.clone())
        grad = 2 * x.T @ residual / N
        q = to_fixed(w - lr * grad, frac_bits, rounding=rounding, generator=g)
    return {"loss": losses, "weights": weights, "w_star": w_star}
