"""course_lib.precision.mxfp4: storage, the shared E8M0 scale, the error bound from E2M1's spacing, and torchao.

torchao's ``MXTensor.to_mx`` is the side-by-side reference (pinned in pyproject.toml). If it is missing, the
comparison fails and says how to install it: a reference that cannot run is not a pass.
"""

import math

import pytest
import torch

from course_lib.precision.formats import representable_values
from course_lib.precision.mxfp4 import (
    BITS_PER_ELEMENT,
    BLOCK_SIZE,
    dequantize_mxfp4,
    mxfp4_nbytes,
    quantize_mxfp4,
)

GRID = representable_values("fp4_e2m1")  # 0, 0.5, 1, 1.5, 2, 3, 4, 6


def _sample(rows=64, cols=256, seed=0):
    """Gaussian blocks whose magnitudes span 2^±12, one all-zero block, one block with a lone outlier and one
    block of exact ties between E2M1 neighbours (ties go to the even mantissa)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    spread = torch.exp2(torch.randint(-12, 13, (rows, cols // BLOCK_SIZE, 1), generator=g).float())
    x = (x.reshape(rows, -1, BLOCK_SIZE) * spread).reshape(rows, cols)
    x[0, :BLOCK_SIZE] = 0.0
    x[1, BLOCK_SIZE] = 1e4
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x[2, :BLOCK_SIZE] = 8 * torch.cat([torch.tensor([6.0]), ties, -ties, torch.zeros(17)])  # X = 8
    return x


def _scale(scales):
    return torch.exp2(scales.view(torch.uint8).double() - 127)


def test_stored_tensors_hold_4_25_bits_per_element():
    x = _sample()
    packed, scales = quantize_mxfp4(x)
    assert packed.dtype == torch.float4_e2m1fn_x2 and scales.dtype == torch.float8_e8m0fnu, (
        "elements are stored as torch.float4_e2m1fn_x2 (two per byte), scales as torch.float8_e8m0fnu"
    )
    assert packed.shape == (64, 128) and scales.shape == (64, 256 // BLOCK_SIZE)
    bits = 8 * mxfp4_nbytes(packed, scales) / x.numel()
    assert bits == BITS_PER_ELEMENT == 4.25, f"n/2 + n/32 bytes is 4.25 bits per element; measured {bits}"


def test_shared_scale_is_floor_log2_amax_minus_emax_elem():
    """X = 2^(floor(log2 amax) − 2): amax/X lands in [4, 8), so E2M1's top power of two, 4, holds amax's exponent."""
    x = _sample()
    _, scales = quantize_mxfp4(x)
    amax = x.double().reshape(64, -1, BLOCK_SIZE).abs().amax(-1)
    nonzero = amax > 0
    expected = torch.floor(torch.log2(amax[nonzero])) - 2
    assert torch.equal(torch.log2(_scale(scales)[nonzero]), expected), "the E8M0 exponent must be floor(log2 amax) − 2"
    ratio = amax[nonzero] / _scale(scales)[nonzero]
    assert ((ratio >= 4) & (ratio < 8)).all(), f"amax/X must lie in [4, 8); got {ratio.min()}..{ratio.max()}"
    assert scales.view(torch.uint8)[0, 0] == 0, "an all-zero block takes the smallest scale, 2^−127"


def test_ties_go_to_the_even_mantissa():
    out = dequantize_mxfp4(*quantize_mxfp4(_sample()))[2, 1:8] / 8
    assert out.tolist() == [0, 1, 1, 2, 2, 4, 4], f"X·{{0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5}} became X·{out.tolist()}"


def test_values_on_the_grid_round_trip_exactly():
    """X·P for every E2M1 value P (block amax 6·X) must come back unchanged: nothing to round."""
    signed = torch.cat([GRID, -GRID]).float()  # 16 values, twice per block; two blocks at two scales
    x = signed.repeat(4) * torch.tensor([2.0**-5] * 32 + [2.0**9] * 32)
    out = dequantize_mxfp4(*quantize_mxfp4(x))
    assert torch.equal(out, x), f"grid values changed: {x[out != x][:4].tolist()} -> {out[out != x][:4].tolist()}"


def test_round_trip_error_is_bounded_by_e2m1_spacing():
    """|v̂ − v| ≤ X·g(|v|/X) (g = half-gap: 0.25, 0.5, 1 on [0,2], [2,4], [4,6]); above 6X it saturates, < 2X ≤ amax/2."""
    x = _sample(seed=1).double()
    packed, scales = quantize_mxfp4(x.float())
    out = dequantize_mxfp4(packed, scales).double()
    X = _scale(scales).repeat_interleave(BLOCK_SIZE, dim=-1)
    t = x.abs() / X
    half_gap = torch.where(t <= 2, 0.25, torch.where(t <= 4, 0.5, 1.0))
    bound = torch.where(t <= 6, X * half_gap, x.abs() - 6 * X)  # saturation: v̂ = ±6X exactly
    err = (out - x).abs()
    assert (err <= bound).all(), f"error above the E2M1 bound at |v|/X = {t[err > bound][:4].tolist()}"
    assert (err < 2 * X).all() and (err <= x.abs().reshape(64, -1, 32).amax(-1).repeat_interleave(32, -1) / 2).all()
    mid = (t >= 1) & (t <= 6)
    rel = err[mid] / x.abs()[mid]
    assert rel.max() <= 0.25, f"relative error for 1 ≤ |v|/X ≤ 6 must stay within E2M1's u = 1/4, got {rel.max()}"
    saturated = t > 6
    assert saturated.any() and (out[saturated].abs() == 6 * X[saturated]).all(), (
        "with the floor scale some block maxima exceed 6X; they must saturate to ±6X (OCP spec, clamp)"
    )


def test_wrong_shapes_and_non_finite_inputs_are_explained():
    with pytest.raises(ValueError, match="multiple of the block size"):
        quantize_mxfp4(torch.ones(3, 48))
    with pytest.raises(ValueError, match="NaN"):
        quantize_mxfp4(torch.tensor([math.nan] + [0.0] * 31))


def _torchao():
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError as e:
        pytest.fail(
            f"torchao is not importable ({e}). It is the reference for MXFP4: install the pinned version from "
            "pyproject.toml (`.venv/bin/pip install -e .`, or `pip install torchao==0.18.0`)."
        )
    return MXTensor, ScaleCalculationMode, KernelPreference


def test_equals_torchao_mxtensor_floor_scaling():
    """Same input, torchao's emulated MX cast with FLOOR scaling (the spec's, and torchao's default): bit-equal."""
    MXTensor, Mode, Kernel = _torchao()
    x = _sample(seed=2)
    mx = MXTensor.to_mx(
        x, torch.float4_e2m1fn_x2, BLOCK_SIZE, scaling_mode=Mode.FLOOR, kernel_preference=Kernel.EMULATED
    )
    packed, scales = quantize_mxfp4(x)
    assert torch.equal(scales.view(torch.uint8), mx.scale.view(torch.uint8).reshape(scales.shape)), (
        "E8M0 scale bytes differ from torchao's"
    )
    assert torch.equal(packed.view(torch.uint8), mx.qdata.view(torch.uint8).reshape(packed.shape)), (
        "packed E2M1 bytes differ from torchao's (check nibble order: element 2j low, 2j+1 high)"
    )
    ours, theirs = dequantize_mxfp4(packed, scales), mx.dequantize(torch.float32)
    bad = ours != theirs
    assert not bad.any(), f"dequantized values differ at {x[bad][:4].tolist()}: {ours[bad][:4]} vs {theirs[bad][:4]}"


