"""Number formats and mixed precision (lecture 01, Foundations).

A binary float with E exponent bits, M mantissa bits and exponent bias b stores sign s, exponent
field e and fraction field f, and means

    normal     (−1)ˢ · 2^(e−b) · (1 + f/2ᴹ)      1 ≤ e ≤ e_top
    subnormal  (−1)ˢ · 2^(1−b) · (f/2ᴹ)          e = 0

Everything a table of formats lists follows from (E, M, b) and what the top exponent code is used for:

    eps (gap above 1)        2^−M                 unit roundoff u  2^−(M+1): |round(x) − x| ≤ u·|x|
    smallest normal          2^(1−b)              smallest subnormal 2^(1−b−M)
    largest finite           2^(e_top−b) · (2 − 2^−M)

IEEE formats (fp32, fp16, bf16, fp8 e5m2) reserve e = 2ᴱ−1 for inf/NaN, so e_top = 2ᴱ−2. fp8 e4m3fn
("finite, no inf"; Micikevicius et al. 2022, "FP8 Formats for Deep Learning") uses the top exponent
for numbers and keeps only f = all-ones there for NaN, so its largest mantissa is 2 − 2^(1−M): 448.
fp4 e2m1 (OCP Microscaling spec, used by MXFP4/NVFP4) has no inf and no NaN: its 16 codes are
±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. torch has no finfo for it, so :func:`format_table` derives its row from
the bit layout and :func:`round_to_format` rounds to it by emulation (checked against torch's own
casts for the formats torch has).

Mixed precision (Micikevicius et al. 2018, "Mixed Precision Training") keeps an fp32 master copy of
the weights and scales the loss so that small fp16 gradients do not flush to zero;
:class:`DynamicLossScaler` is the scale controller, with torch.amp.GradScaler's rules. Shape
alignment (tensor-core tiles) is the last topic: :func:`tile_utilisation`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "FORMATS",
    "FloatFormat",
    "format_table",
    "relative_rounding_error",
    "representable_values",
    "round_to_format",
]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format given by its bit layout; ``specials`` says what the top exponent code is.

    "ieee": e = 2ᴱ−1 means inf/NaN. "fn": finite only, NaN = all ones (e4m3fn). "none": no inf, no NaN (e2m1).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    specials: str
    dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def max_exponent(self) -> int:
        top = 2**self.exponent_bits - (2 if self.specials == "ieee" else 1)
        return top - self.bias

    @property
    def max(self) -> float:
        # "fn": the all-ones mantissa at the top exponent is NaN, so the largest mantissa is one step lower
        top_mantissa = 2 - 2.0 ** (1 - self.mantissa_bits) if self.specials == "fn" else 2 - 2.0**-self.mantissa_bits
        return 2.0**self.max_exponent * top_mantissa

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        return 2.0**-self.mantissa_bits

    @property
    def unit_roundoff(self) -> float:
        return 2.0 ** -(self.mantissa_bits + 1)


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in [
        FloatFormat("fp32", 8, 23, 127, "ieee", torch.float32),
        FloatFormat("fp16", 5, 10, 15, "ieee", torch.float16),
        FloatFormat("bf16", 8, 7, 127, "ieee", torch.bfloat16),
        FloatFormat("fp8_e4m3", 4, 3, 7, "fn", torch.float8_e4m3fn),
        FloatFormat("fp8_e5m2", 5, 2, 15, "ieee", torch.float8_e5m2),
        FloatFormat("fp4_e2m1", 2, 1, 1, "none", None),  # torch.float4_e2m1fn_x2 packs two and has no finfo
    ]
}


def _format(fmt: str | FloatFormat) -> FloatFormat:
    if isinstance(fmt, FloatFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(
            f"unknown number format {fmt!r}; choose one of {', '.join(FORMATS)} "
            "or pass a FloatFormat(name, exponent_bits, mantissa_bits, bias, specials)"
        )
    return FORMATS[fmt]


def format_table(names: list[str] | None = None) -> list[dict]:
    """One row per format: bits, layout, largest finite, smallest normal and subnormal, eps, u.

    Taken from ``torch.finfo`` where torch has the dtype (smallest subnormal = finfo.tiny · finfo.eps,
    which finfo does not list); from the bit layout (:class:`FloatFormat`) otherwise, i.e. for fp4.
    """
    rows = []
    for name in names or list(FORMATS):
        f = _format(name)
        if f.dtype is not None:
            fi = torch.finfo(f.dtype)
            mx, normal, eps, source = fi.max, fi.smallest_normal, fi.eps, "torch.finfo"
        else:
            mx, normal, eps, source = f.max, f.smallest_normal, f.eps, "bit layout"
        rows.append(
            dict(
                format=f.name,
                bits=f.bits,
                exponent_bits=f.exponent_bits,
                mantissa_bits=f.mantissa_bits,
                max=mx,
                smallest_normal=normal,
                smallest_subnormal=normal * eps,
                eps=eps,
                unit_roundoff=eps / 2,
                source=source,
            )
        )
    return rows


def _emulate(x: torch.Tensor, f: FloatFormat) -> torch.Tensor:
    """Round to nearest, ties to even, on the grid of ``f``, computed in float64.

    The spacing of representable numbers around x is 2^(e−M) with e = max(floor(log2|x|), 1−b): the
    max() makes the subnormal range evenly spaced. Dividing by a power of two is exact, so
    torch.round (half to even) does the only rounding. Beyond the largest finite value: inf for IEEE
    formats, saturation to ±max for "fn" and "none" (what torch's e4m3fn cast does on this CPU build).
    """
    xd = x.double()
    _, exp = torch.frexp(xd)  # |x| = mantissa · 2^exp with mantissa in [0.5, 1): floor(log2|x|) = exp − 1
    e = torch.clamp(exp - 1, min=1 - f.bias)
    quantum = torch.ldexp(torch.ones_like(xd), e - f.mantissa_bits)
    r = torch.round(xd / quantum) * quantum
    too_big = r.abs() > f.max
    overflow = torch.full_like(r, math.inf) if f.specials == "ieee" else torch.full_like(r, f.max)
    r = torch.where(too_big, overflow.copysign(xd), r)
    r = torch.where(torch.isinf(xd), overflow.copysign(xd), r)  # an inf input is "too big" as well
    if f.specials == "none":  # no NaN code: there is nothing honest to return
        if torch.isnan(xd).any():
            raise ValueError(f"{f.name} has no NaN; the input holds NaN values")
    return r.to(x.dtype)


def round_to_format(x: torch.Tensor, fmt: str | FloatFormat, emulate: bool = False) -> torch.Tensor:
    """x rounded to ``fmt`` and returned in x's dtype: torch's cast when torch has the dtype, the
    bit-layout emulation otherwise (or when ``emulate=True``, which tests use to check the emulation)."""
    f = _format(fmt)
    if not x.is_floating_point():
        raise TypeError(f"round_to_format takes a floating-point tensor, got {x.dtype}")
    if f.dtype is not None and not emulate:
        return x.to(f.dtype).to(x.dtype)
    return _emulate(x, f)


def representable_values(fmt: str | FloatFormat, positive_only: bool = True) -> torch.Tensor:
    """Every finite value of a format of at most 16 bits, sorted (float64); e.g. the 8 of fp4 that are ≥ 0."""
    f = _format(fmt)
    if f.bits > 16:
        raise ValueError(f"{f.name} has 2^{f.bits} codes; enumerate formats of 16 bits or fewer")
    M = f.mantissa_bits
    fields = [(e, m) for e in range(2**f.exponent_bits) for m in range(2**M)]
    vals = [(2.0 ** (1 - f.bias) * m / 2**M) if e == 0 else 2.0 ** (e - f.bias) * (1 + m / 2**M) for e, m in fields]
    # host: a table of the format's values (for plots and lookups), moved to the data's device where it is used
    vals = torch.tensor(sorted(v for v in vals if v <= f.max), dtype=torch.float64)
    return vals if positive_only else torch.cat([-vals.flip(0)[:-1], vals])


def relative_rounding_error(fmt: str | FloatFormat, n: int = 200_000, seed: int = 0) -> dict:
    """Measured |round(x) − x| / |x| over n random x spread log-uniformly over the normal range.

    The x are fp32 numbers (float64 for fp32 itself), so each is rounded once: a float64 → bf16
    cast that went through fp32 would round twice. The bound for round-to-nearest is
    u = 2^−(M+1); the worst case, just above a power of two's midpoint, is u/(1+u).
    """
    f = _format(fmt)
    # host: a property of the format, measured in one process on numbers every machine draws alike
    g = torch.Generator().manual_seed(seed)
    lo, hi = math.log2(f.smallest_normal), math.log2(f.max)
    magnitude = torch.exp2(lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64))  # host: drawn by g
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1  # host: drawn by g
    x = sign * magnitude
    if f.name != "fp32":
        x = x.float().clamp(-f.max, f.max)  # exact fp32 inputs; clamp undoes the one possible overflow
    err = (round_to_format(x, f).double() - x.double()).abs() / x.double().abs()
    return dict(
        format=f.name,
        max=err.max().item(),
        mean=err.mean().item(),
        bound=f.unit_roundoff,
        tight_bound=f.unit_roundoff / (1 + f.unit_roundoff),
    )
