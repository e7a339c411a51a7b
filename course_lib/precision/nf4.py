"""NF4: QLoRA's 4-bit NormalFloat, blockwise absmax, and double quantization (Dettmers et al. 2023, §3).

Pretrained weights are close to normally distributed, so QLoRA picks the 16 code values q₀ … q₁₅ that split
N(0, 1) into equal-probability bins (quantile quantization), normalised to [−1, 1] and with an exact zero so that
padding and zero weights stay exact (§3, "4-bit NormalFloat Quantization"). The zero forces an asymmetric
split: 8 quantiles for the positive half, 7 for the negative half, and 0:

    positive  Φ⁻¹(pᵢ), pᵢ = 9 points evenly spaced from δ down to 1/2, the last (1/2, i.e. 0) dropped  → 8 values
    negative −Φ⁻¹(pᵢ), pᵢ = 8 points evenly spaced from δ down to 1/2, the last dropped               → 7 values
    qᵢ = sorted(positive ∪ {0} ∪ negative) / max          δ = ½((1 − 1/(2·15)) + (1 − 1/(2·16))) = 0.9677083

δ keeps the outermost quantile finite (Φ⁻¹(1) = ∞); it and the recipe are bitsandbytes' ``create_normal_map``,
whose output QLoRA's Appendix lists as the NF4 table. :func:`nf4_code` computes it the same way (δ written as
0.9677083, probabilities on a float32 grid, Φ⁻¹ in float64, the table in float32) and equals bitsandbytes' table
bit for bit.

Blockwise absmax quantization, block B = 64 (§2, "Block-wise k-bit Quantization"):

    c_b = max_{i∈b} |wᵢ|       codeᵢ = argmin_j |wᵢ/c_b − q_j|       ŵᵢ = q_{codeᵢ} · c_b

Double quantization (§3): the fp32 constants c_b cost 32/64 = 0.5 bits per parameter. QLoRA quantizes them
again: subtract their mean (they are all positive; centring makes a symmetric 8-bit format usable), then blocks
of 256 constants share one fp32 scale c₂ and each constant keeps 8 bits. QLoRA (and bitsandbytes) store those
8 bits in bitsandbytes' "dynamic" 8-bit code; here they are fp8 e4m3 with c₂ = max|c − mean| / 448, the 8-bit
float torch has — same layout and bytes, a slightly different grid, so double-quantized results are compared
with bitsandbytes by error, not bit for bit. Memory per parameter:

    single:  4 + 32/64                  = 4.5 bits
    double:  4 + 8/64 + 32/(64·256)     ≈ 4.127 bits     (+ 32 bits once for the mean)

Two elements per byte, the first in the high nibble (bitsandbytes' order, so packed bytes compare directly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.precision.formats import FORMATS, round_to_format

__all__ = [
    "NF4Tensor",
    "dequantize_nf4",
    "nf4_bits_per_parameter",
    "nf4_code",
    "nf4_nbytes",
    "quantize_nf4",
]

BLOCK_SIZE = 64
DQ_BLOCK_SIZE = 256
# ½((1 − 1/30) + (1 − 1/32)) = 0.96770833…, written to 7 digits as bitsandbytes' create_normal_map has it: with
# the exact fraction the table moves by up to 3e-7 (the tests compare it with bitsandbytes' table bit for bit).
NF4_DELTA = 0.9677083
E4M3 = FORMATS["fp8_e4m3"]


def nf4_code() -> torch.Tensor:
    """The 16 NF4 values, ascending, float32: q₀ = −1, q₇ = 0, q₁₅ = 1."""
    positive = torch.special.ndtri(torch.linspace(NF4_DELTA, 0.5, 9)[:-1].double())
    negative = -torch.special.ndtri(torch.linspace(NF4_DELTA, 0.5, 8)[:-1].double())
    values = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).float().sort().values
    return values / values.max()


NF4_CODE = nf4_code()


@dataclass
class NF4Tensor:
    """What QLoRA stores for one weight matrix.

    ``packed`` uint8 (two codes a byte). Without double quantization ``absmax`` holds the fp32 c_b. With it,
    ``absmax`` holds the 8-bit quantized constants (float8_e4m3fn), ``absmax_scale`` the fp32 c₂ (one per 256
    constants) and ``absmax_offset`` their fp32 mean.
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    shape: tuple[int, ...]
    block_size: int = BLOCK_SIZE
    absmax_scale: torch.Tensor | None = None
    absmax_offset: torch.Tensor | None = None

    @property
    def double_quantized(self) -> bool:
        return self.absmax_scale is not None


