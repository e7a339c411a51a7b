"""Fixed-point numbers and integer arithmetic: training without floating point, in miniature.

A fixed-point number with ``frac_bits`` fractional bits is an integer q standing for q · 2^−f: a
grid of constant spacing (the ulp) 2^−f over [−2^(b−1), 2^(b−1) − 1] · 2^−f for a b-bit integer.
Unlike a float, it has the same *absolute* resolution everywhere, no exponent — the arithmetic
of integer units, which cost a fraction of a floating-point unit's area and energy (Horowitz,
ISSCC 2014: an 8-bit integer add ~0.03 pJ against 0.9 pJ for fp32).

**Rounding decides whether training works** (Gupta et al., "Deep Learning with Limited Numerical
Precision", ICML 2015, §3). An SGD step changes a weight by −η·g, usually far less than one ulp of a
16-bit weight. Round to nearest maps every update smaller than half an ulp to zero: the weights
stop moving, whatever the gradient says. *Stochastic rounding* rounds x up with probability
(x − ⌊x⌋)/ulp and down otherwise, so

    E[round(x)] = x      (unbiased: the expected update is the true update)

and many small updates add up on average. FxpNet (Chen et al. 2017) and Q-GaLore (Zhang et al.
2024, INT8 weights with stochastic rounding) rest on this; the FP8 recipes of this package do
not need it only because a float's ulp shrinks with the value.

**Integer GEMMs are exact**: int8 × int8 products fit in 16 bits and a sum of K of them in
int32 while K ≤ 2^31 / 127² ≈ 133,000, so q_a · q_b is computed without rounding and all the
error is in the quantization of the operands (the reason INT8 inference kernels accumulate in int32).
"""

from __future__ import annotations

import torch

__all__ = ["from_fixed", "int8_matmul", "to_fixed", "ulp"]

ROUNDINGS = ("nearest", "stochastic")
_INT = {8: torch.int8, 16: torch.int16, 32: torch.int32}


def ulp(frac_bits: int) -> float:
    """The spacing of the fixed-point grid, 2^−frac_bits."""
    return 2.0**-frac_bits


def to_fixed(
    x: torch.Tensor,
    frac_bits: int,
    bits: int = 16,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """x → the ``bits``-bit integers q with q · 2^−frac_bits ≈ x, saturating at the integer range.

    ``rounding="nearest"``: ties to even (torch.round). ``"stochastic"``: up with probability equal to
    the fraction of an ulp above the lower grid point, so E[q] · ulp = x inside the range.
    """
    if bits not in _INT:
        raise ValueError(f"bits={bits}: fixed-point integers here are 8, 16 or 32 bits wide")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: choose one of {ROUNDINGS}")
    scaled = x.double() * 2.0**frac_bits  # exact: a power-of-two scale, float64 holds fp32's range
    if rounding == "nearest":
        q = torch.round(scaled)
    else:
        low = torch.floor(scaled)
        u = torch.rand(scaled.shape, generator=generator, dtype=torch.float64, device=scaled.device)
        q = low + (u < scaled - low).double()  # up with probability (scaled - low) ∈ [0, 1)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return q.clamp(lo, hi).to(_INT[bits])


def from_fixed(q: torch.Tensor, frac_bits: int) -> torch.Tensor:
    """The fp32 values q · 2^−frac_bits (exact for |q| < 2^24)."""
    return q.float() * 2.0**-frac_bits


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] @ int8 [K, N] → int32 [M, N], every product and sum exact (module docstring)."""
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 operands; got {a.dtype} and {b.dtype}")
    k = a.shape[-1]
    if k * 127 * 128 > 2**31 - 1:
        raise ValueError(f"K={k}: a sum of K int8 products may overflow int32 beyond K = 132,104")
    return a.to(torch.int32) @ b.to(torch.int32)
