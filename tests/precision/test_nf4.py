"""course_lib.precision.nf4: the NF4 table, blockwise quantization and double quantization, against bitsandbytes.

bitsandbytes (pinned in pyproject.toml) is the side-by-side reference; without it the comparisons fail and say
how to install it.
"""

import pytest
import torch

from course_lib.cost.memory import nf4_bits_per_parameter, nf4_bytes
from course_lib.precision.formats import FORMATS
from course_lib.precision.nf4 import NF4_CODE, dequantize_nf4, nf4_nbytes, quantize_nf4


def _bnb():
    try:
        import bitsandbytes.functional as F
    except ImportError as e:
        pytest.fail(
            f"bitsandbytes is not importable ({e}). It is the reference for NF4: install the pinned version from "
            "pyproject.toml (`.venv/bin/pip install -e .`, or `pip install bitsandbytes==0.50.2`)."
        )
    return F


def _weights(shape=(256, 512), seed=0):
    """A weight matrix as QLoRA meets it: roughly normal, small, with a few larger entries."""
    g = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(shape, generator=g)
    w[torch.rand(shape, generator=g) < 1e-3] *= 8
    return w


def test_nf4_table_is_normal_quantiles_with_an_exact_zero():
    q = NF4_CODE
    assert q.shape == (16,) and (q[1:] > q[:-1]).all(), "16 distinct codes, ascending"
    assert (q[0], q[7], q[15]) == (-1.0, 0.0, 1.0), "normalised to [−1, 1] with an exact zero at index 7"
    assert (q > 0).sum() == 8 and (q < 0).sum() == 7, "asymmetric: 8 positive quantiles, 7 negative"


def test_nf4_table_equals_bitsandbytes():
    F = _bnb()
    theirs = F.get_4bit_type("nf4", device="cpu").float()
    # Same construction (δ = 0.9677083, float32 probability grid, quantile in float64, float32 table), so equal
    # bit for bit; with the exact δ = 0.96770833… they would differ by up to 3e-7 (measured).
    assert torch.equal(NF4_CODE, theirs), f"ours {NF4_CODE.tolist()}\nbnb  {theirs.tolist()}"


def test_round_trip_equals_bitsandbytes_bit_for_bit():
    """Same float32 steps as bitsandbytes (w·(1/absmax), nearest code, code·absmax): packed bytes, absmax and
    dequantized weights must be identical, not just close."""
    F = _bnb()
    w = _weights()
    ours = quantize_nf4(w, block_size=64)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(ours.absmax, state.absmax), "per-block absmax differs from bitsandbytes'"
    same = ours.packed == packed.view(torch.uint8).reshape(-1)
    assert same.all(), f"{(~same).sum()} of {same.numel()} packed bytes differ (first code in the high nibble)"
    theirs = F.dequantize_4bit(packed, state)
    mine = dequantize_nf4(ours)
    assert mine.shape == w.shape and torch.equal(mine, theirs), (
        f"max |ours − bnb| = {(mine - theirs).abs().max():.3g}: look at the midpoints between codes"
    )


def test_blockwise_error_is_bounded_by_the_nf4_gaps():
    """|ŵ − w| ≤ c_b · (largest half-gap of the table), the gap between q₀ = −1 and q₁ ≈ −0.696: ≈ 0.152·c_b."""
    w = _weights(seed=1)
    t = quantize_nf4(w)
    err = (dequantize_nf4(t) - w).abs().reshape(-1, 64)
    half_gap = ((NF4_CODE[1:] - NF4_CODE[:-1]) / 2).max()
    assert (err <= half_gap * t.absmax.unsqueeze(1) * (1 + 1e-6)).all(), "an element left its nearest code"
    blocks = w.reshape(-1, 64).abs()
    at_max = blocks == blocks.amax(1, keepdim=True)
    assert (err[at_max] == 0).all(), "each block's absmax element is ±1·c_b: it must round-trip exactly"


