"""MXFP4: 4-bit floats that share one power-of-two scale per block of 32 (OCP Microscaling Formats v1.0).

A block of k = 32 consecutive elements v₁ … v₃₂ (along the last dimension) is stored as one shared scale X and
32 elements Pᵢ (OCP MX spec v1.0, §5, and its "minimally supported" conversion in §6.3):

    X  = 2^(floor(log2 amax) − emax_elem),   amax = maxᵢ |vᵢ|,   emax_elem = 2 for E2M1 (its largest power of two is 4)
    Pᵢ = round_E2M1(vᵢ / X)                  nearest value, ties to the even mantissa, saturating at ±6
    vᵢ ≈ X · Pᵢ

X is stored in E8M0 (8 exponent bits, no sign, no mantissa, bias 127, 0xFF = NaN): the byte e means 2^(e−127).
Pᵢ is stored in E2M1 (:data:`course_lib.precision.formats.FORMATS` ``["fp4_e2m1"]``): the sixteen codes are
±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, and the 3 magnitude bits, read as an integer, are the position in that list.
Two codes share a byte: element 2j in the low nibble, element 2j+1 in the high nibble (the order of torchao's
``pack_uint4`` and of PyTorch's own ``float4_e2m1fn_x2`` tests). Storage per element:

    bytes = n/2 + n/32   →   4 + 8/32 = 4.25 bits per element

Error. amax/X lies in [4, 8), so values of up to 8·X must fit a grid that ends at 6: the elements of a block
that land in (6, 8)·X saturate to 6·X. With g(t) the half-gap of the E2M1 grid at t = |v|/X (0.25 on [0, 2],
0.5 on [2, 4], 1 on [4, 6]):

    |v̂ − v| ≤ X · g(|v|/X)      when |v| ≤ 6X
    |v̂ − v| = |v| − 6X < 2X     when |v| > 6X   (saturation)

so |v̂ − v| < 2X ≤ amax/2 for every element, and the relative error is at most 1/4 (E2M1's unit roundoff
2^−(M+1)) for 1 ≤ |v|/X ≤ 6. The floor in X is what the spec prescribes (torchao calls it
``ScaleCalculationMode.FLOOR``, its default); rounding amax up instead (``RCEIL``, cuBLAS's recipe) removes the
saturation at the price of one bit of range for small elements.

Where it is used: gpt-oss ships its MoE weights in MXFP4 (OpenAI, 2025), so 120B parameters fit one 80 GB GPU.

Storage here is torch's own dtypes: ``torch.float4_e2m1fn_x2`` (one byte, two elements) for the elements and
``torch.float8_e8m0fnu`` for the scales. torch 2.13 on CPU can hold them and view them as bytes but does no
arithmetic on them, so the codes are computed as uint8 and viewed as those dtypes at the end.
"""

from __future__ import annotations

import torch

from course_lib.precision.formats import FORMATS, representable_values, round_to_format

__all__ = [
    "BITS_PER_ELEMENT",
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "dequantize_mxfp4",
    "mxfp4_nbytes",
    "quantize_mxfp4",
]

BLOCK_SIZE = 32  # k in the OCP spec: elements per shared scale
E2M1 = FORMATS["fp4_e2m1"]
EMAX_ELEM = E2M1.max_exponent  # 2: 4 = 2² is E2M1's largest power of two
E8M0_BIAS = 127
E8M0_NAN = 255
BITS_PER_ELEMENT = E2M1.bits + 8 / BLOCK_SIZE  # 4 + 8/32 = 4.25

# Value of each 4-bit code: bit 3 is the sign, bits 2..0 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
_MAGNITUDES = representable_values(E2M1)  # float64, sorted, 8 values
E2M1_VALUES = torch.cat([_MAGNITUDES, -_MAGNITUDES]).float()


def quantize_mxfp4(x: torch.Tensor, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x to MXFP4 along its last dimension; returns ``(packed, scales)``.

    ``packed``: ``float4_e2m1fn_x2``, shape ``(*x.shape[:-1], x.shape[-1] // 2)``, two elements per byte.
    ``scales``: ``float8_e8m0fnu``, shape ``(*x.shape[:-1], x.shape[-1] // block_size)``, the exponent of X.
    Computed in float64 from x's float32 values: dividing by a power of two is exact there, so the E2M1
    rounding is the only rounding.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize_mxfp4 takes a floating-point tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % block_size or block_size % 2:
        raise ValueError(
            f"the last dimension ({tuple(x.shape)}) must be a multiple of the block size {block_size} (itself even): "
            "MX shares one scale per block of consecutive elements; pad the tensor first"
        )
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = blocks.abs().amax(-1)
    if not torch.isfinite(amax).all():
        raise ValueError("the input holds inf or NaN: an MX block would get the NaN scale 0xFF")
    _, exp = torch.frexp(amax)  # amax = m · 2^exp with m in [0.5, 1): floor(log2 amax) = exp − 1
    floor_log2 = torch.where(amax > 0, exp - 1, torch.full_like(exp, -E8M0_BIAS))  # an all-zero block: any X works
    scale_exp = (floor_log2 - EMAX_ELEM).clamp(-E8M0_BIAS, E8M0_BIAS)  # E8M0 covers 2^−127 … 2^127

    scaled = torch.ldexp(blocks.double(), -scale_exp.unsqueeze(-1).double())  # v / X, exact
    rounded = round_to_format(scaled, E2M1)  # nearest E2M1 value, ties to even, ±6 saturation
    magnitude_code = torch.searchsorted(_MAGNITUDES.to(rounded.device), rounded.abs().contiguous())  # host table, moved
    sign = torch.signbit(scaled).long()  # from the input, so −0 and tiny negatives keep it, as in torchao
    codes = (magnitude_code | (sign << 3)).to(torch.uint8)
    codes = codes.reshape(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (scale_exp + E8M0_BIAS).to(torch.uint8)
    return packed.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e8m0fnu)


def dequantize_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, block_size: int = BLOCK_SIZE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """X · Pᵢ for every element: unpack the nibbles, look up the E2M1 values, multiply by 2^(e − 127)."""
    data = packed.view(torch.uint8)
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)
    values = E2M1_VALUES.to(codes.device)[codes.long()]  # the host table, where the codes are
    e = scales.view(torch.uint8).to(torch.int32)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), (e - E8M0_BIAS).float())
    scale = torch.where(e == E8M0_NAN, torch.full_like(scale, float("nan")), scale)
    blocks = values.reshape(*values.shape[:-1], -1, block_size) * scale.unsqueeze(-1)
    return blocks.reshape(values.shape).to(dtype)


def mxfp4_nbytes(packed: torch.Tensor, scales: torch.Tensor) -> int:
    """Bytes actually held by the two stored tensors (expected n/2 + n/32 for n elements)."""
    return packed.numel() * packed.element_size() + scales.numel() * scales.element_size()