def test_torchao_rceil_scale_is_one_step_up_exactly_when_floor_saturates():
    """RCEIL (cuBLAS) takes X = 2^ceil(log2(amax/6)). With amax = m·2^E, m ∈ [1, 2), that is our floor scale when
    m ≤ 1.5 and twice it when m > 1.5 — exactly the blocks whose maximum would saturate (amax/X > 6)."""
    MXTensor, Mode, Kernel = _torchao()
    x = _sample(seed=3)
    mx = MXTensor.to_mx(
        x, torch.float4_e2m1fn_x2, BLOCK_SIZE, scaling_mode=Mode.RCEIL, kernel_preference=Kernel.EMULATED
    )
    _, scales = quantize_mxfp4(x)
    ours = scales.view(torch.uint8).int()
    theirs = mx.scale.view(torch.uint8).reshape(ours.shape).int()
    amax = x.double().reshape(64, -1, BLOCK_SIZE).abs().amax(-1)
    saturates = (amax / _scale(scales)) > 6
    nonzero = amax > 0
    assert saturates.any() and (~saturates & nonzero).any(), "the sample must contain both kinds of block"
    assert torch.equal((theirs - ours)[nonzero], saturates.int()[nonzero]), (
        "RCEIL's exponent should exceed FLOOR's by one exactly in the blocks where amax/X_floor > 6"
    )
