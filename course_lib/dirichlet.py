"""Symmetric Dirichlet draws from a torch.Generator: the transition tables of the course language.

p = (G_1, ..., G_n) / Σ_i G_i with G_i ~ Gamma(a) independent is a draw from the symmetric
Dirichlet(a, ..., a). torch.distributions.Gamma cannot take a torch.Generator, so the Gamma variates
are drawn here by Marsaglia & Tsang's method (2000), from the normals and uniforms of the caller's
generator: the same seed gives the same table on every machine, and torch's global RNG never moves.
:class:`course_lib.data.MarkovLanguage` draws its table with :func:`sample_dirichlet`.
Tested in tests/data/test_data.py.
"""

# device-guard: host-only: the tables are drawn on the host with CPU generators, so any machine gets the same language

from __future__ import annotations

import math

import torch

__all__ = ["sample_dirichlet"]


def _log_gamma_variates(shape: float, size: int, generator: torch.Generator) -> torch.Tensor:
    """log X for ``size`` draws X ~ Gamma(shape, 1), float64.

    Marsaglia & Tsang (2000), "A simple method for generating gamma variables", ACM TOMS 26(3):
    for a >= 1 put d = a - 1/3, c = 1/sqrt(9d); draw x ~ N(0,1), v = (1 + c x)^3, u ~ U(0,1) and
    accept d*v when v > 0 and log u < x^2/2 + d - d v + d log v (acceptance > 95%). For a < 1 they
    use Gamma(a) = Gamma(a+1) * U^(1/a). torch.distributions.Gamma cannot take a torch.Generator,
    hence this. The result stays in log space because U^(1/a) underflows float64 for small a.
    """
    boost = shape < 1.0
    a = shape + 1.0 if boost else shape
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = torch.empty(size, dtype=torch.float64)
    todo = torch.arange(size)
    while todo.numel() > 0:  # each pass accepts > 95% of what is left
        x = torch.randn(todo.numel(), generator=generator, dtype=torch.float64)
        u = torch.rand(todo.numel(), generator=generator, dtype=torch.float64)
        v = (1.0 + c * x) ** 3
        log_v = torch.log(v.clamp_min(1e-300))  # v <= 0 is rejected below anyway
        accept = (v > 0) & (torch.log(u) < 0.5 * x * x + d - d * v + d * log_v)
        out[todo[accept]] = math.log(d) + log_v[accept]
        todo = todo[~accept]
    if boost:
        u = 1.0 - torch.rand(size, generator=generator, dtype=torch.float64)  # in (0, 1]
        out += torch.log(u) / shape
    return out


def sample_dirichlet(concentration: float, n_rows: int, n_cols: int, generator: torch.Generator) -> torch.Tensor:
    """``n_rows`` independent draws from the symmetric Dirichlet(concentration, ..., concentration)
    on ``n_cols`` outcomes, float64 [n_rows, n_cols], rows summing to 1.

    p = (G_1, ..., G_n) / sum_i G_i with G_i ~ Gamma(concentration) independent. Small
    concentration -> most mass on a few outcomes (low entropy); 1 -> uniform on the simplex;
    large -> every row near uniform. The mean row entropy is psi(n a + 1) - psi(a + 1).
    """
    log_g = _log_gamma_variates(concentration, n_rows * n_cols, generator).view(n_rows, n_cols)
    return torch.softmax(log_g, dim=-1)  # = G / sum G, computed from logs without underflow