def _quantize_constants(c: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double quantization: (c − mean) in blocks of ``block_size``, scaled to e4m3's ±448 and rounded to e4m3."""
    offset = c.mean()
    centred = c - offset
    pad = (-centred.numel()) % block_size
    blocks = torch.nn.functional.pad(centred, (0, pad)).reshape(-1, block_size)
    scale = blocks.abs().amax(1) / E4M3.max
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = round_to_format(blocks * inv.unsqueeze(1), E4M3).to(E4M3.dtype)
    return q.reshape(-1)[: c.numel()], scale, offset


def _dequantize_constants(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, block_size: int) -> torch.Tensor:
    pad = (-q.numel()) % block_size
    blocks = torch.nn.functional.pad(q.float(), (0, pad)).reshape(-1, block_size)
    return (blocks * scale.unsqueeze(1)).reshape(-1)[: q.numel()] + offset


def quantize_nf4(
    w: torch.Tensor, block_size: int = BLOCK_SIZE, double_quant: bool = False, dq_block_size: int = DQ_BLOCK_SIZE
) -> NF4Tensor:
    """Blockwise absmax NF4 over the flattened tensor (as bitsandbytes does), optionally double-quantized.

    Like bitsandbytes, wᵢ/c_b is computed as wᵢ · (1/c_b) in float32 and clamped to [−1, 1]; the nearest code
    is found by comparing with the midpoints between neighbouring codes (a tie goes to the lower code, as
    ``argmin`` does).
    """
    if not w.is_floating_point():
        raise TypeError(f"quantize_nf4 takes a floating-point tensor, got {w.dtype}")
    if w.numel() % block_size or block_size % 2:
        raise ValueError(
            f"{w.numel()} elements are not a whole number of blocks of {block_size} (an even size): "
            "pad the weight, or choose a block size that divides it"
        )
    blocks = w.detach().float().reshape(-1, block_size)
    absmax = blocks.abs().amax(1)
    inv = torch.where(absmax > 0, 1 / absmax, torch.zeros_like(absmax))  # an all-zero block stays zero
    scaled = (blocks * inv.unsqueeze(1)).clamp(-1, 1).reshape(-1)
    midpoints = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2
    codes = torch.bucketize(scaled, midpoints).to(torch.uint8)  # right=False: a midpoint goes to the lower code
    packed = (codes[0::2] << 4) | codes[1::2]
    if not double_quant:
        return NF4Tensor(packed, absmax, tuple(w.shape), block_size)
    q, scale, offset = _quantize_constants(absmax, dq_block_size)
    return NF4Tensor(packed, q, tuple(w.shape), block_size, absmax_scale=scale, absmax_offset=offset)


def dequantize_nf4(
    t: NF4Tensor, dtype: torch.dtype = torch.float32, dq_block_size: int = DQ_BLOCK_SIZE
) -> torch.Tensor:
    """ŵᵢ = q_{codeᵢ} · c_b, with c_b itself dequantized first when double quantization was used."""
    codes = torch.stack([t.packed >> 4, t.packed & 0xF], dim=-1).reshape(-1)
    absmax = t.absmax
    if t.double_quantized:
        absmax = _dequantize_constants(t.absmax, t.absmax_scale, t.absmax_offset, dq_block_size)
    values = NF4_CODE[codes.long()].reshape(-1, t.block_size) * absmax.unsqueeze(1)
    return values.reshape(t.shape).to(dtype)


def nf4_nbytes(t: NF4Tensor) -> int:
    """Bytes held by every stored tensor of ``t``."""
    held = [t.packed, t.absmax] + ([t.absmax_scale, t.absmax_offset] if t.double_quantized else [])
    return sum(x.numel() * x.element_size() for x in held)


def nf4_bits_per_parameter(
    block_size: int = BLOCK_SIZE, double_quant: bool = False, dq_block_size: int = DQ_BLOCK_SIZE
) -> float:
    """QLoRA §3: 4 + 32/B, or 4 + 8/B + 32/(B·B₂) with double quantization (the one fp32 mean not counted)."""
    if double_quant:
        return 4 + 8 / block_size + 32 / (block_size * dq_block_size)
    return 4 + 32 / block_size
