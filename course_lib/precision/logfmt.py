"""LogFMT-nBit: a sign and a log-magnitude code per element, with each 1×128 tile's own range (DeepSeek-V3 ISCA '25, §3.2).

DeepSeek tried it for the tokens sent between GPUs in MoE's combine step. For a tile x₁ … x₁₂₈ (one row, 128
consecutive elements) and n bits (1 sign bit S, n − 1 code bits, K = 2^(n−1) − 1 non-zero codes):

    min  = minᵢ log|xᵢ| (over xᵢ ≠ 0),  max = maxᵢ log|xᵢ|,   min ← max(min, max − log 2³²)
    step = (max − min) / (K − 1)
    code S.00…01 (k = 1) is exp(min), S.11…11 (k = K) is exp(max), S.00…00 is zero
    decode  x̂ = (−1)^S · exp(min + step · (k − 1))

The clamp of min limits a tile's range to 2³², about what a 5-bit exponent covers (E5). Consecutive codes
differ by the ratio r = e^step, so the relative spacing is the same everywhere in the tile, unlike a float's
(which is 2^−M just above a power of two and half that just below the next).

Rounding in linear space. DeepSeek found it "important to round in the original Linear space, instead of the
Log space, for the unbiased activation quantization". Between neighbours v < v·r (r = e^step) the choice of
``space`` decides what "between" means:

    nearest,    linear: switch at the arithmetic mean v·(1 + r)/2      (the smallest error, bounded below)
    nearest,    log:    switch at the geometric mean v·√r
    stochastic, linear: up with probability (x − v)/(v·r − v)       →  E[x̂] = x exactly: unbiased
    stochastic, log:    up with probability log(x/v)/step          →  E[x̂] ≥ x (exp is convex): biased up

Deterministic rounding is biased in either space (which way depends on how the values spread inside a code
interval; the tests measure it); only linear-space probabilities make the expectation exact, which is the
reading of "unbiased" the tests check. With nearest rounding in linear space the relative error is bounded by

    |x̂ − x| / |x| ≤ (r − 1)/(r + 1) = tanh(step/2)     for exp(min) ≤ |x| ≤ exp(max)

(the worst case is x at the midpoint). Elements below exp(min) (only when the 2³² clamp cut the range) go to
zero or to exp(min), judged in linear space in every mode.

Storage: n bits per element plus min and step per tile (two fp32 here: n + 64/128 = n + 0.5 bits).
DeepSeek measured LogFMT-8 training better than E4M3 or E5M2 at the same width, and 10 bits close to BF16, but
did not ship it: the log/exp in the encode/decode cost too much GPU time next to the all-to-all (§3.2.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LogFMTTensor", "dequantize_logfmt", "logfmt_nbytes", "quantize_logfmt"]

TILE = 128
MAX_LOG_RANGE = 32 * 0.6931471805599453  # log(2³²): min ≥ max − log 2³²


@dataclass
class LogFMTTensor:
    """``codes``: sign in bit n−1, k in bits n−2 … 0 (uint8 up to 8 bits, int32 above); ``log_min`` and ``step``:
    fp32, one per tile; ``shape``: the original shape (its last dimension a multiple of ``tile``)."""

    codes: torch.Tensor
    log_min: torch.Tensor
    step: torch.Tensor
    bits: int
    shape: tuple[int, ...]
    tile: int = TILE


def _grid(log_min: torch.Tensor, step: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """|x̂| for code k ≥ 0 (k = 0 is zero), in float64, from the stored fp32 min and step."""
    value = torch.exp(log_min.double() + step.double() * (k - 1).double())
    return torch.where(k > 0, value, torch.zeros_like(value))


def quantize_logfmt(
    x: torch.Tensor,
    bits: int = 8,
    tile: int = TILE,
    rounding: str = "nearest",
    space: str = "linear",
    generator: torch.Generator | None = None,
) -> LogFMTTensor:
    """Encode x in tiles of ``tile`` along its last dimension.

    ``rounding`` "nearest" or "stochastic", judged in ``space`` "linear" (DeepSeek's choice) or "log" (kept to
    show what goes wrong); ``generator`` draws the stochastic choices (a generator of x's device).
    """
    if not 3 <= bits <= 16:
        raise ValueError(f"bits must be in 3..16 (a sign bit and at least two codes besides zero), got {bits}")
    if rounding not in ("nearest", "stochastic") or space not in ("linear", "log"):
        raise ValueError(
            f"rounding must be 'nearest' or 'stochastic' and space 'linear' or 'log', got {rounding!r}, {space!r}"
        )
    if x.dim() == 0 or x.shape[-1] % tile:
        raise ValueError(f"the last dimension of {tuple(x.shape)} must be a multiple of the tile size {tile}")
    K = 2 ** (bits - 1) - 1
    tiles = x.detach().double().reshape(-1, tile)
    if not torch.isfinite(tiles).all():
        raise ValueError("LogFMT has no code for inf or NaN")
    a = tiles.abs()
    nonzero = a > 0
    log_a = torch.where(nonzero, a, torch.ones_like(a)).log()
    log_max = torch.where(nonzero, log_a, torch.full_like(a, -torch.inf)).amax(1)
    log_min = torch.where(nonzero, log_a, torch.full_like(a, torch.inf)).amin(1)
    empty = ~nonzero.any(1)  # an all-zero tile: every code is 0, min and step are irrelevant
    log_max, log_min = torch.where(empty, 0.0, log_max), torch.where(empty, 0.0, log_min)
    log_min = torch.maximum(log_min, log_max - MAX_LOG_RANGE)
    # What is sent is fp32; encode against exactly the grid the receiver will decode.
    log_min32, step32 = log_min.float(), ((log_max - log_min) / (K - 1)).float()
    lo_log, st = log_min32.double().unsqueeze(1), step32.double().unsqueeze(1)
    lo32, st32 = log_min32.unsqueeze(1), step32.unsqueeze(1)

    t = torch.where(st > 0, (log_a - lo_log) / torch.where(st > 0, st, 1.0), torch.zeros_like(log_a))
    k_lo = (torch.floor(t) + 1).clamp(0, K).long()  # the neighbour below (0 = zero, when |x| < exp(min))
    k_hi = (k_lo + 1).clamp(1, K)
    v_lo, v_hi = _grid(lo32, st32, k_lo), _grid(lo32, st32, k_hi)
    # Where x sits between its neighbours, 0 at v_lo and 1 at v_hi; against zero (no log) always linearly.
    gap = (v_hi - v_lo).clamp_min(1e-300)
    frac = ((a - v_lo) / gap).clamp(0, 1)
    if space == "log":
        log_gap = (v_hi.log() - v_lo.clamp_min(1e-300).log()).clamp_min(1e-300)
        frac_log = ((log_a - v_lo.clamp_min(1e-300).log()) / log_gap).clamp(0, 1)
        frac = torch.where(k_lo > 0, frac_log, frac)
    if rounding == "nearest":
        up = frac > 0.5  # a tie stays at the lower code
    else:
        up = torch.rand(frac.shape, generator=generator, dtype=frac.dtype, device=frac.device) < frac
    up = up & (k_hi > k_lo)
    k = torch.where(up, k_hi, k_lo)
    k = torch.where(nonzero, k, torch.zeros_like(k))
    sign = torch.signbit(tiles).long() & (k > 0).long()  # a zero code carries no sign
    codes = (sign << (bits - 1)) | k
    codes = codes.to(torch.uint8 if bits <= 8 else torch.int32).reshape(x.shape)
    return LogFMTTensor(codes, log_min32, step32, bits, tuple(x.shape), tile)


def dequantize_logfmt(q: LogFMTTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x̂ = (−1)^S · exp(min + step·(k − 1)), and 0 for k = 0."""
    codes = q.codes.reshape(-1, q.tile).long()
    k = codes & (2 ** (q.bits - 1) - 1)
    sign = 1 - 2 * ((codes >> (q.bits - 1)) & 1)
    values = sign.double() * _grid(q.log_min.unsqueeze(1), q.step.unsqueeze(1), k)
    return values.reshape(q.shape).to(dtype)


def logfmt_nbytes(q: LogFMTTensor) -> float:
    """Bytes on the wire: n bits per element (packed) plus fp32 min and step per tile."""
    return q.codes.numel() * q.bits / 8 + (q.log_min.numel() + q.step.numel()) * 4