def test_double_quantization_error_and_comparison_with_bitsandbytes():
    """Constants: |ĉ − c| ≤ max(2^−4·|c − mean|, 2^−10·c₂) (e4m3: u = 2^−4 relative, subnormal half-step
    2^−10 of the block's scale c₂). End to end, our e4m3 second level and bitsandbytes' dynamic 8-bit code give
    almost the same weight error: within 10 % of each other in RMS (measured: see the message)."""
    F = _bnb()
    w = _weights((512, 512), seed=2)  # 4096 constants: 16 blocks of 256
    single, double = quantize_nf4(w), quantize_nf4(w, double_quant=True)
    assert double.absmax.dtype == torch.float8_e4m3fn and double.absmax_scale.numel() == 4096 // 256
    c = single.absmax.double()
    c_hat = (double.absmax.double().reshape(-1, 256) * double.absmax_scale.double().unsqueeze(1)).reshape(-1)
    c_hat = c_hat + double.absmax_offset.double()
    centred = c - double.absmax_offset.double()
    c2 = double.absmax_scale.double().repeat_interleave(256)
    bound = torch.maximum(FORMATS["fp8_e4m3"].unit_roundoff * centred.abs(), 2.0**-10 * c2) * (1 + 1e-5)
    slack = 2.0**-22 * c  # float32 arithmetic around the offset (a few ulps of c)
    assert ((c_hat - c).abs() <= bound + slack).all(), "a double-quantized constant is outside e4m3's rounding bound"

    rms = lambda a: (a - w).pow(2).mean().sqrt().item()
    ours_single, ours_double = rms(dequantize_nf4(single)), rms(dequantize_nf4(double))
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    bnb_double = rms(F.dequantize_4bit(packed, state))
    assert abs(ours_double - bnb_double) <= 0.1 * bnb_double, (
        f"RMS error: ours single {ours_single:.4g}, ours double {ours_double:.4g}, bitsandbytes double {bnb_double:.4g}"
    )
    assert ours_double <= 1.05 * ours_single, "double quantization should add little to the 4-bit error"


def test_measured_bytes_equal_the_qlora_formula():
    w = _weights((256, 256))  # 65,536 parameters: 1024 blocks of 64, 4 blocks of 256 constants
    n = w.numel()
    single = 8 * nf4_nbytes(quantize_nf4(w)) / n
    assert single == nf4_bits_per_parameter() == 4 + 32 / 64, f"4 + 32/64 bits per parameter, measured {single}"
    double = 8 * nf4_nbytes(quantize_nf4(w, double_quant=True)) / n
    formula = nf4_bits_per_parameter(double_quant=True)
    assert formula == 4 + 8 / 64 + 32 / (64 * 256)
    assert double == formula + 32 / n, f"4 + 8/64 + 32/(64·256) bits, plus the one fp32 mean: measured {double}"


@pytest.mark.parametrize("shape", [(256, 256), (96, 64), (3, 64 * 300)], ids=["whole", "one-partial", "partial"])
@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double"])
def test_measured_bytes_equal_the_exact_formula(shape, double_quant):
    """cost.memory.nf4_bytes, byte for byte, also when the constants do not fill their last block of 256
    (96·64 = 6144 elements: 96 constants, one partial block; 3·19200: 900 constants, 3 full + 1 partial)."""
    t = quantize_nf4(_weights(shape), double_quant=double_quant)
    n = shape[0] * shape[1]
    assert nf4_nbytes(t) == nf4_bytes(n, double_quant=double_quant), (
        f"{shape}, double_quant={double_quant}: measured {nf4_nbytes(t)} B, formula {nf4_bytes(n, double_quant=double_quant)} B"
    )


def test_bad_block_sizes_are_explained():
    with pytest.raises(ValueError, match="whole number of blocks"):
        quantize_nf4(torch.ones(100))
